"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE with its shared expert) against `transformers`.

One spawn of 2 gloo ranks walks every (tp, cp, ep, etp) layout below (dp and edp take the rest). At
each layout and for each architecture it:
- builds the model, loads the Hugging Face checkpoint and checks the config-only parameter mappings
  (what conversion tools use) equal the built model's;
- runs `forward_packed` on each CP rank's slice of a packed row of varied lengths; the reassembled
  log-softmax must match HF's (each sequence run alone) to 1e-5 absolute, in fp32;
- streams the weights back out as Hugging Face tensors (`iter_hf_weight_buckets`: gathered over tp,
  etp and ep): every tensor of the checkpoint must come back bitwise, under its own name.
Then a torch_dist checkpoint saved at ep=2 is loaded at ep=1 and at (tp=2, ep=2, etp=1): exported to
HF names again, it must equal the original bitwise (resharding across ep, etp and tp).
"""

from __future__ import annotations

import pytest
import torch

from stacx.parallel.cp_layout import cp_padded_lengths, cu_seqlens
from stacx.testing.distributed import run_distributed
from tests.models.parity_cases import PACKED_LENGTHS, packed_tokens

ARCHS = ("qwen3_moe", "qwen2_moe")
# (tp, cp, ep, etp): ep beside tp (etp=1), ep across cp ranks, etp=tp without ep.
LAYOUTS = [(2, 1, 2, 1), (1, 2, 2, 1), (2, 1, 1, 2)]
LOG_PROB_TOLERANCE = 1e-5


def save_moe_checkpoint(arch: str, folder: str, seed: int = 0):
    """A tiny random `arch` checkpoint whose router is sharp enough that top-2 choices differ per token."""
    from stacx.models.testing import build_tiny_hf_model, tiny_hf_config

    config = tiny_hf_config(arch)
    model = build_tiny_hf_model(config, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return config, model


def _hf_tensors(model, groups) -> dict[str, torch.Tensor]:
    from stacx.models import iter_hf_weight_buckets

    return {name: tensor for bucket in iter_hf_weight_buckets(model, groups, 1 << 30) for name, tensor in bucket}


def _layout(tp, cp, ep, etp):
    from stacx.parallel.groups import initialize_parallel_layout

    return initialize_parallel_layout(tp, cp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def run_every_moe_layout(_groups, checkpoints, tokens_by_arch, dist_dir):
    from stacx.checkpointing.torch_dist import load_torch_dist, save_torch_dist
    from stacx.models import build_model, forward_packed, hf_config_of, load_hf_checkpoint
    from stacx.models.architectures import decoder_shape
    from stacx.models.weight_mapping import expected_param_mappings, param_mappings
    from stacx.parallel.cp_layout import local_positions, pad_packed

    results = {}
    for tp, cp, ep, etp in LAYOUTS:
        groups = _layout(tp, cp, ep, etp)
        padded = cp_padded_lengths(PACKED_LENGTHS, cp)
        local = local_positions(padded, groups.cp_rank, cp)
        for arch, path in checkpoints.items():
            model = build_model(path, groups, initialize_weights=False)
            load_hf_checkpoint(model, path, groups)
            shape = decoder_shape(hf_config_of(model))
            assert param_mappings(model) == expected_param_mappings(
                shape, tp, ep_size=ep, ep_rank=groups.ep_rank, etp_size=etp)
            model.eval()  # megatron refuses MoE training at tp > 1 without sequence parallelism
            with torch.no_grad():
                tokens_local = pad_packed(tokens_by_arch[arch], PACKED_LENGTHS, padded)[local]
                logits = forward_packed(model, tokens_local, padded, groups)  # [T_local, V_pad/tp]
            exported = _hf_tensors(model, groups)
            results[(tp, cp, ep, etp, arch)] = dict(logits=logits, local=local, tp_rank=groups.tp_rank,
                                                    exported=exported if groups.tp_rank == 0 else None)
    # torch_dist: saved at ep=2 (dp=2), loaded at ep=1 and at tp=2 x ep=2 x etp=1.
    arch, path = "qwen3_moe", checkpoints["qwen3_moe"]
    groups = _layout(1, 1, 2, 1)
    model = build_model(path, groups, initialize_weights=False)
    load_hf_checkpoint(model, path, groups)
    save_torch_dist(dist_dir, model, groups=groups)
    for tp, ep in ((1, 1), (2, 2)):
        groups = _layout(tp, 1, ep, 1)
        model = build_model(path, groups, initialize_weights=False)
        load_torch_dist(dist_dir, model)
        exported = _hf_tensors(model, groups)  # every rank takes part in the gathers
        results[("torch_dist", tp, ep)] = exported if groups.tp_rank == 0 else None
    return results


def _full_log_probs(per_rank, key, tp, cp, vocab):
    """The [T_real, V] log-softmax reassembled from every rank's [T_local, V_pad/tp] logits."""
    padded = cp_padded_lengths(PACKED_LENGTHS, cp)
    width = per_rank[0][key]["logits"].shape[1]
    full = torch.full((sum(padded), width * tp), float("nan"))
    for rank_results in per_rank:
        result = rank_results[key]
        full[result["local"], result["tp_rank"] * width:(result["tp_rank"] + 1) * width] = result["logits"]
    starts = cu_seqlens(padded)[:-1].tolist()
    real_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, PACKED_LENGTHS)])
    return full[real_rows, :vocab].log_softmax(-1)


