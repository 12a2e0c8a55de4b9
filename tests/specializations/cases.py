"""Shared cases for the specialization tests: one packed micro-batch, one case per algorithm
setting, and an independent float64 reference written from each loss's definition.

The reference takes per-sequence logits [L_i, V] (from any model run on each sequence alone)
and never calls Stacx code: it is the formula, computed on whole sequences in one process.
The sharded side runs the specialization on TP/CP shards of a megatron-core model
(`run_cases_on_rank`, spawned by the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

VOCAB = 101  # odd on purpose: TP=2 pads the vocab
PROMPT_LENGTHS = [3, 5, 2, 4, 3, 6]
RESPONSE_LENGTHS = [6, 4, 9, 5, 7, 3]
PAIR_IDS = [0, 0, 1, 1, 2, 2]
IS_CHOSEN = [True, False, False, True, True, False]
TEACHER_TOP_K = 4
STUDENT_TOP_K = 3


def make_samples(seed: int = 11) -> dict[str, Any]:
    """Token sequences and every per-response field any case needs (whole responses)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=gen)  # noqa: E731
    sequences, fields = [], {name: [] for name in (
        "loss_masks", "advantages", "log_probs", "rollout_log_probs", "rollout_log_probs_near", "ref_log_probs",
        "values", "returns", "teacher_log_probs", "teacher_log_probs_mixed", "teacher_top_ids",
        "teacher_top_log_probs",
    )}
    for prompt, response in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS):
        sequences.append(torch.randint(0, VOCAB, (prompt + response,), generator=gen))
        mask = (rand(response) > 0.2).float()
        mask[0] = 1.0  # DPO needs a loss token in every response
        fields["loss_masks"].append(mask)
        fields["advantages"].append(float(torch.randn((), generator=gen)) + 0.1 * torch.randn(response, generator=gen))
        old = -4.6 + 0.6 * torch.randn(response, generator=gen)
        fields["log_probs"].append(old)
        fields["rollout_log_probs"].append(old + 0.4 * torch.randn(response, generator=gen))
        fields["rollout_log_probs_near"].append(old + 0.08 * torch.randn(response, generator=gen))
        fields["ref_log_probs"].append(-4.6 + 0.5 * torch.randn(response, generator=gen))
        fields["values"].append(-4.6 + 0.3 * torch.randn(response, generator=gen))
        fields["returns"].append(-4.6 + 0.5 * torch.randn(response, generator=gen))
        teacher = -0.5 - 5.0 * rand(response)
        fields["teacher_log_probs"].append(teacher)
        fields["teacher_log_probs_mixed"].append(torch.where(rand(response) < 0.4, torch.tensor(1.0), teacher))
        top_ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:TEACHER_TOP_K] for _ in range(response)])
        top_probs, _ = (0.05 + 0.2 * rand(response, TEACHER_TOP_K)).sort(-1, descending=True)
        fields["teacher_top_ids"].append(top_ids)
        fields["teacher_top_log_probs"].append(top_probs.log())
    return dict(sequences=sequences, response_lengths=list(RESPONSE_LENGTHS), **fields,
                pair_ids=list(PAIR_IDS), is_chosen=list(IS_CHOSEN))


@dataclass
class Case:
    """One specialization setting: class name, config values, batch fields and its reference."""

    specialization: str
    config: dict
    fields: tuple[str, ...]
    reference: Callable
    renamed: dict = field(default_factory=dict)  # batch field -> sample key it is read from
    checked_metrics: tuple[str, ...] = ("num_loss_tokens",)
    value_head: bool = False


def build_batch_fields(case: Case, samples: dict) -> dict:
    out = {name: samples[case.renamed.get(name, name)] for name in case.fields}
    return out


# ---- the float64 reference ---------------------------------------------------------------------


def response_rows(logits_i: torch.Tensor, sequence: torch.Tensor, response: int):
    """(log-softmax rows [R, V], log-probs of the response tokens [R]) of one sequence."""
    prompt = sequence.shape[0] - response
    log_softmax = torch.log_softmax(logits_i[prompt - 1 : -1].double(), dim=-1)
    return log_softmax, log_softmax.gather(1, sequence[prompt:, None])[:, 0]


