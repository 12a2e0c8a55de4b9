"""Stacx's megatron models match `transformers` for Llama (llama3 rope), Qwen2 and Qwen3 (tied).

One spawn of 4 gloo ranks re-initializes each (tp, cp) layout in turn (dp takes the rest), so
the import cost is paid once. For every layout and architecture: load the HF checkpoint, run
`forward_packed` on each CP rank's slice of a packed row of varied lengths, reassemble the TP
and CP shards, and compare with HF run on each sequence alone, in fp32, to 1e-4 relative
(|diff| <= 1e-4 * max|ref| elementwise). The gradient of sum(logits * W) w.r.t. every weight,
summed over CP and gathered over TP into HF names, must match HF's to the same tolerance:
that checks the CP K/V gather's backward and the TP weight layout together.
"""

from __future__ import annotations

import pytest
import torch

from stacx.parallel.cp_layout import cp_padded_lengths, cu_seqlens
from stacx.testing.distributed import run_distributed
from tests.models.parity_cases import (
    ARCH_CASES,
    LAYOUTS,
    PACKED_LENGTHS,
    hf_reference,
    logit_weights,
    packed_tokens,
    save_case_checkpoint,
)

RELATIVE_TOLERANCE = 1e-4


def _hf_named_grads(model, groups):
    """Every weight's grad, summed over CP and gathered over TP, as {hf_name: full tensor}."""
    import torch.distributed as dist

    from stacx.models.architectures import decoder_shape
    from stacx.models.builder import hf_config_of
    from stacx.models.weight_mapping import param_mappings

    shape = decoder_shape(hf_config_of(model))
    params = dict(model.named_parameters())
    grads = {}
    for mapping in param_mappings(model):
        grad = params[mapping.megatron_name].grad.detach().clone()
        if groups.cp_size > 1:
            dist.all_reduce(grad, group=groups.cp)
        if groups.tp_size > 1 and ("q_layernorm" in mapping.megatron_name or "k_layernorm" in mapping.megatron_name):
            # Each TP rank normalizes only its heads: megatron's finalize_model_grads sums these over TP.
            dist.all_reduce(grad, group=groups.tp)
        shards = [torch.empty_like(grad) for _ in range(groups.tp_size)]
        dist.all_gather(shards, grad, group=groups.tp)
        grads.update(zip(mapping.hf_names, mapping.merge_shards(shards, shape)))
    return grads


def run_every_layout_and_arch(groups, checkpoints, tokens_by_arch, weights_by_arch):
    from stacx.models import build_model, forward_packed, hf_config_of, load_hf_checkpoint
    from stacx.models.architectures import decoder_shape
    from stacx.models.weight_mapping import expected_param_mappings, param_mappings
    from stacx.parallel.cp_layout import local_positions, pad_packed
    from stacx.parallel.groups import initialize_parallel_layout

    results = {}
    for tp, cp in LAYOUTS:
        groups = initialize_parallel_layout(tp, cp)
        padded = cp_padded_lengths(PACKED_LENGTHS, cp)
        local = local_positions(padded, groups.cp_rank, cp)
        for arch, path in checkpoints.items():
            torch.manual_seed(0)
            model = build_model(path, groups)
            load_hf_checkpoint(model, path, groups)
            # The config-only layout the converter uses must equal the built model's parameters.
            assert param_mappings(model) == expected_param_mappings(decoder_shape(hf_config_of(model)), tp)
            tokens_local = pad_packed(tokens_by_arch[arch], PACKED_LENGTHS, padded)[local]
            logits = forward_packed(model, tokens_local, padded, groups)  # [T_local, V_pad/tp]
            vocab = weights_by_arch[arch].shape[1]
            width = logits.shape[1]
            weights = pad_packed(weights_by_arch[arch], PACKED_LENGTHS, padded)[local]  # padding rows 0
            weights = torch.nn.functional.pad(weights, (0, width * tp - vocab))
            weights_local = weights[:, groups.tp_rank * width : (groups.tp_rank + 1) * width]
            # Vocab padding columns hold float32 min; their weight is 0, but 0 * min is finite.
            (logits * weights_local).sum().backward()
            grads = _hf_named_grads(model, groups)
            results[(tp, cp, arch)] = dict(
                logits=logits.detach(), local=local, tp_rank=groups.tp_rank, cp_rank=groups.cp_rank,
                grads=grads if groups.dp_rank == 0 and groups.tp_rank == 0 and groups.cp_rank == 0 else None,
            )
    return results


def _assert_close(name, got, want):
    scale = want.abs().max().item()
    error = (got - want).abs().max().item()
    assert error <= RELATIVE_TOLERANCE * scale, f"{name}: max |diff| {error:.3e} > 1e-4 * max|ref| ({scale:.3e})"


@pytest.mark.distributed
@pytest.mark.slow
def test_logits_and_grads_match_transformers_for_every_arch_and_layout(tmp_path):
    checkpoints, tokens, weights, references = {}, {}, {}, {}
    for arch in ARCH_CASES:
        config, hf_model = save_case_checkpoint(arch, str(tmp_path / arch))
        checkpoints[arch] = str(tmp_path / arch)
        tokens[arch] = packed_tokens(config.vocab_size)
        weights[arch] = logit_weights(config.vocab_size)
        references[arch] = hf_reference(hf_model, tokens[arch], weights[arch])

    per_rank = run_distributed(run_every_layout_and_arch, 4, args=(checkpoints, tokens, weights), timeout_s=600)

    for (tp, cp), arch in [(layout, arch) for layout in LAYOUTS for arch in ARCH_CASES]:
        ref_logits, ref_grads = references[arch]
        vocab = ref_logits.shape[1]
        padded = cp_padded_lengths(PACKED_LENGTHS, cp)
        results = [rank_results[(tp, cp, arch)] for rank_results in per_rank]
        width = results[0]["logits"].shape[1]
        full = torch.full((sum(padded), width * tp), float("nan"))
        for result in results:
            columns = slice(result["tp_rank"] * width, (result["tp_rank"] + 1) * width)
            full[result["local"], columns] = result["logits"]
        starts = cu_seqlens(padded)[:-1].tolist()
        real_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, PACKED_LENGTHS)])
        label = f"{arch} tp={tp} cp={cp}"
        _assert_close(f"{label} logits", full[real_rows, :vocab], ref_logits)
        assert torch.all(full[:, vocab:] == torch.finfo(torch.float32).min), f"{label}: vocab padding not masked"
        grads = next(r["grads"] for r in results if r["grads"] is not None)
        expected_names = set(ref_grads) - ({"lm_head.weight"} if arch == "qwen3" else set())
        assert set(grads) == expected_names, label
        for name, grad in grads.items():
            _assert_close(f"{label} grad {name}", grad, ref_grads[name])
