"""LoRA (--lora-rank) on the recipes beside GRPO: SFT, DPO, OPD (reverse KL to a teacher server) and DAgger
(mixed-loss DAgger-OPD: cross-entropy on the teacher's tokens, reverse KL on the student's) each train a step on
the torchrun loop (one forked gloo rank, no Ray; rollouts and teacher scores from CPU engines served in this
process). Each saved checkpoint is read back into a fresh model: the policy's base weights are bit-for-bit the starting checkpoint's, its adapters
moved (only they had gradients and optimizer state).
"""

from __future__ import annotations

import math
import os

import pytest

from tests.trainer.training_fixtures import ATTACHED_SERVER_KEY, run_config, write_tiny_run_files

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

LORA = dict(lora_rank=4, lora_alpha=8.0)
SPMD_RECIPES = {
    "sft": dict(prompt_data="sft"),
    "dpo": dict(prompt_data="dpo", ref_load="policy"),
    "opd": dict(prompt_data="prompts", teacher="teacher"),
    "mixture_dagger_opd": dict(prompt_data="prompts", teacher="teacher", dagger_beta_schedule="linear",
                               dagger_beta_start=0.5, dagger_beta_end=0.5),
}
"""Recipe -> run values (file names stand for the tiny files; `teacher` for a served teacher's URL)."""


def adapters_and_base_drift(step_folder: str, role: str, policy: str, settings) -> tuple[float, float]:
    """(largest |B| of the saved adapters, largest difference between the saved base weights and `policy`'s)."""
    from stacx.checkpointing.torch_dist import load_torch_dist
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.models.lora import attach_lora
    from stacx.serving.cpu_engine import ensure_single_process_layout
    from stacx.trainer.checkpoint import role_model_folder

    groups = ensure_single_process_layout()
    saved = build_model(policy, groups, initialize_weights=False)
    attach_lora(saved, settings, groups)
    load_torch_dist(str(role_model_folder(step_folder, role)), saved)
    start = build_model(policy, groups, initialize_weights=False)
    load_hf_checkpoint(start, policy, groups)
    base = dict(start.named_parameters())
    adapters, drift = 0.0, 0.0
    for name, param in saved.named_parameters():
        if name.endswith("lora_b"):
            adapters = max(adapters, float(param.abs().max()))
        elif not name.endswith("lora_a"):
            assert not param.requires_grad, name  # the base is frozen
            drift = max(drift, float((param - base[name]).abs().max()))
    return adapters, drift


def train_each_recipe_with_lora(groups, root: str, files: dict, urls: dict) -> dict:
    """In one rank: a one-step LoRA run of every SPMD_RECIPES recipe, saved; per recipe its metrics and what
    `adapters_and_base_drift` finds in the checkpoint."""
    from stacx.models.lora import LoraSettings
    from stacx.testing.distributed import find_free_port
    from stacx.trainer.spmd import run_spmd

    settings = LoraSettings(rank=LORA["lora_rank"], alpha=LORA["lora_alpha"])
    results = {}
    for recipe, values in SPMD_RECIPES.items():
        values = dict(values)
        values["prompt_data"] = files[values["prompt_data"]]
        if "ref_load" in values:
            values["ref_load"] = files[values["ref_load"]]
        if values.pop("teacher", None):  # each run its own policy engine: a run's pushes number from 1
            values.update(teacher_url=urls["teacher"], rollout_engine="http", rollout_urls=[urls[recipe]])
        save = os.path.join(root, recipe, "ckpt")
        metrics = run_spmd(run_config(os.path.join(root, recipe), train={"algorithm": recipe},
                                      hf_checkpoint=files["policy"], num_steps=1, lr=1e-2, save=save,
                                      out=os.path.join(root, recipe, "out"), **LORA, **values))
        os.environ["MASTER_PORT"] = str(find_free_port())  # the run's teardown destroyed the process group
        results[recipe] = (metrics, adapters_and_base_drift(os.path.join(save, "step_000000001"), "policy",
                                                            files["policy"], settings))
    return results


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny files, and CPU engines on the teacher and on the policy for each recipe that rolls out (merged
    pushes)."""
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.serving.server import EngineHttpServer

    root = tmp_path_factory.mktemp("lora_recipes")
    files = write_tiny_run_files(str(root / "files"))
    ensure_single_process_layout()
    served_files = {"teacher": files["teacher"], **{recipe: files["policy"] for recipe, values in SPMD_RECIPES.items()
                                                    if "teacher" in values}}
    servers = {name: EngineHttpServer(CpuEngine.from_hf_checkpoint(path, seed=0), api_key=ATTACHED_SERVER_KEY).start()
               for name, path in served_files.items()}
    yield root, files, {name: server.url for name, server in servers.items()}
    for server in servers.values():
        server.stop()
    destroy_parallel_layout()


def test_sft_dpo_opd_and_dagger_train_only_their_adapters(served, monkeypatch):
    from stacx.testing.distributed import run_distributed

    root, files, urls = served
    monkeypatch.setenv("STACX_API_KEY", ATTACHED_SERVER_KEY)
    results = run_distributed(train_each_recipe_with_lora, 1, args=(str(root), files, urls), timeout_s=500)[0]
    assert sorted(results) == sorted(SPMD_RECIPES)
    for recipe, (metrics, (adapters, drift)) in results.items():
        assert math.isfinite(metrics["policy/loss"]) and metrics["policy/grad_norm"] > 0, (recipe, metrics)
        assert adapters > 0, recipe  # B started at zero: the step moved the adapters
        assert drift == 0.0, recipe  # ... and nothing else
    # DPO: the reference is the base with the adapters off, equal to the policy at the first step (B = 0)
    assert results["dpo"][0]["policy/loss"] == pytest.approx(math.log(2), rel=1e-5)
    # OPD's loss is the reverse KL to the teacher: two different random models, so it is positive
    assert results["opd"][0]["policy/loss"] > 0
    assert results["mixture_dagger_opd"][0]["policy/num_teacher_tokens"] > 0
    assert results["mixture_dagger_opd"][0]["policy/num_student_tokens"] > 0