def per_response(logits, samples):
    return [response_rows(lg, seq, r) for lg, seq, r in zip(logits, samples["sequences"], samples["response_lengths"])]


def masks64(samples):
    return [m.double() for m in samples["loss_masks"]]


def token_mean(terms, masks):
    total = sum((t * m).sum() for t, m in zip(terms, masks))
    return total / sum(m.sum() for m in masks)


def seq_mean_token_mean(terms, masks):
    return sum((t * m).sum() / m.sum() for t, m in zip(terms, masks)) / len(masks)


def seq_mean_token_sum(terms, masks):
    return sum((t * m).sum() for t, m in zip(terms, masks)) / len(masks)


def ref_sft(logits, samples, config):
    masks = masks64(samples)
    nll = [-lp for _, lp in per_response(logits, samples)]
    return token_mean(nll, masks), {"nll": sum((t.detach() * m).sum() for t, m in zip(nll, masks))}


def ref_actor_ppo_kl_entropy_tis(logits, samples, config):
    """ppo_clip (asymmetric + dual clip) * token_tis weight + k3 KL + entropy bonus, token-mean."""
    masks, terms, pg_sum = masks64(samples), [], 0.0
    low, high, c = config["clip_ratio_low"], config["clip_ratio_high"], config["clip_ratio_c"]
    for i, (log_softmax, lp) in enumerate(per_response(logits, samples)):
        old, adv = samples["log_probs"][i].double(), samples["advantages"][i].double()
        ratio = torch.exp(lp - old)
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * c), pg)
        weight = torch.exp(old - samples["rollout_log_probs"][i].double()).clamp(max=config["tis_threshold"])
        d = lp - samples["ref_log_probs"][i].double()
        k3 = (torch.exp(-d) - 1 + d).clamp(-10, 10)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        terms.append(weight * pg + config["kl_loss_coef"] * k3 - config["entropy_coef"] * entropy)
        pg_sum = pg_sum + (pg.detach() * masks[i]).sum()
    return token_mean(terms, masks), {"pg_loss": pg_sum}


def ref_actor_gspo_sequence_mis(logits, samples, config):
    """gspo on sequence_mis-corrected masks and weights, seq-mean-token-mean over the raw masks."""
    raw, terms, kept_masks = masks64(samples), [], []
    for i, (_, lp) in enumerate(per_response(logits, samples)):
        old, adv, m = samples["log_probs"][i].double(), samples["advantages"][i].double(), raw[i]
        seq_ratio = torch.exp(((old - samples["rollout_log_probs_near"][i].double()) * m).sum())
        keep = float(config["mis_lower"] <= seq_ratio <= config["mis_upper"])
        kept = m * keep
        s = torch.exp(((lp.detach() - old) * kept).sum() / kept.sum().clamp(min=1))
        token_ratio = s * torch.exp(lp - lp.detach())
        pg = torch.maximum(-adv * token_ratio, -adv * token_ratio.clamp(1 - config["clip_ratio_low"], 1 + config["clip_ratio_high"]))
        terms.append(pg * seq_ratio * keep)
        kept_masks.append(kept)
    # w_i = 1 / (N_seq * n_i) with n_i and N_seq from the RAW masks (known before the forward).
    loss = sum((t * k).sum() / m.sum() for t, k, m in zip(terms, kept_masks, raw)) / len(raw)
    return loss, {"sequence_mis_masked": sum(m.sum() for m, k in zip(raw, kept_masks) if k.sum() == 0)}


def ref_actor_vanilla_k2_on_policy(logits, samples, config):
    """vanilla_pg with pi_old = this forward (ratio 1, gradient -A d log pi) + k2 KL, seq-mean-token-sum."""
    masks, terms = masks64(samples), []
    for i, (_, lp) in enumerate(per_response(logits, samples)):
        adv = samples["advantages"][i].double()
        kl = 0.5 * (lp - samples["ref_log_probs"][i].double()) ** 2
        terms.append(-adv * torch.exp(lp - lp.detach()) + config["kl_loss_coef"] * kl)
    return seq_mean_token_sum(terms, masks), {}


def value_head_reference(log_softmax):
    """The stand-in value head of the critic cases: V = log p(token 0)."""
    return log_softmax[:, 0]


