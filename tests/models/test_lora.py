"""LoRA adapters (stacx.models.lora) through the run settings' path: `RoleRuntime` with --lora-rank.

One spawn of one rank (the single-rank reference) and one of two gloo ranks walk the layouts below, a dense
Qwen3 and a Qwen3-MoE (adapters on the routed experts too). At each layout the runtime:
- starts with B = 0, so its log-probs are the base model's; then every adapter gets the same full A and B
  (drawn in Hugging Face space from its name, each rank keeping its shard) and the log-probs move;
- computes `ref_log_probs` with the adapters switched off: the base model's log-probs, bitwise;
- trains one GRPO step (two micro-batches): the loss, and the reduced gradients of every adapter streamed as
  full PEFT-named tensors, must equal the single rank's to 1e-6; only the adapters have gradients and
  optimizer state, the base weights do not move;
- streams the merged weights (W + scale * B A) as Hugging Face tensors: a `transformers` model loaded with
  them gives the runtime's log-probs (the merged push an engine receives);
- `--lora-init principal` (A from the SVD of the gathered base weight) starts every layout from the single
  rank's A to 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from stacx.testing.distributed import run_distributed

# (arch, tp, cp, pp, ep): TP with sequence parallelism, CP, PP; EP on the MoE model (etp = 1).
LAYOUTS = [("qwen3", 2, 1, 1, 1), ("qwen3", 1, 2, 1, 1), ("qwen3", 1, 1, 2, 1), ("qwen3_moe", 1, 1, 1, 2)]
SINGLE = [("qwen3", 1, 1, 1, 1), ("qwen3_moe", 1, 1, 1, 1)]
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_target_modules": ["all-linear"]}
TOLERANCE = 1e-6
TEMPERATURE = 0.7  # the log-probs are the rollout's: logits / temperature


def _hf_value(name: str, shape) -> torch.Tensor:
    """A fixed tensor for the PEFT-named adapter tensor `name` (the same on every layout)."""
    import zlib

    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(*shape, generator=generator) * 0.2


@torch.no_grad()
def _set_adapters(model, groups):
    """Give every adapter the shard of a layout-free full A and B (B != 0, so A has a gradient)."""
    from stacx.models import hf_config_of
    from stacx.models.architectures import decoder_shape
    from stacx.models.builder import model_chunks, unwrap_model
    from stacx.models.lora import adapter_param_mappings

    for chunk in model_chunks(model):
        gpt = unwrap_model(chunk)
        shape = decoder_shape(hf_config_of(gpt))
        params = dict(gpt.named_parameters())
        for mapping in adapter_param_mappings(gpt):
            rank, size = mapping.shard_rank_and_size(groups)
            full_shapes = mapping.hf_shapes(shape, size)
            pieces = []
            for hf_name, full_shape, part in zip(mapping.hf_names, full_shapes, mapping.local_slices(shape, rank, size)):
                full = _hf_value(hf_name, full_shape)
                pieces.append(full if part.dim is None else full.narrow(part.dim, part.start, part.stop - part.start))
            params[mapping.megatron_name].copy_(mapping.assemble_local(pieces, shape, size))


def _adapter_grads(runtime) -> dict[str, torch.Tensor]:
    """The reduced gradients of the adapters as full PEFT-named tensors (streamed like the adapters)."""
    from stacx.models import iter_hf_weight_buckets
    from stacx.models.lora import adapter_parameters

    params = adapter_parameters(runtime.model)
    weights = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.to(p.dtype)
    try:
        return {n: t.clone() for bucket in iter_hf_weight_buckets(runtime.model, runtime.groups, 1 << 30, adapters=True)
                for n, t in bucket}
    finally:
        for p, weight in zip(params, weights):
            p.data = weight


def _log_probs(runtime, micro_batches, name="log_probs"):
    """Per-sample log-probs, or None on a rank that does not return them (tp_rank or cp_rank > 0)."""
    fields = runtime.compute_fields(micro_batches, [name])
    return None if fields is None else [lp for one in fields for lp in one[name]]


def _principal_a_tensors(path, groups) -> dict[str, torch.Tensor]:
    """The A's `--lora-init principal` starts a model of `path` with, as full PEFT-named tensors (this stage's)."""
    from stacx.models import build_model, iter_hf_weight_buckets, load_hf_checkpoint
    from stacx.models.lora import LoraSettings, attach_lora

    model = build_model(path, groups, initialize_weights=False)
    load_hf_checkpoint(model, path, groups)
    attach_lora(model, LoraSettings(rank=4, alpha=8.0, init="principal"), groups)
    return {name: tensor.clone() for bucket in iter_hf_weight_buckets(model, groups, 1 << 30, adapters=True)
            for name, tensor in bucket if ".lora_A." in name}


def run_layouts(_groups, paths, layouts):
    from stacx.models import iter_hf_weight_buckets
    from stacx.models.lora import adapter_parameters, has_lora
    from stacx.objectives.algorithm_config import AlgorithmConfig
    from stacx.parallel.groups import initialize_parallel_layout
    from stacx.parallel.reduction import compute_step_counts
    from stacx.specializations.actor import ActorSpecialization
    from stacx.trainer.config.recipe import ModelRole
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.runtime.role_runtime import RoleRuntime
    from tests.trainer.runtime.test_lm_head_mode import step_batch

    results = {}
    for arch, tp, cp, pp, ep in layouts:
        groups = initialize_parallel_layout(tp, cp, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
                                            expert_tensor_parallel_size=1)
        run_config = RunConfig.from_dict({
            "hf_checkpoint": paths[arch], "ref_load": paths[arch], "clip_grad": 0.0, "lr": 1e-2,
            "tensor_model_parallel_size": tp, "context_parallel_size": cp, "pipeline_model_parallel_size": pp,
            "expert_model_parallel_size": ep, "sequence_parallel": tp > 1, **LORA})
        algorithm = AlgorithmConfig.from_values({"advantage_estimator": "grpo", "rollout_temperature": TEMPERATURE})
        role = ModelRole(name="policy", specialization_cls=ActorSpecialization, reference_checkpoint_arg="ref_load")
        runtime = RoleRuntime(role, algorithm, groups, model=run_config.model, optim=run_config.optim,
                              train=run_config.train, rank=torch.distributed.get_rank())
        assert has_lora(runtime.model)
        batch = step_batch()
        micro_batches = [batch.select([0, 2]), batch.select([1, 3])]
        base = _log_probs(runtime, micro_batches)
        _set_adapters(runtime.model, groups)
        adapted = _log_probs(runtime, micro_batches)
        reference = _log_probs(runtime, micro_batches, "ref_log_probs")
        trainable = [p for p in runtime.model.parameters() if p.requires_grad]
        adapters = adapter_parameters(runtime.model)
        optimized = [p for group in runtime.optimizer.param_groups for p in group["params"]]
        frozen_before = [p.detach().clone() for p in runtime.model.parameters() if not p.requires_grad]
        adapters_before = [p.detach().clone() for p in adapters]
        metrics = runtime.train_step(micro_batches, compute_step_counts(batch.loss_masks, groups.dp))
        frozen_after = [p for p in runtime.model.parameters() if not p.requires_grad]
        merged = {n: t for b in iter_hf_weight_buckets(runtime.model, groups, 1 << 30) for n, t in b}
        results[(arch, tp, cp, pp, ep)] = dict(
            base=base, adapted=adapted, reference=reference, loss=metrics["loss"], grads=_adapter_grads(runtime),
            only_adapters_train={id(p) for p in trainable} == {id(p) for p in adapters}
            and len(optimized) == len(adapters) > 0,
            base_frozen=all(torch.equal(a, b) for a, b in zip(frozen_before, frozen_after)),
            adapters_moved=all(not torch.equal(a, b) for a, b in zip(adapters_before, adapters)),
            merged=merged if torch.distributed.get_rank() == 0 else None,
            after=_log_probs(runtime, micro_batches), principal=_principal_a_tensors(paths[arch], groups))
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.models.test_moe import save_moe_checkpoint
    from stacx.models.testing import save_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("lora")
    save_tiny_hf_checkpoint(str(root / "qwen3"), "qwen3", seed=0)
    save_moe_checkpoint("qwen3_moe", str(root / "qwen3_moe"))
    return {"qwen3": str(root / "qwen3"), "qwen3_moe": str(root / "qwen3_moe")}


def _hf_log_probs(path, tensors, micro_batches_tokens, folder):
    """Per-sample log-probs of the response tokens from `transformers` with the streamed merged weights (written
    as a checkpoint folder: `from_pretrained` converts per-expert tensors to its fused experts)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder.mkdir()
    shutil.copy(f"{path}/config.json", folder / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for tokens, response in micro_batches_tokens:
            log_probs = (model(tokens[None]).logits[0] / TEMPERATURE).log_softmax(-1)[:-1].gather(-1, tokens[1:, None])[:, 0]
            out.append(log_probs[-response:])
    return out


def _close(ours, reference, tolerance=TOLERANCE):
    return all(torch.allclose(a, b, atol=tolerance, rtol=0) for a, b in zip(ours, reference))


@pytest.mark.slow  # two spawns, six RoleRuntime layouts (with test_lora_export.py: 69 s of CPU)
@pytest.mark.distributed
def test_sharded_adapters_match_the_single_rank_adapter(checkpoints, tmp_path):
    from tests.trainer.runtime.test_lm_head_mode import step_batch

    single = run_distributed(run_layouts, 1, args=(checkpoints, SINGLE), timeout_s=600)[0]
    sharded = run_distributed(run_layouts, 2, args=(checkpoints, LAYOUTS), timeout_s=600)
    for key, one in single.items():
        assert one["only_adapters_train"] and one["base_frozen"] and one["adapters_moved"], key
        assert all(torch.equal(a, b) for a, b in zip(one["reference"], one["base"])), key
        assert not _close(one["adapted"], one["base"], 1e-3), f"{key}: the adapters do not change the log-probs"
        assert not _close(one["after"], one["adapted"], 1e-4), f"{key}: the step did not move the adapters"
        assert all(float(g.abs().max()) > 0 for g in one["grads"].values()), f"{key}: an adapter has no gradient"
        batch = step_batch()
        order = [0, 2, 1, 3]  # the micro-batches' sample order
        hf = _hf_log_probs(checkpoints[key[0]], one["merged"],
                           [(batch.tokens[i], batch.response_lengths[i]) for i in order], tmp_path / key[0])
        assert _close(hf, one["after"], 1e-5), f"{key}: transformers with the merged weights differs"
    for layout in LAYOUTS:
        reference = single[(layout[0], 1, 1, 1, 1)]
        assert any(results[layout]["adapted"] is not None for results in sharded), layout
        assert sharded[0][layout]["grads"], layout  # rank 0 (the first stage) receives every adapter
        assert sharded[0][layout]["principal"], layout
        for rank, results in enumerate(sharded):
            got = results[layout]
            where = f"{layout} rank {rank}"
            for name, a in got["principal"].items():
                assert torch.allclose(a, reference["principal"][name], atol=1e-6, rtol=0), f"{where}: principal A {name}"
            assert got["only_adapters_train"] and got["base_frozen"] and got["adapters_moved"], where
            if got["adapted"] is not None:
                assert _close(got["adapted"], reference["adapted"]), f"{where}: adapted log-probs differ"
                assert _close(got["after"], reference["after"], 1e-5), f"{where}: log-probs after the step differ"
                assert all(torch.equal(a, b) for a, b in zip(got["reference"], got["base"])), where
            assert abs(got["loss"] - reference["loss"]) <= TOLERANCE * max(1.0, abs(reference["loss"])), where
            if not got["grads"]:
                continue  # a later pipeline stage streams its adapters to the first one
            assert got["grads"].keys() == reference["grads"].keys(), where
            for name, grad in got["grads"].items():
                assert torch.allclose(grad, reference["grads"][name], atol=TOLERANCE, rtol=0), f"{where}: {name}"
