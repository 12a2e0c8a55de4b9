"""`--lm-head-log-probs`: a role's forward hands the specialization the logits or the LM head's inputs.

The fused path (an `LMHeadShard`, log-probs without the logits) must train exactly like the
logits path: one GRPO-style train step and one `compute_fields` pass of a real `RoleRuntime`
give the same loss, metrics and gradients (1e-5 relative) at TP=1 (in process) and TP=2 (spawned
gloo ranks; the tiny vocab of 101 is padded to 102 there). Which output a specialization gets
follows `needs_logits` / `receives_logits`, and the `auto` rule is a pure function.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest
import torch

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.parallel.lm_head import LMHeadShard
from stacx.specializations import ActorSpecialization, CausalDecoderSpecialization, CriticSpecialization
from stacx.specializations.base import Specialization
from stacx.specializations.distill import DistillSpecialization
from stacx.specializations.dpo import DPOSpecialization
from stacx.specializations.mixed_loss_dagger import MixedLossDaggerOPDSpecialization
from stacx.testing.distributed import run_distributed
from stacx.trainer.config.run import ConfigError, RunConfig
from stacx.trainer.runtime.lm_head_mode import AUTO_FUSED_LOGITS_BYTES, choose_lm_head_output

#: Issue 16's target: the fused path's gradients equal the unfused path's to 1e-5 relative (fp32).
RELATIVE_TOLERANCE = 1e-5
VOCAB = 101  # odd: TP=2 pads it to 102


# ---- the `auto` rule and the flag ---------------------------------------------------------------


def test_auto_fuses_on_cuda_or_from_a_1_gib_logits_shard_and_never_against_the_specialization():
    choose = choose_lm_head_output
    small = dict(num_local_tokens=512, vocab_local=151936 // 2)  # 155 MB of fp32 logits
    tokens_for_1_gib = AUTO_FUSED_LOGITS_BYTES // (4 * 1000)
    assert choose("auto", specialization_allows=True, on_cuda=False, **small) == "logits"
    assert choose("auto", specialization_allows=True, on_cuda=True, **small) == "hidden"
    assert choose("auto", specialization_allows=True, on_cuda=False, num_local_tokens=tokens_for_1_gib,
                  vocab_local=1000) == "logits"  # just under 1 GiB
    assert choose("auto", specialization_allows=True, on_cuda=False, num_local_tokens=tokens_for_1_gib + 1,
                  vocab_local=1000) == "hidden"
    for mode in ("auto", "fused", "logits"):
        assert choose(mode, specialization_allows=False, on_cuda=True, **small) == "logits"
    assert choose("fused", specialization_allows=True, on_cuda=False, **small) == "hidden"
    assert choose("logits", specialization_allows=True, on_cuda=True, num_local_tokens=10**6, vocab_local=10**6) == "logits"
    with pytest.raises(ValueError, match="--lm-head-log-probs"):
        choose("fast", specialization_allows=True, on_cuda=False, **small)


def test_a_bad_value_of_the_setting_is_refused_naming_the_flag(capsys):
    from stacx.launch.run_flags import add_run_config_arguments

    assert RunConfig().train.lm_head_log_probs == "auto"
    assert RunConfig.from_dict({"lm_head_log_probs": "fused"}).train.lm_head_log_probs == "fused"
    with pytest.raises(ConfigError, match="lm_head_log_probs' in run.yaml must be one of .*--lm-head-log-probs"):
        RunConfig.from_dict({"train": {"lm_head_log_probs": "fast"}}, source="run.yaml")
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    assert parser.parse_args(["--lm-head-log-probs", "logits"]).lm_head_log_probs == "logits"
    with pytest.raises(SystemExit):
        parser.parse_args(["--lm-head-log-probs", "fast"])
    assert "--lm-head-log-probs" in capsys.readouterr().err


# ---- which specializations get the logits ---------------------------------------------------------


class OwnLocalValues(CausalDecoderSpecialization):
    """A user loss that may read the logits in its own `local_values`."""

    def local_values(self, model_output, batch):
        return super().local_values(model_output, batch)


class DeclaredFused(OwnLocalValues):
    def needs_logits(self) -> bool:
        return False


class ActorWithOwnLocalValues(ActorSpecialization):
    def local_values(self, model_output, batch):
        return super().local_values(model_output, batch)


class OwnComputeLoss(Specialization):
    def compute_loss(self, model_output, batch, reducer):
        return super().compute_loss(model_output, batch, reducer)


def test_only_specializations_that_read_the_logits_receive_them():
    topk = AlgorithmConfig(distill_kl_mode="topk")
    fused_ok = [ActorSpecialization(), CausalDecoderSpecialization(), DPOSpecialization(),
                MixedLossDaggerOPDSpecialization(), DistillSpecialization(AlgorithmConfig(distill_kl_mode="k3_sample")),
                DeclaredFused()]
    needs = [DistillSpecialization(topk), CriticSpecialization(), OwnLocalValues(), ActorWithOwnLocalValues(),
             OwnComputeLoss()]
    assert [s.receives_logits() for s in fused_ok] == [False] * len(fused_ok)
    assert [s.receives_logits() for s in needs] == [True] * len(needs)
    # ActorSpecialization declared False for its own local_values, not for a subclass's.
    assert ActorWithOwnLocalValues().needs_logits() is False


# ---- a real RoleRuntime in both modes ------------------------------------------------------------


def step_batch():
    """Four GRPO samples (prompt + response, advantages), ids up to the last real one (100)."""
    from stacx.trainer.batch import StepBatch

    gen = torch.Generator().manual_seed(7)
    lengths, responses = (9, 12, 7, 10), (5, 6, 3, 7)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    tokens[1][-1] = VOCAB - 1
    masks = [torch.ones(r) for r in responses]
    masks[2][0] = 0.0
    advantages = [torch.full((r,), a) for r, a in zip(responses, (1.0, -0.5, 0.8, -1.2))]
    return StepBatch(tokens=tokens, response_lengths=list(responses), loss_masks=masks, advantages=advantages)


def build_runtime(groups, checkpoint: str, mode: str, specialization_cls=ActorSpecialization, sequence_parallel=False,
                  **algorithm):
    from stacx.objectives.algorithm_config import AlgorithmConfig
    from stacx.trainer.config.recipe import ModelRole
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    run_config = RunConfig.from_dict({"hf_checkpoint": checkpoint, "lm_head_log_probs": mode, "clip_grad": 0.0,
                                      "tensor_model_parallel_size": groups.tp_size,
                                      "sequence_parallel": sequence_parallel})
    algorithm = AlgorithmConfig.from_values({"advantage_estimator": "grpo", "entropy_coef": 0.01,
                                             "rollout_temperature": 0.7, **algorithm})
    role = ModelRole(name="policy", specialization_cls=specialization_cls)
    return RoleRuntime(role, algorithm, groups, model=run_config.model, optim=run_config.optim, train=run_config.train,
                       rank=torch.distributed.get_rank())


def recorded_outputs(runtime) -> list:
    """Wrap the runtime's forward to record the type of each output it hands the specialization."""
    seen, forward = [], runtime.forward

    def recording(batch):
        output = forward(batch)
        seen.append(type(output))
        return output

    runtime.forward = recording
    return seen


