"""Each specialization on a tiny megatron-core model sharded TP=2 (2 ranks) and TP=2 x CP=2
(4 ranks) gives the loss and gradients of a float64 single-process computation on the unsharded
model (transformers, same checkpoint, each sequence run alone).

Compared per case: the loss; dL/dlogits reassembled from every rank's [T_local, V/tp] shard;
and dL/dW for the final norm and the output layer (summed over CP, gathered over TP). Each rank's
gradient is divided by the reducer's gradient_scale (= dp * cp), which is what megatron's DDP
averaging does. Tolerance 2e-4 * max|ref|: the model parity tests hold the model itself to 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from stacx.testing.distributed import run_distributed
from tests.specializations.cases import CASES, VOCAB, make_samples, reference_config, run_cases_on_rank

RELATIVE_TOLERANCE = 2e-4
CASE_NAMES = sorted(CASES)
WHOLE_SEQUENCE_CASES = {"actor_gspo_sequence_mis", "dpo_sigmoid", "dpo_ipo"}


@pytest.fixture(scope="module")
def checkpoint_and_reference(tmp_path_factory):
    from stacx.models.testing import build_tiny_hf_model, tiny_hf_config

    folder = str(tmp_path_factory.mktemp("tiny_llama"))
    config = tiny_hf_config("llama", vocab_size=VOCAB)
    model = build_tiny_hf_model(config, seed=0)
    model.save_pretrained(folder, safe_serialization=True)
    samples = make_samples()
    references = {}
    for name in CASE_NAMES:
        case = CASES[name]
        model.zero_grad(set_to_none=True)
        logits = [model(seq[None]).logits[0] for seq in samples["sequences"]]
        for lg in logits:
            lg.retain_grad()
        loss, metrics = case.reference(logits, samples, reference_config(case))
        loss.backward()
        references[name] = dict(
            loss=float(loss), metrics={k: float(v) for k, v in metrics.items()},
            logits_grad=torch.cat([lg.grad for lg in logits]),
            norm_grad=model.model.norm.weight.grad.clone(), head_grad=model.lm_head.weight.grad.clone(),
        )
    with torch.no_grad():
        rows = [torch.log_softmax(model(seq[None]).logits[0, -r - 1 : -1].double(), -1)
                for seq, r in zip(samples["sequences"], samples["response_lengths"])]
    references["no_grad_passes"] = dict(
        log_probs=[row.gather(1, seq[-row.shape[0]:, None])[:, 0] for row, seq in zip(rows, samples["sequences"])],
        values=[row[:, 0] for row in rows],  # the stand-in value head
    )
    return folder, samples, references


def _assert_close(label, got, want):
    scale = want.abs().max().item()
    error = (got.double() - want.double()).abs().max().item()
    assert error <= RELATIVE_TOLERANCE * scale, f"{label}: max |diff| {error:.3e} > {RELATIVE_TOLERANCE} * max|ref| ({scale:.3e})"


def _check_layout(per_rank, samples, references, label):
    lengths = [len(s) for s in samples["sequences"]]
    for rank, results in enumerate(per_rank):  # every rank (every CP rank too) gets whole responses
        for kind in ("log_probs", "values"):
            got, want = results["no_grad_passes"][kind], references["no_grad_passes"][kind]
            assert [g.shape[0] for g in got] == samples["response_lengths"], (label, rank, kind)
            assert not any(g.requires_grad for g in got)
            _assert_close(f"{kind} ({label}, rank {rank})", torch.cat(got), torch.cat(want))
    for name in CASE_NAMES:
        ref = references[name]
        results = [rank[name] for rank in per_rank]
        where = f"{name} ({label})"
        loss = sum(r["loss"] for r in results if r["tp_rank"] == 0)  # CP ranks hold disjoint parts of L
        assert loss == pytest.approx(ref["loss"], rel=RELATIVE_TOLERANCE), where
        padded = results[0]["padded"]
        width = results[0]["logits_grad"].shape[1]
        full = torch.zeros(sum(padded), width * max(r["tp_rank"] for r in results) + width)
        for r in results:
            full[r["local"], r["tp_rank"] * width : (r["tp_rank"] + 1) * width] = r["logits_grad"]
        starts = torch.cumsum(torch.tensor([0] + padded[:-1]), 0).tolist()
        real_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
        _assert_close(f"{where} dL/dlogits", full[real_rows, :VOCAB], ref["logits_grad"])
        assert full[:, VOCAB:].abs().max() == 0, f"{where}: gradient on vocab padding"
        _assert_close(f"{where} dL/d final norm", results[0]["norm_grad"], ref["norm_grad"])
        _assert_close(f"{where} dL/d output layer", results[0]["head_grad"], ref["head_grad"])
        for metric, value in ref["metrics"].items():
            for r in results:  # reduced over DP x CP: every rank sees the same sums
                assert r["metrics"][metric] == pytest.approx(value, rel=RELATIVE_TOLERANCE, abs=1e-4), f"{where} {metric}"
        assert all(r["metrics"]["num_loss_tokens"] == sum(float(m.sum()) for m in samples["loss_masks"]) for r in results)
        assert all(r["metrics"]["num_sequences"] == len(lengths) for r in results)
        # Inside compute_loss: one TP all-gather per vocab-parallel pass (two for top-k, none for the
        # critic, whose values arrive computed), one CP all-gather for sequence-level losses, nothing else.
        cp = len(per_rank) // 2
        tp_gathers = {"distill_topk": 2, "critic": 0}.get(name, 1)
        expected_gathers = tp_gathers + (1 if cp > 1 and name in WHOLE_SEQUENCE_CASES else 0)
        for r in results:
            assert r["collectives"] == {"all_gather": expected_gathers, "all_reduce": 0}, f"{where}: {r['collectives']}"


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_parallel_two_ranks_match_the_unsharded_reference(checkpoint_and_reference):
    folder, samples, references = checkpoint_and_reference
    per_rank = run_distributed(run_cases_on_rank, 2, tensor_model_parallel_size=2, args=(folder, CASE_NAMES), timeout_s=300)
    _check_layout(per_rank, samples, references, "tp=2")


@pytest.mark.slow
@pytest.mark.distributed
def test_tensor_and_context_parallel_four_ranks_match_the_unsharded_reference(checkpoint_and_reference):
    folder, samples, references = checkpoint_and_reference
    per_rank = run_distributed(run_cases_on_rank, 4, tensor_model_parallel_size=2, context_parallel_size=2,
                               args=(folder, CASE_NAMES), timeout_s=300)
    _check_layout(per_rank, samples, references, "tp=2 cp=2")
