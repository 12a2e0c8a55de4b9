"""torch_dist folders written by megatron-core's `dist_checkpointing.save` itself, not by Stacx: flat,
and in Megatron-LM's layout (`latest_checkpointed_iteration.txt` naming `iter_0000007/` or `release/`),
none with a config.json. They load as --ref-load, as --load start weights and through
`stacx convert torch-dist-to-hf`, with the model's config from --hf-checkpoint; preflight accepts
them and names the right flag and role when the tracker points nowhere."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from stacx.checkpointing.convert import convert_torch_dist_to_hf, single_process_world
from stacx.checkpointing.folders import (TORCH_DIST, TRACKER_FILE, detect_model_folder, is_model_folder,
                                        load_model_weights)
from stacx.models import build_model
from stacx.models.builder import unwrap_model
from stacx.models.checkpoint import load_hf_checkpoint
from stacx.models.testing import save_tiny_hf_checkpoint
from stacx.trainer.config.checks import PreflightError


def _save_with_megatron_core(model, folder: Path) -> None:
    """What Megatron-LM's save_checkpoint hands megatron-core for one model chunk: the model's sharded
    state under "model" beside plain values, its `args` namespace among them (in common.pt, which
    loads because megatron-core registers argparse.Namespace with torch's weights-only unpickler)."""
    from megatron.core import dist_checkpointing

    from stacx.checkpointing import torch_dist

    torch_dist._use_in_process_results_queue()  # no multiprocessing.Manager server process (seconds)
    args = argparse.Namespace(tensor_model_parallel_size=1, ckpt_format="torch_dist", iteration=7)
    state = {"model": unwrap_model(model).sharded_state_dict(), "args": args, "checkpoint_version": 3.0,
             "iteration": 7, "num_floating_point_operations_so_far": 0}
    folder.mkdir(parents=True)
    dist_checkpointing.save(state, str(folder))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """--hf-checkpoint (seed 0), and the weights of another model (seed 1) in the three layouts."""
    root = tmp_path_factory.mktemp("megatron_lm")
    config, weights = str(root / "hf"), str(root / "other_hf")
    save_tiny_hf_checkpoint(config, "llama", seed=0)
    save_tiny_hf_checkpoint(weights, "llama", seed=1)
    with single_process_world() as groups:
        model = build_model(weights, groups, initialize_weights=False)
        load_hf_checkpoint(model, weights, groups)
        expected = {name: p.detach().clone() for name, p in unwrap_model(model).named_parameters()}
        _save_with_megatron_core(model, root / "iter" / "iter_0000007")
        (root / "iter" / TRACKER_FILE).write_text("7\n")
        _save_with_megatron_core(model, root / "release" / "release")
        (root / "release" / TRACKER_FILE).write_text("release")
        _save_with_megatron_core(model, root / "flat")
    return {"root": root, "hf": config, "weights": weights, "expected": expected}


def _assert_holds(model, expected: dict) -> None:
    got = dict(unwrap_model(model).named_parameters())
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_megatron_lm_and_flat_folders_load_as_reference_start_weights_and_conversion_input(folders, tmp_path):
    from stacx.trainer.factory import resolve_recipe
    from stacx.trainer.runtime.role_runtime import RoleRuntime
    from tests.trainer.training_fixtures import run_config

    root, expected = folders["root"], folders["expected"]
    for name in ("iter", "release", "flat"):
        assert not (root / name / "config.json").exists()
        assert detect_model_folder(root / name, flag="--ref-load") == TORCH_DIST and is_model_folder(root / name)
    with single_process_world() as groups:
        for name in ("iter", "release", "flat"):
            model = build_model(folders["hf"], groups, initialize_weights=False)  # the config of --hf-checkpoint
            load_model_weights(model, root / name, groups, flag="--ref-load")
            _assert_holds(model, expected)
        config = run_config(str(tmp_path), train={"algorithm": "dpo"}, hf_checkpoint=folders["hf"],
                            ref_load=str(root / "iter"))
        recipe, algorithm = resolve_recipe(config)
        runtime = RoleRuntime(recipe.roles[0], algorithm, groups, model=config.model, optim=config.optim,
                              train=config.train)
        # The reference holds the folder's weights; the policy starts from --hf-checkpoint's (another seed).
        same = [torch.equal(r, t) for r, t in zip(runtime.reference_weights, expected.values())]
        assert same == [True] * len(expected)
        assert not torch.equal(runtime.reference_weights[0], next(unwrap_model(runtime.model).parameters()))
        runtime.load_start_weights(str(root / "release"))  # --load naming a model folder
        _assert_holds(runtime.model, expected)
        runtime.close()
        out = convert_torch_dist_to_hf(root / "iter", tmp_path / "hf_out", hf_config=folders["hf"])
    from safetensors.torch import load_file

    exported = load_file(Path(out) / "model.safetensors")
    original = load_file(Path(folders["weights"]) / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[key], original[key]) for key in original)


def test_preflight_accepts_them_without_config_json_and_names_the_flag_and_role(folders, tmp_path):
    """It refused a torch_dist --ref-load without config.json saying role 'policy' starts from it."""
    from stacx.trainer.factory import resolve_recipe
    from stacx.trainer.preflight import check_checkpoints, check_resume_and_save
    from tests.trainer.training_fixtures import run_config

    root = folders["root"]
    for reference, load in ((root / "iter", root / "release"), (root / "flat", root / "iter")):
        config = run_config(str(tmp_path), train={"algorithm": "dpo"}, hf_checkpoint=folders["hf"],
                            ref_load=str(reference), load=str(load))
        recipe, algorithm = resolve_recipe(config)
        check_checkpoints(config, recipe, algorithm)
        check_resume_and_save(config)
    broken = tmp_path / "broken"
    (broken / "iter_0000007").mkdir(parents=True)
    (broken / TRACKER_FILE).write_text("9")
    config = run_config(str(tmp_path), train={"algorithm": "dpo"}, hf_checkpoint=folders["hf"], ref_load=str(broken))
    recipe, algorithm = resolve_recipe(config)
    with pytest.raises(PreflightError, match=rf"--ref-load .*broken: {TRACKER_FILE} names '9', but iter_0000009/ does "
                                             r"not exist \(its folders: iter_0000007\).*\(role 'policy' computes its "
                                             r"reference log-probs"):
        check_checkpoints(config, recipe, algorithm)
    config = run_config(str(tmp_path), hf_checkpoint=folders["hf"], load=str(broken))
    with pytest.raises(PreflightError, match=rf"--load .*broken: {TRACKER_FILE} names '9'.*starts from its weights"):
        check_resume_and_save(config)
