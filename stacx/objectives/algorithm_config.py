"""Every algorithm hyperparameter, declared once: `AlgorithmConfig`.

One frozen, keyword-only dataclass holds each knob the loss kernels, advantage estimators and
specializations read: its type, its one default and a docstring. Everything else is derived from
`dataclasses.fields(AlgorithmConfig)`:

- the run configuration's known `algorithm:` keys and their value types (`stacx.trainer.config.run`),
- the `stacx train` flags of the algorithm section and their defaults (`stacx.launch.run_flags`),
- what a kernel reads: every kernel, estimator and specialization receives an `AlgorithmConfig` as
  `config` and reads `config.<knob>`, so no read site restates a default (`as_algorithm_config`
  refuses any other object where a config enters the loss code: a specialization's constructor,
  the trainer's advantage call, the padded-plugin adapters).

Custom hyperparameters (a plugin's `rwr_temperature`) live in `extras` and read like fields
(`config.rwr_temperature`). `given_keys` records which keys the user set (file, flags, env), so a
recipe default is overridden by any given value, even one equal to the generic default.

The module is pure Python (no torch), so `stacx.objectives` can read its defaults and the trainer
can build and validate it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping


class AlgorithmConfigError(ValueError):
    """An algorithm hyperparameter has a wrong name, type or value; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The `algorithm:` section of a run: the RL / distillation knobs as data.

    The per-token policy objective is `policy_loss(ratio, advantage; clip_ratio_low, clip_ratio_high)`
    aggregated with `loss_agg_mode`, plus `kl_loss_coef * KL(pi || pi_ref)` (estimator
    `kl_loss_type`) when `use_kl_loss`, minus `entropy_coef * entropy`. Kernels receive this object
    as `config` and read attributes; custom keys come from `extras`.
    """

    # ---- kernels (names in the stacx.objectives registries; the recipe is train.algorithm) ----
    advantage_estimator: str | None = None
    """Name in the advantage registry: grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gae, reward_centered."""
    policy_loss: str = "ppo_clip"
    """Name in the policy-loss registry: ppo_clip, gspo, cispo, vanilla_pg, reinforce."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    # ---- policy loss ----
    clip_ratio: float = 0.2
    """Both clip bounds when clip_ratio_low / clip_ratio_high are unset."""
    clip_ratio_low: float | None = None
    """Lower clip: the importance ratio is clipped to >= 1 - clip_ratio_low (None: clip_ratio)."""
    clip_ratio_high: float | None = None
    """Upper clip: the ratio is clipped to <= 1 + clip_ratio_high (None: clip_ratio; DAPO's clip-higher raises it)."""
    clip_ratio_c: float | None = None
    """Dual-clip constant c (> 1) bounding the loss for negative advantages; None disables it."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (0 means entropy has no gradient)."""
    log_entropy: bool = True
    """Log the policy entropy as a metric (computed without gradient when entropy_coef is 0)."""
    recompute_old_log_probs: bool = False
    """Recompute log pi_old with the trainer's model instead of using the inference engine's log-probs."""
    # ---- KL to the reference ----
    use_kl_loss: bool = False
    """Add a KL(pi || pi_ref) term to the loss against the reference model (needs --ref-load)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss term: k1, k2, k3 (= low_var_kl)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss term when use_kl_loss is set."""
    use_kl_in_reward: bool = False
    """Subtract kl_in_reward_coef * KL from the per-token reward (REINFORCE++)."""
    kl_in_reward_type: str = "k1"
    """KL estimator of the in-reward penalty."""
    kl_in_reward_coef: float = 0.0
    """Weight of the in-reward KL penalty when use_kl_in_reward is set."""
    # ---- advantages and returns ----
    gamma: float = 1.0
    """Discount of the returns (GAE, REINFORCE++), in [0, 1]."""
    lam: float = 0.95
    """GAE's lambda, in [0, 1]: bias/variance trade-off of the advantage (ppo)."""
    norm_adv_by_std: bool = True
    """Divide group-centered rewards by the group's standard deviation (Dr. GRPO and RLOO turn this off)."""
    whiten_advantages: bool = False
    """Whiten GAE advantages over the batch (mean 0, std 1)."""
    adv_eps: float = 1e-6
    """Epsilon added to standard deviations when normalizing advantages."""
    value_clip: float | None = None
    """Critic value clip around the old values (ppo sets 0.5); None disables it."""
    # ---- off-policy corrections (train/rollout mismatch) ----
    off_policy_corrections: str | None = None
    """Comma-separated correction names applied to the policy loss (tis, mis, opsm, m2po); None: none."""
    tis_threshold: float = 2.0
    """Truncated importance sampling: weights are clipped to <= this."""
    mis_lower: float = 0.5
    """Masked importance sampling: tokens with a weight below this are masked."""
    mis_upper: float = 2.0
    """Masked importance sampling: tokens with a weight above this are masked."""
    opsm_delta: float = 1e-4
    """Off-policy sequence masking: KL threshold above which negative-advantage sequences are masked."""
    m2po_threshold: float = 0.04
    """M2PO: second-moment budget of the per-micro-batch token mask."""
    # ---- DAPO data shaping ----
    filter_zero_variance_groups: bool = False
    """DAPO dynamic sampling: drop prompt groups whose rewards are all equal (they carry no signal)."""
    overlong_buffer_length: int | None = None
    """DAPO soft overlong punishment: responses within this many tokens of the limit are penalized linearly."""
    overlong_buffer_fraction: float | None = None
    """The overlong buffer as a fraction of rollout_max_response_len, used when overlong_buffer_length is unset
    (DAPO: 4096 of 20480 tokens, a fifth), so the recipe fits any response-length limit."""
    overlong_penalty_factor: float = 1.0
    """Largest overlong penalty (reached at the length limit)."""
    # ---- preference optimization ----
    dpo_beta: float = 0.1
    """DPO's beta: scale of the implicit reward log pi/pi_ref."""
    dpo_loss_type: str = "sigmoid"
    """DPO loss: sigmoid (DPO), ipo, hinge."""
    dpo_average_log_prob: bool = False
    """Average (instead of sum) the response log-probs of each preference pair."""
    label_smoothing: float = 0.0
    """Conservative DPO: probability that a preference label is flipped."""
    # ---- distillation ----
    teacher_kl_coef: float = 0.0
    """Reverse-KL shaping against a teacher: per-token reward -= coef * (log pi(a) - log pi_teacher(a)); 0 disables it."""
    student_top_k: int | None = None
    """Student support size of top-K reverse KL (None: teacher_top_k)."""
    distill_topk_renormalize: bool = True
    """Renormalize the teacher's and the student's top-K probabilities over their union support."""
    # ---- copied from other run-config sections at resolution (one flag each: theirs) ----
    rollout_temperature: float = 1.0
    """The rollout's sampling temperature; training log-probs use it (copied from rollout.rollout_temperature)."""
    distill_kl_mode: str = "k3_sample"
    """Distillation KL: k3_sample or topk (copied from teacher.distill_kl_mode)."""
    teacher_top_k: int = 8
    """Top-K of teacher log-probs (copied from teacher.teacher_top_k)."""

    # ---- not hyperparameters: custom keys and the record of what the user set ----
    extras: Mapping[str, Any] = field(default_factory=dict)
    """Custom hyperparameters (name -> value) read by plugin kernels as `config.<name>`."""
    given_keys: frozenset[str] = field(default=frozenset(), compare=False)
    """Keys the user set (config file, flags, environment); recipe and generic defaults excluded."""

    def __post_init__(self) -> None:
        for f in hyperparameter_fields():
            object.__setattr__(self, f.name, _checked_value(f, getattr(self, f.name)))
        extras = dict(self.extras or {})
        clash = sorted(set(extras) & set(ALGORITHM_DEFAULTS))
        if clash:
            raise AlgorithmConfigError(f"algorithm.extras holds known hyperparameters {clash}; set them as fields")
        object.__setattr__(self, "extras", types.MappingProxyType(extras))
        object.__setattr__(self, "given_keys", frozenset(self.given_keys))
        for bound in ("clip_ratio_low", "clip_ratio_high"):
            if getattr(self, bound) is None:
                object.__setattr__(self, bound, self.clip_ratio)
        self._check_ranges()

    def _check_ranges(self) -> None:
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "kl_loss_coef", "kl_in_reward_coef",
                     "entropy_coef", "gamma", "lam", "overlong_penalty_factor", "teacher_kl_coef", "adv_eps"):
            if getattr(self, name) < 0:
                raise AlgorithmConfigError(f"algorithm.{name} must be a number >= 0, got {getattr(self, name)!r}")
        for name in ("gamma", "lam"):
            if getattr(self, name) > 1.0:
                raise AlgorithmConfigError(f"algorithm.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise AlgorithmConfigError(f"algorithm.clip_ratio_c must be a number > 1 or None, got {self.clip_ratio_c!r}")
        if self.value_clip is not None and self.value_clip < 0:
            raise AlgorithmConfigError(f"algorithm.value_clip must be >= 0 or None, got {self.value_clip!r}")
        if self.overlong_buffer_length is not None and self.overlong_buffer_length < 1:
            raise AlgorithmConfigError(f"algorithm.overlong_buffer_length must be an integer >= 1, "
                                       f"got {self.overlong_buffer_length!r}")
        if self.overlong_buffer_fraction is not None and not 0.0 < self.overlong_buffer_fraction <= 1.0:
            raise AlgorithmConfigError(f"algorithm.overlong_buffer_fraction must be in (0, 1], "
                                       f"got {self.overlong_buffer_fraction!r}")

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: custom hyperparameters read like fields.
        if name.startswith("__") or name == "extras":
            raise AttributeError(name)
        extras = self.__dict__.get("extras", {})
        if name in extras:
            return extras[name]
        raise AttributeError(f"algorithm config has no hyperparameter {name!r}; known: {', '.join(ALGORITHM_DEFAULTS)}; "
                             f"custom: {', '.join(extras) or 'none'} (set it under `algorithm:` or --algorithm-param)")

    def __hash__(self) -> int:
        # extras may hold unhashable values (lists): hash the flat values' text.
        return hash(repr(sorted(self.to_dict().items())))

    def __reduce__(self):
        # MappingProxyType does not pickle: rebuild from plain values (Ray workers, checkpoints).
        return (_rebuild, (self.to_dict(), tuple(sorted(self.given_keys))))

    @classmethod
    def from_values(cls, values: Mapping[str, Any], *, given_keys=None) -> "AlgorithmConfig":
        """Known keys become fields, the others `extras`; `given_keys` defaults to every key in `values`."""
        known = {k: v for k, v in values.items() if k in ALGORITHM_DEFAULTS}
        extras = {k: v for k, v in values.items() if k not in ALGORITHM_DEFAULTS}
        given = frozenset(values) if given_keys is None else frozenset(given_keys)
        return cls(**known, extras=extras, given_keys=given)

    def given_values(self) -> dict[str, Any]:
        """{key: value} of the keys the user set (a custom key read from `extras`, even one named like a
        method of this class: `custom_hyperparameters`)."""
        return {key: self.extras[key] if key in self.extras else getattr(self, key) for key in sorted(self.given_keys)}

    def custom_hyperparameters(self) -> dict[str, Any]:
        """The custom keys (`extras`) as a plain dict."""
        return dict(self.extras)

    def to_dict(self) -> dict[str, Any]:
        """Every hyperparameter and custom key as one flat dict (what checkpoints store)."""
        return {**{f.name: getattr(self, f.name) for f in hyperparameter_fields()}, **self.extras}


def as_algorithm_config(config: "AlgorithmConfig | None", where: str) -> "AlgorithmConfig":
    """`config` itself when it is an `AlgorithmConfig`, the declared defaults for None; TypeError naming
    `where` (the code that received it) and the fix for anything else. Called where a config enters
    the loss code, once, so that a kernel never finds a missing knob deep inside its math."""
    if config is None:
        return AlgorithmConfig()
    if isinstance(config, AlgorithmConfig):
        return config
    raise TypeError(f"{where} needs a stacx.objectives.algorithm_config.AlgorithmConfig (the run's algorithm section; "
                    f"build one with AlgorithmConfig(...) or AlgorithmConfig.from_values({{...}})), "
                    f"got {type(config).__name__}")


def _rebuild(values: dict[str, Any], given_keys: tuple[str, ...]) -> AlgorithmConfig:
    return AlgorithmConfig.from_values(values, given_keys=given_keys)


_NOT_HYPERPARAMETERS = ("extras", "given_keys")


def hyperparameter_fields(config_cls: type | None = None) -> tuple[dataclasses.Field, ...]:
    """The fields of `config_cls` (default AlgorithmConfig) that are hyperparameters (all but `extras`
    and `given_keys`)."""
    return tuple(f for f in dataclasses.fields(config_cls or AlgorithmConfig) if f.name not in _NOT_HYPERPARAMETERS)


def field_type(f: dataclasses.Field) -> Any:
    """The field's annotation as a type (`float | None`), evaluated from its string form."""
    return f.type if not isinstance(f.type, str) else eval(f.type, vars(typing) | {"types": types})  # noqa: S307


def scalar_type(f: dataclasses.Field) -> type:
    """The non-None type of a field (`float` for `float | None`): what a flag or YAML value converts to."""
    hint = field_type(f)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _checked_value(f: dataclasses.Field, value: Any) -> Any:
    """The value if it has the field's type (an int is a float, a list of names joins for a str field);
    AlgorithmConfigError naming the field otherwise."""
    optional = type(None) in typing.get_args(field_type(f))
    base = scalar_type(f)
    if value is None:
        if optional:
            return None
        raise AlgorithmConfigError(f"algorithm.{f.name} must not be None (expects {base.__name__})")
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if base is str and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # off_policy_corrections: [tis, mis] -> "tis,mis"
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    raise AlgorithmConfigError(f"algorithm.{f.name} expects {base.__name__}, got {type(value).__name__} {value!r}")


ALGORITHM_DEFAULTS: dict[str, Any] = {
    f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
    for f in hyperparameter_fields()
}
"""Hyperparameter name -> its one default, derived from the dataclass."""


__all__ = ["ALGORITHM_DEFAULTS", "AlgorithmConfig", "AlgorithmConfigError", "as_algorithm_config",
           "hyperparameter_fields", "scalar_type"]
