"""A critic starts from a trained value head (stacx.checkpointing.value_head, stacx.models.value_head_weights).

One forked gloo rank builds PPO's critic (`RoleRuntime`) from a tiny Qwen3, gives its value head random values,
saves the role's weights as a run saves them (torch_dist, with its optimizer), and builds the critic again from:
- that torch_dist folder (`--critic-load` of a run's `roles/critic/model`): the same head and the same values;
- its `stacx convert` export (`score.weight` and `score.bias`, *ForTokenClassification with one label): the same
  values to 1e-6, and transformers' AutoModelForTokenClassification loads the folder with no missing tensor;
- TRL's names (`v_head.summary.weight`, `v_head.summary.bias` beside the causal LM's tensors) and a
  *ForSequenceClassification folder (`score.weight` without bias, no `lm_head.weight`): their head;
- a folder without a head: a zero head, and one log line saying so.
A critic trained with --lora-critic adapters exports merged (W + s B A and its head: the same values read back) and
is refused as a PEFT adapter folder (which would lose its head).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from stacx.testing.distributed import run_distributed

HIDDEN = 32


def _merged_export(folder: str, out: str, checkpoint: str) -> str:
    from stacx.checkpointing.lora_export import export_lora_role
    from stacx.models.lora import LoraSettings

    return export_lora_role(folder, out, checkpoint, LoraSettings(rank=4, alpha=8.0), mode="merged")


def _adapter_refusal(folder: str, checkpoint: str) -> str | None:
    from stacx.checkpointing.lora_export import export_lora_role
    from stacx.models.lora import LoraSettings

    try:
        export_lora_role(folder, folder + "_peft", checkpoint, LoraSettings(rank=4, alpha=8.0), mode="adapter")
    except ValueError as err:
        return str(err)
    return None


def _critic(groups, checkpoint: str, critic_load: str | None = None, lora: dict | None = None):
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.factory import resolve_recipe
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    values = {"train": {"algorithm": "ppo"}, "hf_checkpoint": checkpoint, **(lora or {})}
    if critic_load is not None:
        values["critic_load"] = critic_load
    run_config = RunConfig.from_dict(values)
    recipe, algorithm = resolve_recipe(run_config)
    role = next(role for role in recipe.roles if role.outputs_values)
    return RoleRuntime(role, algorithm, groups, model=run_config.model, optim=run_config.optim,
                       train=run_config.train, rank=0)


def _values(runtime) -> torch.Tensor:
    from tests.trainer.runtime.test_lm_head_mode import step_batch

    return torch.cat(runtime.compute_fields([step_batch()], ["values"])[0]["values"])


def _head(runtime) -> tuple[torch.Tensor, torch.Tensor]:
    head = runtime.model.output_layer
    return head.weight.detach().clone(), head.bias.detach().clone()


def _folder_with(base: str, out: str, extra: dict[str, torch.Tensor], drop: tuple[str, ...] = ()) -> str:
    """A copy of Hugging Face folder `base` with tensors `extra` added and `drop` removed."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out)
    for name in os.listdir(base):
        if name != "model.safetensors":
            shutil.copyfile(os.path.join(base, name), os.path.join(out, name))
    tensors = {k: v for k, v in load_file(os.path.join(base, "model.safetensors")).items() if k not in drop}
    save_file({**tensors, **extra}, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def load_heads(groups, checkpoint: str, work: str) -> dict:
    from stacx.checkpointing.convert import convert_torch_dist_to_hf
    from stacx.checkpointing.torch_dist import save_torch_dist

    records: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("stacx.trainer.runtime.role_runtime")
    logger.addHandler(Recorder())
    logger.setLevel(logging.INFO)

    trained = _critic(groups, checkpoint)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        trained.model.output_layer.weight.copy_(torch.randn(1, HIDDEN, generator=gen))
        trained.model.output_layer.bias.fill_(0.25)
    trained_values, trained_head = _values(trained), _head(trained)
    role_folder = os.path.join(work, "step", "roles", "critic", "model")
    save_torch_dist(role_folder, trained.model, trained.optimizer, groups=groups)
    exported = convert_torch_dist_to_hf(role_folder, os.path.join(work, "critic_hf"), hf_config=checkpoint)

    weight, bias = torch.randn(1, HIDDEN, generator=gen), torch.tensor([-0.5])
    trl = _folder_with(checkpoint, os.path.join(work, "trl"),
                       {"v_head.summary.weight": weight, "v_head.summary.bias": bias})
    reward = _folder_with(checkpoint, os.path.join(work, "reward"), {"score.weight": weight}, drop=("lm_head.weight",))

    adapted = _critic(groups, checkpoint, lora={"lora_rank": 4, "lora_alpha": 8.0, "lora_critic": "adapters"})
    with torch.no_grad():
        for name, param in adapted.model.named_parameters():
            if name.endswith("lora_b") or name.startswith("output_layer."):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    adapted_values = _values(adapted)
    adapted_folder = os.path.join(work, "adapted", "roles", "critic", "model")
    save_torch_dist(adapted_folder, adapted.model, adapted.optimizer, groups=groups)
    merged = _merged_export(adapted_folder, os.path.join(work, "adapted_hf"), checkpoint)

    try:
        _critic(groups, checkpoint, adapted_folder)
        direct = None
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        direct = str(err)
    result = {"direct_refusal": direct, "trained_values": trained_values, "trained_head": trained_head, "given": (weight, bias),
              "adapted_values": adapted_values, "adapter_refusal": _adapter_refusal(adapted_folder, checkpoint)}
    for name, folder in (("torch_dist", role_folder), ("export", exported), ("trl", trl), ("reward", reward),
                         ("none", checkpoint), ("merged", merged)):
        records.clear()
        critic = _critic(groups, checkpoint, folder)
        result[name] = {"values": _values(critic), "head": _head(critic), "log": list(records)}
    return result


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    from stacx.models.testing import save_tiny_hf_checkpoint

    work = tmp_path_factory.mktemp("value_head")
    checkpoint = str(work / "qwen3")
    save_tiny_hf_checkpoint(checkpoint, "qwen3", seed=3, vocab_size=101, hidden_size=HIDDEN)
    return run_distributed(load_heads, 1, args=(checkpoint, str(work)), timeout_s=300)[0] | {"work": str(work)}


def _same_head(found, expected) -> bool:
    return all(torch.equal(a, b) for a, b in zip(found, expected))


@pytest.mark.slow  # one forked rank that builds seven critics (about 15 s of CPU)
@pytest.mark.distributed
def test_a_run_s_critic_folder_restores_its_value_head(heads):
    loaded = heads["torch_dist"]
    assert _same_head(loaded["head"], heads["trained_head"])
    assert torch.equal(loaded["values"], heads["trained_values"])
    assert heads["trained_values"].abs().max() > 0.1  # the head is not zero
    assert any("value head from --critic-load" in line and "output_layer" in line for line in loaded["log"])


@pytest.mark.slow  # one forked rank that builds seven critics (about 15 s of CPU)
@pytest.mark.distributed
def test_a_critic_s_export_round_trips_its_values(heads):
    loaded = heads["export"]
    torch.testing.assert_close(loaded["values"], heads["trained_values"], atol=1e-6, rtol=0)
    assert _same_head(loaded["head"], heads["trained_head"])
    assert any("score.weight and score.bias" in line for line in loaded["log"])


@pytest.mark.slow  # one forked rank that builds seven critics (about 15 s of CPU)
@pytest.mark.distributed
def test_transformers_loads_a_critic_s_export_as_token_classification(heads):
    from transformers import AutoModelForTokenClassification

    folder = os.path.join(heads["work"], "critic_hf")
    with open(os.path.join(folder, "config.json")) as handle:
        config = json.load(handle)
    assert config["architectures"] == ["Qwen3ForTokenClassification"] and config.get("num_labels", 1) == 1
    model, info = AutoModelForTokenClassification.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == [] or not list(info["missing_keys"])
    assert torch.equal(model.score.weight.detach(), heads["trained_head"][0])
    assert torch.equal(model.score.bias.detach(), heads["trained_head"][1])


@pytest.mark.slow  # one forked rank that builds seven critics (about 15 s of CPU)
@pytest.mark.distributed
def test_trl_s_value_head_names_load(heads):
    assert _same_head(heads["trl"]["head"], heads["given"])
    assert any("v_head.summary.weight" in line and "TRL" in line for line in heads["trl"]["log"])


@pytest.mark.slow  # one forked rank that builds seven critics (about 15 s of CPU)
@pytest.mark.distributed
def test_a_sequence_classification_score_without_bias_loads_with_a_zero_bias(heads):
    weight, _ = heads["given"]
    assert _same_head(heads["reward"]["head"], (weight, torch.zeros(1)))


@pytest.mark.slow  # one forked rank that builds seven critics (about 15 s of CPU)
@pytest.mark.distributed
def test_a_folder_without_a_value_head_gives_a_zero_head_and_says_so(heads):
    loaded = heads["none"]
    assert _same_head(loaded["head"], (torch.zeros(1, HIDDEN), torch.zeros(1)))
    assert torch.equal(loaded["values"], torch.zeros_like(loaded["values"]))
    said = [line for line in loaded["log"] if "holds no value head" in line]
    assert len(said) == 1 and "score.weight" in said[0] and "v_head.summary.weight" in said[0]


@pytest.mark.slow  # one forked rank that builds seven critics (about 15 s of CPU)
@pytest.mark.distributed
def test_a_critic_with_adapters_exports_merged_with_its_head_and_not_as_a_peft_folder(heads):
    torch.testing.assert_close(heads["merged"]["values"], heads["adapted_values"], atol=1e-6, rtol=0)
    assert heads["adapted_values"].abs().max() > 0.1
    assert "use --lora merged" in heads["adapter_refusal"]
    # --critic-load of the adapted critic's folder itself names the merged export
    assert "holds LoRA adapters" in heads["direct_refusal"] and "--lora merged" in heads["direct_refusal"]


def test_a_classification_head_with_several_labels_is_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import save_file

    from stacx.models.value_head_weights import ValueHeadShapeError, read_hf_value_head

    save_file({"score.weight": torch.zeros(3, HIDDEN)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueHeadShapeError, match=r"'score.weight'.*\[3, 32\].*num_labels 1"):
        read_hf_value_head(tmp_path, HIDDEN)
    save_file({"model.norm.weight": torch.zeros(HIDDEN)}, str(tmp_path / "model.safetensors"))
    assert read_hf_value_head(tmp_path, HIDDEN) is None
