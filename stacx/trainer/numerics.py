"""Non-finite values stop a run (or, opt-in, skip a bounded number of steps) before they reach weights.

Two halves:

- on every rank of a trainable role, `step_optimizer_if_finite` replaces `optimizer.step()`:
      found_inf = prepare_grads();  g = ||grad||_2 (megatron's get_grad_norm, all-reduced over TP x PP)
      if found_inf or g or the step's loss is NaN/inf:  zero the grads, no update, no LR step
      else:                                              optimizer.step() (clip to clip_grad, Adam)
  The gradients were all-reduced over DP x CP before (`finish_grad_sync`) and the loss is summed over
  DP x CP, so g and the loss are the same on every rank and every rank takes the same branch: a
  non-finite update is never applied, on any rank, so non-finite weights are never saved, exported
  or pushed to an inference engine.
- on the driver (and, in SPMD, on every rank with the same data), `NonFiniteGuard.check` looks at a
  step's rewards, advantages and each role's metrics. The first non-finite value either stops the
  run with `NonFiniteError` naming the step, the role and the metric, or - while fewer than
  `--skip-nonfinite-steps` steps were skipped - logs a warning and the step is skipped.

Megatron reports a non-finite gradient norm as NaN/inf (and, with a grad scaler, `found_inf`); its
own `step()` then applies the update anyway when no scaler is used (fp32/bf16), which is why the
check happens before the step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PRIORITY_METRICS = ("loss", "grad_norm")
"""A role's metrics checked first, so the message names the loss before the metrics derived from it."""


WEIGHTS_NONFINITE_METRIC = "weights_nonfinite"
"""A role's step metric: 1.0 when its weights are not finite after the update (0.0 otherwise)."""


class NonFiniteError(RuntimeError):
    """A loss, gradient norm, reward or advantage was NaN or inf; the message names step, role and metric."""


def is_finite_number(value: Any) -> bool:
    """True for a finite int/float (and anything that is not a number, e.g. a string metric)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True
    return math.isfinite(value)


def first_nonfinite_metric(metrics: Mapping[str, Any]) -> Optional[str]:
    """The first non-finite metric name: `loss`, then `grad_norm`, then the others in their order."""
    ordered = [key for key in PRIORITY_METRICS if key in metrics]
    ordered += [key for key in metrics if key not in PRIORITY_METRICS]
    for key in ordered:
        if not is_finite_number(metrics[key]):
            return key
    return None


def first_nonfinite_sample(values: Sequence[Any]) -> Optional[tuple[int, float]]:
    """(sample index, offending value) of the first sample whose value (a float or a tensor) is not
    finite, else None. Tensors [R_i] count as non-finite when any element is."""
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            if value.numel() and not bool(torch.isfinite(value).all()):
                bad = value[~torch.isfinite(value)].flatten()[0]
                return index, float(bad)
        elif value is not None and not is_finite_number(float(value)):
            return index, float(value)
    return None


@dataclass(frozen=True)
class OptimizerStepOutcome:
    """What `step_optimizer_if_finite` did on this rank (the same on every rank of the role)."""

    applied: bool
    """The update was applied (False: NaN/inf loss or gradients, grads zeroed, no step)."""
    grad_norm: float
    """Global L2 norm of the gradients before clipping (inf when megatron's scaler found inf/nan)."""
    weights_finite: bool
    """Every parameter is finite after the step (False only when a finite update overflowed them)."""


def step_optimizer_if_finite(optimizer, loss_value: float) -> OptimizerStepOutcome:
    """One megatron optimizer step that is skipped when the gradients or the loss are not finite
    (formula in the module doc), followed by a check that the updated weights are finite (a huge
    learning rate can overflow them from finite gradients). Call on every rank of the role."""
    found_inf = bool(optimizer.prepare_grads())
    grad_norm = float("inf") if found_inf else float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm) or not math.isfinite(float(loss_value)):
        optimizer.zero_grad()
        return OptimizerStepOutcome(applied=False, grad_norm=grad_norm, weights_finite=True)
    update_successful, _, _ = optimizer.step()  # prepare_grads again is a copy; the norm is recomputed to clip
    return OptimizerStepOutcome(applied=bool(update_successful), grad_norm=grad_norm,
                                weights_finite=parameters_are_finite(optimizer))


