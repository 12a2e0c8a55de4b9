"""What the demos share: the size of a tiny model, the knobs of an SFT and an on-policy phase, and running a phase as a real
`stacx.trainer.run_training` run whose metrics.jsonl the demo then reads.

    sft: SftPhase = SftPhase(steps=60, batch_size=32, lr=3e-3)       # a field of a demo's settings
    loss_first, loss_last = run_phase(settings, out_dir, "sft", {**settings.sft.run_values(), ...},
                                      metric="policy/loss")
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class TinyModel:
    """Size of a random tiny model a demo starts from."""

    hidden_size: int
    """Model width."""
    num_layers: int
    """Transformer layers."""
    num_attention_heads: int = 4
    """Attention heads (hidden_size // num_attention_heads each; vLLM's CPU attention takes head sizes from 32 up,
    so a model served by vLLM has hidden_size // 32 heads or fewer)."""

    def describe(self) -> str:
        return f"{self.num_layers}-layer hidden-{self.hidden_size}"


@dataclass(frozen=True, kw_only=True)
class SftPhase:
    """A supervised phase."""

    recipe: str = "sft"
    """The recipe (`sft`; `flow_matching_sft` in the diffusion demo)."""
    steps: int
    """Optimizer steps."""
    batch_size: int
    """Examples per step."""
    lr: float
    """Learning rate."""

    def run_values(self) -> dict:
        """The run-config keys these knobs set."""
        return {"train": {"algorithm": self.recipe}, "rollout_batch_size": self.batch_size, "lr": self.lr,
                "num_steps": self.steps}


@dataclass(frozen=True, kw_only=True)
class OnPolicyPhase:
    """A phase that trains on the policy's own samples, a group of them per prompt."""

    recipe: str
    """The recipe (`grpo`, `opd`; `flow_grpo` in the diffusion demo)."""
    steps: int
    """Optimizer steps."""
    prompts_per_step: int
    """Prompts per step."""
    samples_per_prompt: int
    """Samples per prompt (the group the rewards are normalized in)."""
    lr: float
    """Learning rate."""
    kl_coef: float = 0.0
    """Weight of the low-variance KL to the reference (the phase's starting model); 0: no KL loss."""

    def run_values(self) -> dict:
        """The run-config keys these knobs set."""
        values = {"train": {"algorithm": self.recipe}, "rollout_batch_size": self.prompts_per_step,
                  "n_samples_per_prompt": self.samples_per_prompt, "lr": self.lr, "num_steps": self.steps}
        if self.kl_coef:
            values["algorithm"] = {"use_kl_loss": True, "kl_loss_coef": self.kl_coef}
        return values

    def describe(self, samples: str = "samples") -> str:
        return f"{self.steps} steps x {self.prompts_per_step} prompts x {self.samples_per_prompt} {samples}"


@dataclass
class PhaseResult:
    phase: str
    metric: str
    before: float
    after: float
    seconds: float
    extra: dict = field(default_factory=dict)


def demo_run_config(settings, out_dir: str, phase: str, values: dict):
    """The RunConfig of one phase: `values` over the demos' common base (CPU engine, out_dir/<phase>).
    `settings`: a demo's settings (its `seed` and `progress_bar` are read)."""
    from stacx.trainer.config.run import RunConfig

    base = {"out": os.path.join(out_dir, phase), "seed": settings.seed, "rollout_seed": settings.seed,
            "progress_bar": settings.progress_bar, "rollout_engine": "cpu", "max_tokens_per_micro_batch": 4096}
    return RunConfig.from_dict({**base, **values}, source=f"demo {phase} phase")


def train(run_config, graph=None) -> None:
    """One phase's run, on `graph`'s running role workers when given (the demo's phases share one policy worker)."""
    from stacx.trainer import run_training

    run_training(run_config, graph=graph)


def run_phase(settings, out_dir: str, phase: str, values: dict, *, metric: str, graph=None) -> tuple[float, float]:
    """Train one phase (on `graph`'s workers when given); returns the means of `metric` over its first and its
    last steps."""
    train(demo_run_config(settings, out_dir, phase, values), graph)
    return head_tail_means(metric_series(os.path.join(out_dir, phase, "metrics.jsonl"), metric))


def metric_series(path: str, name: str) -> list[float]:
    values = []
    with open(path) as handle:
        for line in handle:
            row = json.loads(line)
            if name in row:
                values.append(float(row[name]))
    return values


def head_tail_means(series: list[float], n: int = 5) -> tuple[float, float]:
    n = max(1, min(n, len(series) // 2))
    return sum(series[:n]) / n, sum(series[-n:]) / n


def phase_outputs(out_dir: str, phases) -> dict:
    """Where each phase's run wrote its metrics, TensorBoard events and plots (the summaries' "outputs")."""
    return {phase: {"metrics": os.path.join(out_dir, phase, "metrics.jsonl"),
                    "tensorboard": os.path.join(out_dir, phase, "tensorboard"),
                    "plots": os.path.join(out_dir, phase, "plots")} for phase in phases}


def write_summary(out_dir: str, summary: dict) -> dict:
    with open(os.path.join(out_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    return summary
