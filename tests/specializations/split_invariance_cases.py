"""Cases for the split-invariance tests: one global step batch, a tiny differentiable model, one
family per loss, and the train step of a role worker run over any split of that batch.

The model: logits[p] = tanh(E[x_p] + P[pos_p]) @ W and values[p] = tanh(E[x_p] + P[pos_p]) . w,
with pos_p the position of token p inside its own sequence. Its output at a token depends only on
that token and its position, never on the packing, the micro-batch or the CP rank, so every split
of the batch sees the same function; E, P, W and w are all trainable.

A split runs what `RoleRuntime.train_step` does, with the same functions: the driver's
`plan_micro_batches` and `count_loss_tokens`, the worker's `RoleRuntime.pack`,
`Reducer.for_step(mode=specialization.loss_agg_mode(), ...)`, the specialization's
`compute_loss`, `all_reduce_metric_sums` once per micro-batch, `MetricTotals` and
`metric_means`. Megatron's DDP averaging is `sum over DP x CP, divided by dp * cp`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import os

import torch

from tests.specializations import custom_sequence_loss

SEED_003_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples", "specialization_in_one_file", "my_algo.py")

VOCAB = 37  # odd, unrelated to the hidden size
HIDDEN = 8
MAX_POSITIONS = 64
NORM_LENGTH = 12.0  # seq-mean-token-sum-norm divisor (the trainer passes rollout_max_response_len)
TEACHER_TOP_K = 4
STUDENT_TOP_K = 3
ALL_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: The sample whose loss mask is all zero (excluded from N_seq); DPO uses a full mask there instead.
EMPTY_MASK_SAMPLE = 6
#: (prompt length, response length) of the 10 samples of the step; pairs (0,1), (2,3), ... for DPO.
SAMPLE_LENGTHS = [(3, 7), (1, 11), (5, 2), (2, 9), (6, 5), (4, 12), (2, 3), (1, 8), (3, 10), (5, 4)]


class TinyTokenModel(torch.nn.Module):
    """logits [T, V] = tanh(E[tokens] + P[positions]) @ W; values [T] = tanh(...) @ w."""

    def __init__(self, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embedding = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen))
        self.positions = torch.nn.Parameter(0.5 * torch.randn(MAX_POSITIONS, HIDDEN, generator=gen))
        self.output = torch.nn.Parameter(0.8 * torch.randn(HIDDEN, VOCAB, generator=gen))
        self.value_head = torch.nn.Parameter(torch.randn(HIDDEN, generator=gen))

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if int(positions.max()) >= MAX_POSITIONS:
            raise ValueError(f"position {int(positions.max())} >= MAX_POSITIONS={MAX_POSITIONS}")
        return torch.tanh(self.embedding[tokens] + self.positions[positions])  # [T, H]

    def logits(self, tokens, positions) -> torch.Tensor:
        return self.hidden(tokens, positions) @ self.output  # [T, V]

    def values(self, tokens, positions) -> torch.Tensor:
        return self.hidden(tokens, positions) @ self.value_head  # [T]

    def gradient(self) -> torch.Tensor:
        """Every parameter's .grad, flattened into one vector (zeros where a parameter got none)."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.parameters()])


@torch.no_grad()
def response_log_probs(model: TinyTokenModel, tokens: torch.Tensor, response_length: int) -> torch.Tensor:
    """log pi(response token j) of one whole sequence [R] (float64): used only to build batch fields
    near the model's own log-probs, so that ratios are near 1 and clipping is partly active."""
    logits = model.logits(tokens, torch.arange(tokens.shape[0])).double()
    prompt = tokens.shape[0] - response_length
    rows = torch.log_softmax(logits[prompt - 1 : -1], -1)
    return rows.gather(1, tokens[prompt:, None])[:, 0]


def make_global_batch(seed: int = 5) -> dict[str, list]:
    """The step batch (per-sample lists, the trainer's format) with every field any family reads: a copy of
    the one built for `seed` (built once per process; every split and family of a process reads the same batch)."""
    return {name: [value.clone() if isinstance(value, torch.Tensor) else value for value in values]
            for name, values in _built_global_batch(seed).items()}