@pytest.mark.slow
@pytest.mark.distributed
def test_moe_log_probs_conversion_and_resharding_match_transformers(tmp_path):
    from safetensors.torch import load_file

    checkpoints, tokens, references, saved = {}, {}, {}, {}
    for arch in ARCHS:
        folder = str(tmp_path / arch)
        config, hf_model = save_moe_checkpoint(arch, folder)
        checkpoints[arch] = folder
        tokens[arch] = packed_tokens(config.vocab_size)
        with torch.no_grad():
            logits = torch.cat([hf_model(seq[None]).logits[0] for seq in tokens[arch].split(PACKED_LENGTHS)])
        references[arch] = logits.log_softmax(-1)
        saved[arch] = load_file(f"{folder}/model.safetensors")

    per_rank = run_distributed(run_every_moe_layout, 2, args=(checkpoints, tokens, str(tmp_path / "dist")),
                               timeout_s=600)

    for (tp, cp, ep, etp), arch in [(layout, arch) for layout in LAYOUTS for arch in ARCHS]:
        label = f"{arch} tp={tp} cp={cp} ep={ep} etp={etp}"
        key = (tp, cp, ep, etp, arch)
        got = _full_log_probs(per_rank, key, tp, cp, references[arch].shape[1])
        error = (got - references[arch]).abs().max().item()
        assert error <= LOG_PROB_TOLERANCE, f"{label}: log-prob max |diff| {error:.2e} > {LOG_PROB_TOLERANCE}"
        for rank_results in per_rank:
            exported = rank_results[key]["exported"]
            if exported is None:
                continue
            assert set(exported) == set(saved[arch]), label
            unequal = [name for name in saved[arch] if not torch.equal(exported[name], saved[arch][name])]
            assert not unequal, f"{label}: exported tensors differ from the checkpoint: {unequal[:3]}"
    # The baseline is not trivial: the router sends tokens to different experts.
    assert references["qwen3_moe"].std() > 0
    for tp, ep in ((1, 1), (2, 2)):
        for rank_results in per_rank:
            exported = rank_results[("torch_dist", tp, ep)]
            if exported is not None:
                assert set(exported) == set(saved["qwen3_moe"])
                assert all(torch.equal(exported[n], t) for n, t in saved["qwen3_moe"].items()), f"torch_dist tp={tp} ep={ep}"


def test_moe_checkpoint_converts_to_torch_dist_and_back_bitwise(tmp_path):
    """`stacx convert` both ways (in this process, tp=1) on Qwen2-MoE: routed experts, shared expert and
    its gate come back under their Hugging Face names, bitwise, and the folder loads in `transformers`."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from stacx.checkpointing.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf

    save_moe_checkpoint("qwen2_moe", str(tmp_path / "hf"))
    convert_hf_to_torch_dist(tmp_path / "hf", tmp_path / "dist")
    convert_torch_dist_to_hf(tmp_path / "dist", tmp_path / "back")
    original, back = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original)
    assert any(".mlp.experts.3." in name for name in back) and any("shared_expert_gate" in name for name in back)
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "back").config.model_type == "qwen2_moe"