def train_and_score(runtime, mode: str) -> dict:
    """One train step (two micro-batches) and one compute_fields pass in `mode`, from the same weights."""
    from stacx.parallel.reduction import compute_step_counts

    runtime.train_section = dataclasses.replace(runtime.train_section, lm_head_log_probs=mode)
    start = [p.detach().clone() for p in runtime.model.parameters()]
    seen = recorded_outputs(runtime)
    batch = step_batch()
    counts = compute_step_counts(batch.loss_masks, runtime.groups.dp)
    metrics = runtime.train_step([batch.select([0, 1]), batch.select([2, 3])], counts)
    grads = {name: p.main_grad.detach().clone() for name, p in runtime.model.named_parameters()}
    fields = runtime.compute_fields([batch.select([0, 1, 2, 3])], ["log_probs"])
    with torch.no_grad():  # the next mode starts from the same weights
        for p, value in zip(runtime.model.parameters(), start):
            p.copy_(value)
    del runtime.forward
    return dict(metrics=metrics, grads=grads, fields=fields, seen=seen)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    scale = float(reference.abs().max())
    assert scale > 1e-6, "trivial reference: the comparison would prove nothing"
    return float((ours.double() - reference.double()).abs().max()) / scale


def _both_modes_on_rank(groups, checkpoint: str, sequence_parallel: bool = False) -> dict:
    runtime = build_runtime(groups, checkpoint, "logits")
    logits = train_and_score(runtime, "logits")
    fused = train_and_score(runtime, "fused")
    result = dict(logits=logits, fused=fused, vocab_local=runtime.vocab_local)
    if sequence_parallel:
        del runtime
        runtime = build_runtime(groups, checkpoint, "logits", sequence_parallel=True)
        result["sequence_parallel"] = dict(logits=train_and_score(runtime, "logits"),
                                           fused=train_and_score(runtime, "fused"))
    return result