def ref_critic(logits, samples, config):
    masks, terms = masks64(samples), []
    clip = config["value_clip"]
    for i, (log_softmax, _) in enumerate(per_response(logits, samples)):
        v = value_head_reference(log_softmax)
        old, ret = samples["values"][i].double(), samples["returns"][i].double()
        terms.append(0.5 * torch.maximum((v - ret) ** 2, (old + (v - old).clamp(-clip, clip) - ret) ** 2))
    return token_mean(terms, masks), {"vf_loss": sum((t.detach() * m).sum() for t, m in zip(terms, masks))}


def k3(student, teacher):
    r = (teacher - student).clamp(-20, 20)
    return torch.exp(r) - 1 - r


def ref_distill_k3(logits, samples, config):
    masks = masks64(samples)
    terms = [k3(lp, u.double()) for (_, lp), u in zip(per_response(logits, samples), samples["teacher_log_probs"])]
    return token_mean(terms, masks), {"k3_mean": sum((t.detach() * m).sum() for t, m in zip(terms, masks))}


def ref_distill_topk(logits, samples, config):
    """Reverse KL on top-3(student) U top-4(teacher), renormalized; teacher values at student-only ids:
    the sampled token's teacher log-prob, else min(smallest listed log-prob, log of the residual mass)."""
    masks, terms = masks64(samples), []
    for i, (log_softmax, _) in enumerate(per_response(logits, samples)):
        seq, r = samples["sequences"][i], samples["response_lengths"][i]
        targets = seq[-r:]
        rows = []
        for t in range(r):
            student_ids = log_softmax[t].detach().topk(STUDENT_TOP_K).indices.tolist()
            teacher_ids = samples["teacher_top_ids"][i][t].tolist()
            teacher_top = samples["teacher_top_log_probs"][i][t].double()
            support = student_ids + [k for k in teacher_ids if k not in student_ids]
            fill = min(float(teacher_top.min()), math.log(max(1 - float(teacher_top.exp().sum()), 1e-12)))
            teacher_values = []
            for k in support:
                if k in teacher_ids:
                    teacher_values.append(float(teacher_top[teacher_ids.index(k)]))
                elif k == int(targets[t]):
                    teacher_values.append(float(samples["teacher_log_probs"][i][t]))
                else:
                    teacher_values.append(fill)
            log_q = torch.log_softmax(log_softmax[t, support], -1)
            log_p = torch.log_softmax(torch.tensor(teacher_values, dtype=torch.float64), -1)
            rows.append((log_q.exp() * (log_q - log_p)).sum())
        terms.append(torch.stack(rows))
    return token_mean(terms, masks), {"topk_reverse_kl": sum((t.detach() * m).sum() for t, m in zip(terms, masks))}


def ref_mixed(logits, samples, config):
    masks, terms, ce_sum, teacher_tokens = masks64(samples), [], 0.0, 0.0
    for (_, lp), u, m in zip(per_response(logits, samples), samples["teacher_log_probs_mixed"], masks64(samples)):
        u = u.double()
        is_teacher = u == 1.0
        terms.append(torch.where(is_teacher, -lp, k3(lp, torch.where(is_teacher, lp.detach(), u))))
        ce_sum = ce_sum + (-lp.detach() * is_teacher * m).sum()
        teacher_tokens = teacher_tokens + (is_teacher * m).sum()
    return token_mean(terms, masks), {"ce_mean": ce_sum, "num_teacher_tokens": teacher_tokens}


def ref_dpo(logits, samples, config):
    masks, beta = masks64(samples), config["dpo_beta"]
    seq_lp = [(lp * m).sum() for (_, lp), m in zip(per_response(logits, samples), masks)]
    seq_ref = [(ref.double() * m).sum() for ref, m in zip(samples["ref_log_probs"], masks)]
    losses, margins = [], 0.0
    for pair in sorted(set(PAIR_IDS)):
        c = next(i for i, (p, ch) in enumerate(zip(PAIR_IDS, IS_CHOSEN)) if p == pair and ch)
        r = next(i for i, (p, ch) in enumerate(zip(PAIR_IDS, IS_CHOSEN)) if p == pair and not ch)
        h = (seq_lp[c] - seq_ref[c]) - (seq_lp[r] - seq_ref[r])
        losses.append(-F.logsigmoid(beta * h) if config["dpo_loss_type"] == "sigmoid" else (h - 1 / (2 * beta)) ** 2)
        margins = margins + beta * h.detach()
    return torch.stack(losses).mean(), {"reward_margin": margins, "num_pairs": float(len(losses))}