@functools.lru_cache(maxsize=None)
def _built_global_batch(seed: int) -> dict[str, list]:
    gen = torch.Generator().manual_seed(seed)
    noise = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    model = TinyTokenModel()
    batch: dict[str, list] = {name: [] for name in (
        "tokens", "response_lengths", "loss_masks", "loss_masks_dpo", "advantages", "log_probs",
        "rollout_log_probs", "ref_log_probs", "values", "returns", "teacher_log_probs",
        "teacher_log_probs_mixed", "teacher_top_ids", "teacher_top_log_probs", "pair_ids", "is_chosen",
    )}
    for index, (prompt, response) in enumerate(SAMPLE_LENGTHS):
        tokens = torch.randint(0, VOCAB, (prompt + response,), generator=gen)
        batch["tokens"].append(tokens)
        batch["response_lengths"].append(response)
        mask = (torch.rand(response, generator=gen) > 0.25).float()
        mask[0] = 1.0
        batch["loss_masks_dpo"].append(torch.ones(response) if index == EMPTY_MASK_SAMPLE else mask.clone())
        batch["loss_masks"].append(torch.zeros(response) if index == EMPTY_MASK_SAMPLE else mask)
        own = response_log_probs(model, tokens, response).float()
        old = own + 0.15 * noise(response)
        batch["advantages"].append(float(noise(())) + 0.2 * noise(response))
        batch["log_probs"].append(old)
        batch["rollout_log_probs"].append(old + 0.05 * noise(response))
        batch["ref_log_probs"].append(own + 0.3 * noise(response))
        with torch.no_grad():
            values = model.values(tokens, torch.arange(tokens.shape[0]))[prompt - 1 : -1]
        batch["values"].append(values + 0.2 * noise(response))
        batch["returns"].append(values + 0.5 * noise(response))
        teacher = (own + 0.4 * noise(response)).clamp(max=-1e-3)
        batch["teacher_log_probs"].append(teacher)
        batch["teacher_log_probs_mixed"].append(
            torch.where(torch.rand(response, generator=gen) < 0.4, torch.tensor(1.0), teacher))
        batch["teacher_top_ids"].append(
            torch.stack([torch.randperm(VOCAB, generator=gen)[:TEACHER_TOP_K] for _ in range(response)]))
        top_probs, _ = (0.03 + 0.2 * torch.rand(response, TEACHER_TOP_K, generator=gen)).sort(-1, descending=True)
        batch["teacher_top_log_probs"].append(top_probs.log())
        batch["pair_ids"].append(index // 2)
        batch["is_chosen"].append(index % 2 == (index // 2) % 2)  # chosen first in some pairs, second in others
    return batch


@dataclass(frozen=True)
class Family:
    """One loss family: specialization class, config, the batch fields it reads and the modes it supports."""

    specialization: str
    config: dict
    fields: tuple[str, ...]
    modes: tuple[str, ...] = ALL_MODES
    renamed: dict = field(default_factory=dict)  # batch field -> global batch key it is read from
    value_head: bool = False


FAMILIES: dict[str, Family] = {
    "sft": Family("CausalDecoderSpecialization", {}, ("loss_masks",)),
    "actor_ppo_clip_k3_entropy_tis": Family(
        "ActorSpecialization",
        dict(policy_loss="ppo_clip", clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=3.0, use_kl_loss=True,
             kl_loss_type="low_var_kl", kl_loss_coef=0.1, entropy_coef=0.01, off_policy_corrections=["token_tis"],
             tis_threshold=1.02),
        ("loss_masks", "advantages", "log_probs", "rollout_log_probs", "ref_log_probs"),
    ),
    "actor_gspo_sequence_mis_opsm": Family(
        "ActorSpecialization",
        dict(policy_loss="gspo", clip_ratio_low=0.05, clip_ratio_high=0.05,
             off_policy_corrections=["sequence_mis", "opsm"], mis_lower=0.8, mis_upper=1.25, opsm_delta=0.01),
        ("loss_masks", "advantages", "log_probs", "rollout_log_probs"),
    ),
    "actor_cispo_token_mis": Family(
        "ActorSpecialization",
        dict(policy_loss="cispo", clip_ratio_low=0.1, clip_ratio_high=0.1, off_policy_corrections=["token_mis"],
             mis_lower=0.95, mis_upper=1.05),
        ("loss_masks", "advantages", "log_probs", "rollout_log_probs"),
    ),
    "actor_vanilla_pg_on_policy_k2": Family(
        "ActorSpecialization",
        dict(policy_loss="vanilla_pg", use_kl_loss=True, kl_loss_type="k2", kl_loss_coef=0.05, log_entropy=False),
        ("loss_masks", "advantages", "ref_log_probs"),
    ),
    # Issue 13: a custom sequence-level loss with no declared trait (whole responses under CP by
    # default), and guide 003's specialization (response_log_probs + sum_of_sample_mean + reducer(scalar)).
    "actor_custom_sequence_loss": Family("ActorSpecialization", dict(policy_loss=custom_sequence_loss.NAME, log_entropy=False),
                                         ("loss_masks", "advantages", "log_probs")),
    "guide_003_my_algo": Family(f"{SEED_003_EXAMPLE}:MyAlgoSpecialization", {}, ("loss_masks",), modes=("token-mean",)),
    "critic_value_clipped": Family("CriticSpecialization", dict(value_clip=0.2), ("loss_masks", "values", "returns"),
                                   value_head=True),
    "distill_k3_sample": Family("DistillSpecialization", dict(distill_kl_mode="k3_sample"),
                                ("loss_masks", "teacher_log_probs")),
    "distill_topk": Family(
        "DistillSpecialization", dict(distill_kl_mode="topk", student_top_k=STUDENT_TOP_K),
        ("loss_masks", "teacher_log_probs", "teacher_top_ids", "teacher_top_log_probs"),
    ),
    "mixed_dagger_opd": Family("MixedLossDaggerOPDSpecialization", {}, ("loss_masks", "teacher_log_probs"),
                               renamed={"teacher_log_probs": "teacher_log_probs_mixed"}),
    "dpo_sigmoid": Family("DPOSpecialization", dict(dpo_beta=0.5, dpo_loss_type="sigmoid"),
                          ("loss_masks", "ref_log_probs", "pair_ids", "is_chosen"), modes=("seq-mean-token-sum",),
                          renamed={"loss_masks": "loss_masks_dpo"}),
    "dpo_ipo": Family("DPOSpecialization", dict(dpo_beta=0.5, dpo_loss_type="ipo"),
                      ("loss_masks", "ref_log_probs", "pair_ids", "is_chosen"), modes=("seq-mean-token-sum",),
                      renamed={"loss_masks": "loss_masks_dpo"}),
}

#: Every (family, mode) the invariance tests run.
FAMILY_MODES = [(name, mode) for name, family in FAMILIES.items() for mode in family.modes]

#: Families whose gradient depends on the split (documented in docs/parallel.md, "Which losses are
#: split-invariant"): m2po's mask is chosen over the tokens of ONE micro-batch (all of its DP rank's
#: tokens when there is one micro-batch per rank), so another split masks other tokens.
SPLIT_DEPENDENT_FAMILIES: dict[str, Family] = {
    "actor_ppo_clip_m2po": Family(
        "ActorSpecialization",
        dict(policy_loss="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2, off_policy_corrections=["m2po"],
             m2po_threshold=0.005),
        ("loss_masks", "advantages", "log_probs", "rollout_log_probs"),
    ),
    # A sequence-level loss wrongly registered token_local=True: gets CP slices, so CP changes it.
    "actor_custom_sequence_loss_declared_token_local": Family(
        "ActorSpecialization", dict(policy_loss=custom_sequence_loss.WRONGLY_TOKEN_LOCAL_NAME, log_entropy=False),
        ("loss_masks", "advantages", "log_probs")),
}


def family_by_name(name: str) -> Family:
    return FAMILIES[name] if name in FAMILIES else SPLIT_DEPENDENT_FAMILIES[name]


def family_step_batch(family: Family, global_batch: dict[str, list]):
    """The step batch one role sees: tokens, response lengths and the family's fields only
    (optional fields change what the actor computes, so a family gets exactly its own)."""
    from stacx.trainer.batch import StepBatch

    batch = StepBatch(tokens=global_batch["tokens"], response_lengths=global_batch["response_lengths"],
                      **{name: global_batch[family.renamed.get(name, name)] for name in family.fields})
    return batch


def build_specialization(family: Family, mode: str, groups):
    import stacx.specializations as specializations
    from stacx.trainer.config.run import AlgorithmConfig

    config = dict(family.config)
    if mode in ALL_MODES and family.specialization != "DPOSpecialization":
        config["loss_agg_mode"] = mode
    if ":" in family.specialization:  # "path/to/user_file.py:ClassName", loaded like --custom-module
        from stacx.objectives import load_custom_modules

        path, class_name = family.specialization.rsplit(":", 1)
        specialization_cls = getattr(load_custom_modules([path])[0], class_name)
    else:
        specialization_cls = getattr(specializations, family.specialization)
    specialization = specialization_cls(AlgorithmConfig.from_values(config), groups)
    assert specialization.loss_agg_mode() == mode, (family, mode, specialization.loss_agg_mode())
    return specialization


# ---- one rank's train step ----------------------------------------------------------------------


@dataclass(frozen=True)
class EmulatedDataParallelGroups:
    """ProcessGroups of DP rank `dp_rank` of `dp_size` emulated in ONE process (no communication).

    Sizes and ranks are what a real DP group reports, so `Reducer.for_step` scales by dp; the
    metric all-reduce is the identity and the caller sums the ranks' totals and gradients.
    """

    dp_size: int
    dp_rank: int
    tp = cp = dp = dp_cp = None
    tp_size = cp_size = 1
    tp_rank = cp_rank = 0

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank


def model_output(model: TinyTokenModel, batch: dict[str, Any], value_head: bool) -> torch.Tensor:
    """What `RoleRuntime.forward` returns for this CP rank's slice: logits [T_local, V] or values [T_local]."""
    layout = batch["layout"]
    tokens_local, positions = layout.slice_tokens(batch["tokens"]), layout.local_position_ids()
    return model.values(tokens_local, positions) if value_head else model.logits(tokens_local, positions)


def run_rank_train_step(model, specialization, family: Family, step_batch, micro_batches, counts, groups) -> dict:
    """RoleRuntime.train_step without the optimizer: gradients stay in model's .grad.

    Returns this rank's MetricTotals sums (already all-reduced over groups.dp_cp), the loss under
    the key LOSS_METRIC.
    """
    from stacx.parallel.metrics_allreduce import MetricTotals, all_reduce_metric_sums
    from stacx.parallel.reduction import Reducer
    from stacx.trainer.runtime.role_runtime import LOSS_METRIC, RoleRuntime, normalize_uncounted_metrics

    reducer = Reducer.for_step(mode=specialization.loss_agg_mode(), counts=counts, groups=groups,
                               norm_length=NORM_LENGTH)
    # RoleRuntime.pack only reads self.groups: call the worker's own packing on a stand-in.
    runtime = SimpleNamespace(groups=groups)
    totals = MetricTotals()
    uncounted: set[str] = set()
    for indices in micro_batches:
        batch = RoleRuntime.pack(runtime, step_batch.select(indices))
        output = model_output(model, batch, family.value_head)
        loss, metric_sums = specialization.compute_loss(output, batch, reducer)
        loss.backward()
        metric_sums = normalize_uncounted_metrics(dict(metric_sums), specialization, reducer, uncounted)
        metric_sums[LOSS_METRIC] = reducer.loss_value(loss)
        totals.add(all_reduce_metric_sums(metric_sums, groups.dp_cp))
    totals.sums.update({UNCOUNTED_PREFIX + name: 0.0 for name in uncounted})
    return totals.sums


UNCOUNTED_PREFIX = "uncounted:"
"""Marks, in a rank's sums, the metrics `normalize_uncounted_metrics` took as reducer outputs."""


def logged_metrics(specialization, sums: dict[str, float]) -> dict[str, float]:
    """What train_step logs: loss total plus `metric_means` of the other sums."""
    from stacx.trainer.runtime.role_runtime import LOSS_METRIC

    sums = dict(sums)
    loss = sums.pop(LOSS_METRIC)
    uncounted = [name[len(UNCOUNTED_PREFIX):] for name in list(sums) if name.startswith(UNCOUNTED_PREFIX)]
    for name in uncounted:
        sums.pop(UNCOUNTED_PREFIX + name)
    metrics = specialization.metric_means(sums)
    metrics.update({name: sums[name] for name in uncounted})  # logged as reduced, like train_step
    metrics[LOSS_METRIC] = loss
    return metrics


@dataclass(frozen=True)
class Split:
    """How the step batch is cut: DP and CP sizes, token budget per micro-batch, sample order."""

    label: str
    dp_size: int
    cp_size: int
    max_tokens_per_micro_batch: int
    permutation_seed: int | None = None

    def ordered(self, step_batch):
        if self.permutation_seed is None:
            return step_batch
        gen = torch.Generator().manual_seed(self.permutation_seed)
        return step_batch.select(torch.randperm(step_batch.num_samples, generator=gen).tolist())

    def plan(self, step_batch) -> list[list[list[int]]]:
        from stacx.trainer.batch import plan_micro_batches

        return plan_micro_batches(step_batch, dp_size=self.dp_size, cp_size=self.cp_size,
                                  max_tokens_per_micro_batch=self.max_tokens_per_micro_batch)


def run_split_in_process(family_name: str, mode: str, split: Split) -> dict:
    """A split with DP emulated in one process (cp must be 1): the DDP-averaged gradient and the
    logged metrics, exactly as a dp-rank job would produce them."""
    from stacx.parallel.reduction import StepCounts, count_loss_tokens

    assert split.cp_size == 1, "CP needs real ranks (run_split_on_rank)"
    family = family_by_name(family_name)
    step_batch = split.ordered(family_step_batch(family, make_global_batch()))
    plan = split.plan(step_batch)
    num_tokens, num_sequences = count_loss_tokens(step_batch.loss_masks)  # the driver's counts
    counts = StepCounts(num_tokens=num_tokens, num_sequences=num_sequences)
    gradient, sums, specialization = None, {}, None
    for dp_rank in range(split.dp_size):
        groups = EmulatedDataParallelGroups(dp_size=split.dp_size, dp_rank=dp_rank)
        model = TinyTokenModel()
        specialization = build_specialization(family, mode, groups)
        rank_sums = run_rank_train_step(model, specialization, family, step_batch, plan[dp_rank], counts, groups)
        # Emulated all-reduces: gradients and metric sums summed over the DP ranks.
        gradient = model.gradient() if gradient is None else gradient + model.gradient()
        sums = {k: sums.get(k, 0.0) + v for k, v in rank_sums.items()}
    return dict(gradient=gradient / split.dp_size, metrics=logged_metrics(specialization, sums),
                num_micro_batches=len(plan[0]))


def run_split_on_rank(groups, family_name: str, mode: str, split: Split) -> dict:
    """A split on real gloo ranks (groups of this rank): counts by `compute_step_counts` over DP,
    gradients summed over DP x CP and divided by dp * cp like megatron's DDP."""
    import torch.distributed as dist

    from stacx.parallel.reduction import compute_step_counts

    assert (groups.dp_size, groups.cp_size) == (split.dp_size, split.cp_size), split
    family = family_by_name(family_name)
    step_batch = split.ordered(family_step_batch(family, make_global_batch()))
    my_micro_batches = split.plan(step_batch)[groups.dp_rank]
    counts = compute_step_counts([step_batch.loss_masks[i] for mb in my_micro_batches for i in mb], groups.dp)
    model = TinyTokenModel()
    specialization = build_specialization(family, mode, groups)
    sums = run_rank_train_step(model, specialization, family, step_batch, my_micro_batches, counts, groups)
    gradient = model.gradient()
    if groups.dp_cp_size > 1:
        dist.all_reduce(gradient, group=groups.dp_cp)
    return dict(gradient=gradient / groups.dp_cp_size, metrics=logged_metrics(specialization, sums),
                num_micro_batches=len(my_micro_batches))


def build_world_layouts(dp2_cp2_groups) -> dict[tuple[int, int], Any]:
    """(dp, cp) -> this rank's ProcessGroups on a 4-rank world: the harness's dp=2 x cp=2 layout,
    plus cp=4 (every rank holds chunks of every sequence) and dp=4, both over the world group."""
    import torch.distributed as dist

    from stacx.parallel.groups import ProcessGroups

    world = dist.group.WORLD
    return {
        (dp2_cp2_groups.dp_size, dp2_cp2_groups.cp_size): dp2_cp2_groups,
        (1, 4): ProcessGroups(tp=None, cp=world, dp=None, dp_cp=world),
        (4, 1): ProcessGroups(tp=None, cp=None, dp=world, dp_cp=world),
    }


def run_every_family_on_rank(groups, splits: list[Split]) -> dict:
    """Spawned on each of 4 ranks: every (family, mode) under every split. {(split label, family, mode): result}."""
    layouts = build_world_layouts(groups)
    results = {}
    for split in splits:
        for name, mode in FAMILY_MODES:
            result = run_split_on_rank(layouts[(split.dp_size, split.cp_size)], name, mode, split)
            # Plain arrays travel back by value (hundreds of tensors through torch's shared-memory
            # queue outlive the rank's file handles).
            result["gradient"] = result["gradient"].numpy()
            results[(split.label, name, mode)] = result
    return results