def check_modes_agree(result, same_path: bool = False) -> None:
    """result["fused"] trained and scored as result["logits"]; unless same_path, through the other LM-head path."""
    logits, fused = result["logits"], result["fused"]
    if not same_path:
        assert set(logits["seen"]) == {torch.Tensor} and set(fused["seen"]) == {LMHeadShard}  # the paths differ
    assert logits["metrics"].keys() == fused["metrics"].keys()
    assert logits["metrics"]["grad_norm"] > 0 and "entropy" in " ".join(logits["metrics"])
    for name, value in logits["metrics"].items():
        assert fused["metrics"][name] == pytest.approx(value, rel=RELATIVE_TOLERANCE, abs=1e-9), name
    for name, grad in logits["grads"].items():
        if grad.abs().max() > 0:
            assert relative_error(fused["grads"][name], grad) <= RELATIVE_TOLERANCE, name
        else:
            assert fused["grads"][name].abs().max() == 0, name
    assert logits["grads"]["output_layer.weight"].abs().max() > 0  # the head's gradient reached DDP
    if logits["fields"] is not None:
        for ours, ref in zip(fused["fields"][0]["log_probs"], logits["fields"][0]["log_probs"]):
            assert relative_error(ours, ref) <= RELATIVE_TOLERANCE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from stacx.models.testing import save_tiny_hf_checkpoint

    path = str(tmp_path_factory.mktemp("lm_head_mode") / "policy")
    save_tiny_hf_checkpoint(path, "qwen3", seed=3, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def single_process_groups():
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.rollout.engines.cpu import ensure_single_process_layout

    yield ensure_single_process_layout()
    destroy_parallel_layout()


def test_fused_and_logits_train_and_score_alike_at_tp1(single_process_groups, checkpoint):
    check_modes_agree(_both_modes_on_rank(single_process_groups, checkpoint))


@pytest.mark.slow
@pytest.mark.distributed
def test_fused_and_logits_train_and_score_alike_at_tp2_with_a_padded_vocab(checkpoint):
    results = run_distributed(_both_modes_on_rank, world_size=2, tensor_model_parallel_size=2, args=(checkpoint, True))
    assert [r["vocab_local"] for r in results] == [51, 51]  # 101 real ids in 102 rows
    for result in results:
        check_modes_agree(result)
        # --sequence-parallel: the same step and scores in both modes (micro-batches of 21 and 17 tokens,
        # so each is padded to a multiple of tp=2), to fp32 rounding (RELATIVE_TOLERANCE).
        for mode in ("logits", "fused"):
            check_modes_agree(dict(logits=result[mode], fused=result["sequence_parallel"][mode]), same_path=True)


def test_under_fused_a_specialization_that_reads_logits_gets_them(single_process_groups, checkpoint, caplog):
    runtime = build_runtime(single_process_groups, checkpoint, "fused", OwnLocalValues)
    batch = runtime.pack(step_batch().select([0, 1]))
    with caplog.at_level(logging.INFO, logger="stacx.trainer.runtime.role_runtime"):
        assert isinstance(runtime.forward(batch), torch.Tensor)
        assert isinstance(runtime.forward(batch), torch.Tensor)
    assert [r.getMessage() for r in caplog.records if "needs the logits" in r.getMessage()] == [
        "role 'policy': --lm-head-log-probs fused, but OwnLocalValues needs the logits; it gets them"]  # once
    runtime.specialization = DeclaredFused()
    assert isinstance(runtime.forward(batch), LMHeadShard)
    # Distillation's top-K mode reads the logits shard (its student top-K) and gets it under `fused`.
    runtime.specialization = DistillSpecialization(AlgorithmConfig(distill_kl_mode="topk"), single_process_groups)
    assert isinstance(runtime.forward(batch), torch.Tensor)
    runtime.specialization = DistillSpecialization(AlgorithmConfig(distill_kl_mode="k3_sample"), single_process_groups)
    assert isinstance(runtime.forward(batch), LMHeadShard)