ACTOR_PPO = dict(policy_loss="ppo_clip", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                 clip_ratio_c=3.0, use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.1, entropy_coef=0.01,
                 off_policy_corrections=["token_tis"], tis_threshold=1.5)

CASES: dict[str, Case] = {
    "sft": Case("CausalDecoderSpecialization", {}, ("loss_masks",), ref_sft, checked_metrics=("num_loss_tokens", "nll")),
    "actor_ppo_kl_entropy_tis": Case(
        "ActorSpecialization", ACTOR_PPO,
        ("loss_masks", "advantages", "log_probs", "rollout_log_probs", "ref_log_probs"),
        ref_actor_ppo_kl_entropy_tis, checked_metrics=("num_loss_tokens", "pg_loss"),
    ),
    "actor_gspo_sequence_mis": Case(
        "ActorSpecialization",
        dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.1, clip_ratio_high=0.1,
             off_policy_corrections="sequence_mis", mis_lower=0.8, mis_upper=1.25),
        ("loss_masks", "advantages", "log_probs", "rollout_log_probs"), ref_actor_gspo_sequence_mis,
        renamed={"rollout_log_probs": "rollout_log_probs_near"},
        checked_metrics=("num_loss_tokens", "sequence_mis_masked"),
    ),
    "actor_vanilla_k2_on_policy": Case(
        "ActorSpecialization",
        dict(policy_loss="vanilla_pg", loss_agg_mode="seq-mean-token-sum", use_kl_loss=True, kl_loss_type="k2",
             kl_loss_coef=0.05, log_entropy=False),
        ("loss_masks", "advantages", "ref_log_probs"), ref_actor_vanilla_k2_on_policy,
    ),
    "critic": Case("CriticSpecialization", dict(value_clip=0.2), ("loss_masks", "values", "returns"), ref_critic,
                   checked_metrics=("num_loss_tokens", "vf_loss"), value_head=True),
    "distill_k3": Case("DistillSpecialization", dict(distill_kl_mode="k3_sample"), ("loss_masks", "teacher_log_probs"),
                       ref_distill_k3, checked_metrics=("num_loss_tokens", "k3_mean")),
    "distill_topk": Case(
        "DistillSpecialization", dict(distill_kl_mode="topk", student_top_k=STUDENT_TOP_K),
        ("loss_masks", "teacher_log_probs", "teacher_top_ids", "teacher_top_log_probs"), ref_distill_topk,
        checked_metrics=("num_loss_tokens", "topk_reverse_kl"),
    ),
    "mixed_dagger": Case(
        "MixedLossDaggerOPDSpecialization", {}, ("loss_masks", "teacher_log_probs"), ref_mixed,
        renamed={"teacher_log_probs": "teacher_log_probs_mixed"},
        checked_metrics=("num_loss_tokens", "ce_mean", "num_teacher_tokens"),
    ),
    "dpo_sigmoid": Case("DPOSpecialization", dict(dpo_beta=0.5, dpo_loss_type="sigmoid"),
                        ("loss_masks", "ref_log_probs", "pair_ids", "is_chosen"), ref_dpo,
                        checked_metrics=("num_loss_tokens", "reward_margin", "num_pairs")),
    "dpo_ipo": Case("DPOSpecialization", dict(dpo_beta=0.5, dpo_loss_type="ipo"),
                    ("loss_masks", "ref_log_probs", "pair_ids", "is_chosen"), ref_dpo,
                    checked_metrics=("num_loss_tokens", "num_pairs")),
}


def algorithm_config(case: Case):
    from stacx.trainer.config.run import AlgorithmConfig

    return AlgorithmConfig.from_values(case.config)


def build_specialization(case: Case, groups):
    import stacx.specializations as specializations

    return getattr(specializations, case.specialization)(algorithm_config(case), groups)


def reference_config(case: Case) -> dict:
    return algorithm_config(case).to_dict()


# ---- the sharded side --------------------------------------------------------------------------