def parameters_are_finite(optimizer) -> bool:
    """All of the optimizer's (main) parameters are finite on every rank of the model-parallel group
    (TP shards differ; DP and CP replicas hold the same values after the same update). A mixture-of-experts
    model's optimizer is a chain (dense and expert parameters, reduced over different groups): its flag is
    then agreed over the whole world, which holds both."""
    links = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    params = [p for link in links for p in link.get_parameters()]
    local_bad = any(not bool(torch.isfinite(p).all()) for p in params)
    flag = torch.tensor([1.0 if local_bad else 0.0])
    if dist.is_available() and dist.is_initialized():
        group = links[0].get_grad_stats_parallel_group() if len(links) == 1 else None
        if params:
            flag = flag.to(params[0].device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return float(flag.item()) == 0.0


class NonFiniteGuard:
    """Decides, step by step, whether a non-finite value stops the run or skips the step.

    max_skipped_steps: how many steps may be skipped with a warning (`--skip-nonfinite-steps`);
    the next one raises. Every rank holding a guard sees the same values, so all decide alike.
    """

    def __init__(self, max_skipped_steps: int = 0):
        if max_skipped_steps < 0:
            raise ValueError(f"--skip-nonfinite-steps must be >= 0, got {max_skipped_steps}")
        self.max_skipped_steps = int(max_skipped_steps)
        self.skipped_steps: list[int] = []

    def handle(self, *, step: int, role: str, metric: str, value: Any) -> None:
        """Raise `NonFiniteError`, or record a skipped step and warn (the caller then skips it)."""
        if self.skipped_steps and self.skipped_steps[-1] == step:  # another role of a step already skipped
            logger.warning("step %d: role %r also produced a non-finite %s (%s)", step, role, metric, value)
            return
        message = (f"step {step}: role {role!r} produced a non-finite {metric} ({value}); no update was applied "
                   "and no weights were saved, exported or pushed")
        if len(self.skipped_steps) >= self.max_skipped_steps:
            hint = (f" (already skipped {len(self.skipped_steps)} step(s): {self.skipped_steps})"
                    if self.max_skipped_steps else "")
            raise NonFiniteError(
                message + hint + ". Lower --lr, check the reward function and the data, or pass --skip-nonfinite-steps N "
                "to skip up to N such steps")
        self.skipped_steps.append(step)
        logger.warning("%s; skipping the step (%d of at most %d skipped)", message, len(self.skipped_steps),
                       self.max_skipped_steps)

    def check_samples(self, *, step: int, role: str, name: str, values: Iterable[Any]) -> bool:
        """True (after `handle`) when a per-sample field has a non-finite entry, else False."""
        found = first_nonfinite_sample(list(values))
        if found is None:
            return False
        index, value = found
        self.handle(step=step, role=role, metric=f"{name} of sample {index}", value=value)
        return True

    def check_metrics(self, *, step: int, role: str, metrics: Mapping[str, Any]) -> bool:
        """True (after `handle`) when one of a role's step metrics is not finite, else False.
        Overflowed weights (`WEIGHTS_NONFINITE_METRIC` set) always stop the run: the update is applied."""
        if metrics.get(WEIGHTS_NONFINITE_METRIC):
            raise NonFiniteError(
                f"step {step}: role {role!r} has non-finite weights after its optimizer update (loss "
                f"{metrics.get('loss')}, grad_norm {metrics.get('grad_norm')}, lr {metrics.get('lr')}); the run stops "
                "before saving, exporting or pushing them. Lower --lr (or raise --lr-warmup-steps)")
        key = first_nonfinite_metric(metrics)
        if key is None:
            return False
        self.handle(step=step, role=role, metric=key, value=metrics[key])
        return True
