"""DAgger roll-in schedules: who acts in each turn of a distillation rollout.

Two protocols share the mixed-loss kernel but split turns between teacher and student
differently:

- Per-turn beta-mixture (`BetaMixtureRollIn`): in iteration i, each turn is executed by the
  teacher with probability beta(i), independently. Schedules of beta over iterations, with
  s = beta_start, e = beta_end, N = num_iters, u = min(i / N, 1):
      linear       beta(i) = s + (e - s) * u
      cosine       beta(i) = e + (s - e) * (1 + cos(pi * u)) / 2
      exponential  beta(i) = e + (s - e) * rate**i        (rate in (0, 1), default 0.5)
      step         beta(i) = s if i < N else e
  The default is linear 1.0 -> 0.0 over 5 iterations.
- Trajectory-level AggreVaTe (`AggreVaTeRollIn`): per trajectory, kappa ~ U{0, ..., T_max(i)}
  (inclusive); the student acts in turns 0..kappa-1 and the teacher in every later turn.
  T_max(i) = min(start + step * i, cap), default 0 / 20 / 100.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from stacx.wire.sample import Executor

BETA_SCHEDULES = ("linear", "cosine", "exponential", "step")


@dataclass(frozen=True, kw_only=True)
class BetaSchedule:
    """beta(i), the probability that the teacher acts in a turn at iteration i (formulas above)."""

    kind: str = "linear"
    start: float = 1.0
    end: float = 0.0
    num_iters: int = 5
    rate: float = 0.5
    """Per-iteration decay factor of the 'exponential' schedule."""

    def __post_init__(self):
        if self.kind not in BETA_SCHEDULES:
            raise ValueError(f"dagger_beta_schedule: unknown {self.kind!r}; known: {list(BETA_SCHEDULES)}")
        for name in ("start", "end"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"dagger_beta_{name} must be in [0, 1], got {value}")
        if self.num_iters < 1:
            raise ValueError(f"dagger_beta_iters must be >= 1, got {self.num_iters}")
        if not 0.0 < self.rate < 1.0:
            raise ValueError(f"exponential beta rate must be in (0, 1), got {self.rate}")

    def __call__(self, iteration: int) -> float:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        s, e, n = self.start, self.end, self.num_iters
        u = min(iteration / n, 1.0)
        if self.kind == "linear":
            return s + (e - s) * u
        if self.kind == "cosine":
            return e + (s - e) * (1.0 + math.cos(math.pi * u)) / 2.0
        if self.kind == "exponential":
            return e + (s - e) * self.rate ** iteration
        return s if iteration < n else e


@dataclass(frozen=True, kw_only=True)
class TMaxSchedule:
    """T_max(i) = min(start + step * i, cap), the largest student-led prefix (in turns) at iteration i."""

    start: int = 0
    step: int = 20
    cap: int = 100

    def __post_init__(self):
        if self.start < 0 or self.step < 0 or self.cap < self.start:
            raise ValueError(
                f"dagger_kappa_start/step/cap must satisfy 0 <= start <= cap and step >= 0, got {self.start}/{self.step}/{self.cap}"
            )

    def __call__(self, iteration: int) -> int:
        return min(self.start + self.step * iteration, self.cap)


TurnExecutor = Callable[[int], Executor]
"""Given a turn index (0-based), who acts in it."""


class BetaMixtureRollIn:
    """Each turn: teacher with probability beta(iteration), else student (one draw per turn)."""

    def __init__(self, schedule: BetaSchedule = BetaSchedule()):
        self.schedule = schedule

    def plan(self, iteration: int, rng: random.Random) -> TurnExecutor:
        beta = self.schedule(iteration)
        decided: dict[int, Executor] = {}

        def executor(turn: int) -> Executor:
            if turn not in decided:
                decided[turn] = Executor.TEACHER if rng.random() < beta else Executor.STUDENT
            return decided[turn]

        return executor


@dataclass(frozen=True)
class KappaPlan:
    """One trajectory's AggreVaTe plan: the student acts in turns < kappa, the teacher after."""

    kappa: int

    def __call__(self, turn: int) -> Executor:
        return Executor.STUDENT if turn < self.kappa else Executor.TEACHER


class AggreVaTeRollIn:
    """kappa ~ U{0..T_max(iteration)} per trajectory; student for turns < kappa, teacher after."""

    def __init__(self, schedule: TMaxSchedule = TMaxSchedule()):
        self.schedule = schedule

    def plan(self, iteration: int, rng: random.Random) -> KappaPlan:
        # The drawn kappa travels with the plan (not as roll-in state), so concurrent plans never mix.
        return KappaPlan(rng.randint(0, self.schedule(iteration)))


def build_roll_in(teacher_section) -> BetaMixtureRollIn | AggreVaTeRollIn:
    """The roll-in named by a run config's teacher section (after env overrides)."""
    mode = teacher_section.dagger_sampling_mode
    if mode == "beta":
        return BetaMixtureRollIn(BetaSchedule(
            kind=teacher_section.dagger_beta_schedule, start=teacher_section.dagger_beta_start,
            end=teacher_section.dagger_beta_end, num_iters=teacher_section.dagger_beta_iters,
        ))
    if mode == "kappa":
        return AggreVaTeRollIn(TMaxSchedule(
            start=teacher_section.dagger_kappa_start, step=teacher_section.dagger_kappa_step,
            cap=teacher_section.dagger_kappa_cap,
        ))
    raise ValueError(f"dagger_sampling_mode: unknown {mode!r}; known: ['beta', 'kappa']")