def stand_in_value_head(logits_local, groups):
    """Critic output for the tests (stacx.models has no value head yet): V = log p(token 0), replicated over TP."""
    from stacx.parallel.vocab_parallel import vocab_parallel_log_probs

    ids = torch.zeros(logits_local.shape[0], dtype=torch.long, device=logits_local.device)
    return vocab_parallel_log_probs(logits_local, ids, tp_group=groups.tp)


def run_case(model_forward, groups, case: Case, samples: dict, collective_counts: dict | None = None) -> dict:
    """What a worker does for one micro-batch; returns loss, reduced metrics and rescaled gradients
    (and, with a live `collective_counts`, the collectives issued inside compute_loss)."""
    from stacx.parallel.metrics_allreduce import all_reduce_metric_sums
    from stacx.parallel.reduction import Reducer, compute_step_counts
    from stacx.specializations import model_inputs, pack_micro_batch

    specialization = build_specialization(case, groups)
    batch = pack_micro_batch(samples["sequences"], samples["response_lengths"], groups=groups,
                             **build_batch_fields(case, samples))
    counts = compute_step_counts(batch["loss_masks"], groups.dp)
    reducer = Reducer.for_step(mode=specialization.loss_agg_mode(), counts=counts, groups=groups)
    logits = model_forward(*model_inputs(batch))
    logits.retain_grad()
    output = stand_in_value_head(logits, groups) if case.value_head else logits
    before = dict(collective_counts or {})
    loss, metric_sums = specialization.compute_loss(output, batch, reducer)
    issued = {key: collective_counts[key] - before[key] for key in before}
    loss.backward()
    return dict(
        collectives=issued,
        loss=reducer.loss_value(loss),
        metrics=all_reduce_metric_sums(metric_sums, groups.dp_cp),
        logits_grad=(logits.grad / reducer.gradient_scale).detach(),
        local=batch["layout"].local_positions, padded=list(batch["layout"].padded_lengths),
        scale=reducer.gradient_scale,
    )


def run_cases_on_rank(groups, checkpoint: str, case_names: list[str]) -> dict:
    """Spawned on every rank: build the TP/CP-sharded model once, run every case, gather grads."""
    import torch.distributed as dist

    from stacx.models import build_model, forward_packed, load_hf_checkpoint
    from tests.parallel.collective_counter import install_collective_counter

    torch.manual_seed(0)
    model = build_model(checkpoint, groups, initialize_weights=False)
    load_hf_checkpoint(model, checkpoint, groups)
    samples = make_samples()
    params = dict(model.named_parameters())
    counts = install_collective_counter()
    results = {}
    for name in case_names:
        model.zero_grad(set_to_none=True)
        result = run_case(lambda tokens, padded: forward_packed(model, tokens, padded, groups), groups, CASES[name], samples,
                          counts)
        norm = params["decoder.final_layernorm.weight"].grad.detach().clone()
        head = params["output_layer.weight"].grad.detach().clone()
        if groups.cp_size > 1:
            dist.all_reduce(norm, group=groups.cp)
            dist.all_reduce(head, group=groups.cp)
        shards = [torch.empty_like(head) for _ in range(groups.tp_size)]
        dist.all_gather(shards, head, group=groups.tp) if groups.tp_size > 1 else shards.__setitem__(0, head)
        result.update(norm_grad=norm / result["scale"], head_grad=torch.cat(shards)[:VOCAB] / result["scale"],
                      tp_rank=groups.tp_rank, cp_rank=groups.cp_rank)
        results[name] = result
    results["no_grad_passes"] = no_grad_passes(model, groups, samples)
    return results


def no_grad_passes(model, groups, samples) -> dict:
    """compute_log_probs (old/reference log-probs) and compute_values: whole responses on every rank."""
    from stacx.models import forward_packed
    from stacx.specializations import ActorSpecialization, CriticSpecialization, model_inputs, pack_micro_batch

    batch = pack_micro_batch(samples["sequences"], samples["response_lengths"], groups=groups,
                             loss_masks=samples["loss_masks"])
    with torch.no_grad():
        logits = forward_packed(model, *model_inputs(batch), groups)
        log_probs = ActorSpecialization(None, groups).compute_log_probs(logits, batch)
        values = CriticSpecialization(None, groups).compute_values(stand_in_value_head(logits, groups), batch)
    return dict(log_probs=log_probs, values=values)
