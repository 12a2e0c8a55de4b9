"""The resolved configuration of one run: what `stacx train` flags and `--config run.yaml` fill in.

A `RunConfig` is a set of small frozen sections. Every field name is unique across sections,
so each field has exactly one command-line flag (`--tensor-model-parallel-size` for
`parallel.tensor_model_parallel_size`) and one YAML key (flat `tensor_model_parallel_size:` or
nested under its section). The `algorithm:` section also takes any custom hyperparameter,
which the loss kernels read as `config.<name>`.

    cfg = RunConfig.from_dict({"train": {"algorithm": "grpo"}, "algorithm": {"my_temp": 0.3},
                               "tensor_model_parallel_size": 2})
    cfg.parallel.tensor_model_parallel_size  # 2
    cfg.algorithm.my_temp                    # 0.3

Unknown keys raise `ConfigError` naming the key (and the closest known names). The recipe is named
once, by `train.algorithm` (`--algorithm`); `algorithm.name` is refused with that fix, except in a
Flux-style `algorithm:` section, where `name` is Flux's policy loss (see `FLUX_STYLE_KEYS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from stacx.objectives.algorithm_config import (
    AlgorithmConfig,
    AlgorithmConfigError,
    hyperparameter_fields,
    scalar_type,
)
from stacx.ranges import require_in_range
from stacx.rollout.sections import RolloutSection, TeacherSection  # the sections the rollout reads, defined there
from stacx.trainer.config.critic_modes import (
    CRITIC_MODES,
    DEFAULT_CRITIC_MODE,
    CriticModeError,
    check_critic_mode,
)


class ConfigError(ValueError):
    """A run-configuration key or value is wrong; the message names it."""


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    hf_checkpoint: str | None = None
    """Hugging Face checkpoint folder of the policy (config.json, safetensors, tokenizer)."""
    ref_load: str | None = None
    """Checkpoint of the reference model (KL anchor), held inside the policy worker."""
    critic_load: str | None = None
    """Checkpoint the critic starts from (defaults to hf_checkpoint)."""
    load: str | None = None
    """Stacx checkpoint folder to resume from (the latest complete step inside it)."""
    save: str | None = None
    """Folder where Stacx checkpoints are written."""
    overwrite: bool = False
    """Let a new run write into a --save folder that holds another run's checkpoints (replacing them)."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of each MoE layer's load-balancing loss (megatron's aux_loss); 0 = off."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of each MoE layer's router z-loss; 0 = off."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """With --pipeline-model-parallel-size P > 1: layers per virtual pipeline stage (megatron's interleaved
    schedule); each rank then holds num_hidden_layers / (P x this) model chunks (unset: one per rank)."""
    sequence_parallel: bool = False
    """At --tensor-model-parallel-size > 1: megatron's sequence parallelism (the activations outside attention
    and the MLP split along the sequence over TP); required for mixture-of-experts models there."""
    lora_rank: int = 0
    """LoRA: the rank of the adapters put on the trainable policy's linears (0: full fine-tuning). Only the
    adapters are trained (gradients, optimizer state); the base weights are frozen (docs/lora.md)."""
    lora_alpha: float = 16.0
    """LoRA: the adapters' update is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """LoRA: dropout probability on each adapter's input while training, in [0, 1)."""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """LoRA: the linears that get adapters, any of linear_qkv, linear_proj, linear_fc1, linear_fc2, experts
    (the routed experts' fc1 and fc2), or all-linear; repeatable."""
    lora_plus_ratio: float = 1.0
    """LoRA+ (Hayou et al. 2024): the adapters' B matrices learn at this many times --lr (A and every other
    parameter at --lr; --min-lr scaled alike); 1: plain LoRA. The LoRA+ paper suggests about 16 with a lower
    --lr (docs/lora.md)."""
    lora_rslora: bool = False
    """Rank-stabilized LoRA (rsLoRA, Kalajdzievski 2023): the update is scaled by lora_alpha / sqrt(lora_rank)
    instead of lora_alpha / lora_rank (a PEFT export then says use_rslora: true)."""
    lora_init: str = "random"
    """LoRA: how each adapter's A starts (B starts at zero, so the run starts from the base model): 'random'
    (PyTorch's default linear init), 'principal' (A's rows along the base weight's top-rank right singular
    vectors, PiSSA's input subspace; the base is not changed), 'gradient' (along the top-rank right singular vectors
    of the base weight's gradient on the first training batch, LoRA-GA's A; one extra forward and backward before
    the first step) or 'gradient-sign' (the same of the gradient's sign: the input directions of Adam's first full
    fine-tuning step); docs/lora.md."""
    lora_sync: str = "merged"
    """LoRA: what a weight push sends the rollout engine: 'merged' (W + s B A under the base names, any engine) or
    'adapters' (the adapters only: the 'cpu' engine's `stacx serve` is started with the run's --lora-* flags and
    merges them; vLLM and SGLang load them with their own LoRA loading; attached servers must be started with the
    matching flags; docs/lora.md)."""
    lora_critic: str = DEFAULT_CRITIC_MODE
    """LoRA: what a critic (a role with a value head, PPO's) does while the policy trains adapters: 'full' (trained
    whole), 'adapters' (its base frozen; adapters of its own, with the run's --lora-* settings, and its value head
    train) or 'frozen' (it keeps its --critic-load weights and only computes values: no optimizer state);
    stacx.trainer.config.critic_modes, docs/lora.md."""

    def __post_init__(self):
        unknown = [name for name in self.lora_target_modules if name not in (*LORA_TARGET_MODULES, "all-linear")]
        if unknown or not self.lora_target_modules:
            raise ConfigError(f"--lora-target-modules: unknown or missing module names {unknown}; choose from "
                              f"{[*LORA_TARGET_MODULES, 'all-linear']}")
        require_in_range("--lora-dropout", self.lora_dropout, at_least=0, below=1, error=ConfigError)
        require_in_range("--lora-plus-ratio", self.lora_plus_ratio, above=0, error=ConfigError)
        if self.lora_rank > 0:
            require_in_range("--lora-alpha", self.lora_alpha, above=0, why=f"with --lora-rank {self.lora_rank}",
                             error=ConfigError)
        else:
            for flag, value, default in (("--lora-plus-ratio", self.lora_plus_ratio, 1.0),
                                         ("--lora-rslora", self.lora_rslora, False),
                                         ("--lora-init", self.lora_init, "random")):
                if value != default:
                    raise ConfigError(f"{flag} {value} shapes LoRA adapters, but --lora-rank is 0 (full fine-tuning); "
                                      f"set --lora-rank (e.g. 8) or drop {flag}")
        try:
            check_critic_mode(self.lora_critic, self.lora_rank)
        except CriticModeError as err:
            raise ConfigError(str(err)) from None


def engine_lora_flags(model: ModelSection) -> tuple[str, ...]:
    """The `stacx serve` flags of an engine that takes the policy's adapters only (--lora-sync adapters), else ()."""
    if model.lora_rank <= 0 or model.lora_sync != "adapters":
        return ()
    targets = [token for name in model.lora_target_modules for token in ("--lora-target-modules", name)]
    rslora = ("--lora-rslora",) if model.lora_rslora else ()
    return ("--lora-rank", str(model.lora_rank), "--lora-alpha", str(model.lora_alpha), *rslora, *targets)


LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts")
"""--lora-target-modules names (stacx.models.lora.TARGET_MODULES, which this config may not import)."""


@dataclass(frozen=True, kw_only=True)
class ParallelSection:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel degree of every trainable role."""
    context_parallel_size: int = 1
    """Context-parallel degree of every trainable role."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel degree of every trainable role: its layers are split into this many stages."""
    data_parallel_size: int = 1
    """Data-parallel degree; a role uses tp * cp * pp * dp ranks."""
    expert_model_parallel_size: int = 1
    """Mixture-of-experts models: ranks the routed experts are spread over (divides num_experts and tp * cp * dp)."""
    expert_tensor_parallel_size: int | None = None
    """Mixture-of-experts models: tensor-parallel degree of each routed expert (default: the tensor-parallel size)."""
    ray_address: str | None = None
    """Address of an existing Ray cluster; unset starts a local one (or uses RAY_ADDRESS)."""
    num_cpus_per_rank: float = 1.0
    """CPUs a role worker reserves in its placement group."""
    num_gpus_per_rank: float = 0.0
    """GPUs a role worker reserves (1 on GPU clusters; colocated roles share them)."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective; a stuck rank fails the run instead of hanging it."""


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_decay_style: str = "constant"
    """'constant', 'linear' or 'cosine'."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.98
    """Adam beta2."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0: off)."""


@dataclass(frozen=True, kw_only=True)
class TrainSection:
    algorithm: str | None = None
    """The recipe (`stacx recipes`), the one place a run names it; wins verbatim over use_critic and
    advantage_estimator (see infer_algorithm)."""
    use_critic: bool = False
    """Train a critic (selects the ppo recipe when no algorithm is given)."""
    num_steps: int = 10
    """Rollout steps (one rollout, then num_steps_per_rollout x num_epochs optimizer steps each)."""
    global_batch_size: int | None = None
    """Samples per optimizer step; rollout_batch_size x n_samples_per_prompt = global_batch_size x
    num_steps_per_rollout (unset: derived from num_steps_per_rollout, or the whole rollout)."""
    num_steps_per_rollout: int | None = None
    """Optimizer steps per pass over a rollout's samples, one mini-batch each (unset: derived from
    global_batch_size, or 1)."""
    num_epochs: int = 1
    """Passes over each rollout's samples, reshuffled (seeded) each pass; the old log-probs stay
    those computed before the rollout's first update."""
    max_tokens_per_micro_batch: int = 4096
    """Token budget of one packed micro-batch on one rank."""
    lm_head_log_probs: str = "auto"
    """How training log-probs are taken from the LM head: 'fused' (from the hidden states, never building the logits), 'logits' (materialize the logits shard) or 'auto' (fused on CUDA or when one micro-batch's fp32 logits shard would reach 1 GiB)."""
    seed: int = 1234
    """Seed of initialization, data order and sampling."""
    save_interval: int = 0
    """Rollout steps between checkpoints (0: only at the end when save is set)."""
    exchange_every_n_steps: int = 0
    """Steps between the recipe's exchange syncs, e.g. reference refreshes (0: each sync's own every_n_steps)."""
    custom_module: tuple[str, ...] = ()
    """User modules (files or import names) imported to register algorithms; repeatable."""
    export_hf: str | None = None
    """Folder where the final policy is exported as a Hugging Face checkpoint."""
    skip_nonfinite_steps: int = 0
    """Steps with a NaN/inf loss, grad norm, reward or advantage skipped (no update) before the run stops."""
    dry_run: bool = False
    """Print the resolved recipe, role graph and placement, then exit."""
    max_restarts: int = 0
    """Times the run restarts from the newest complete checkpoint in --save when a role worker, a rank or the
    driver's Ray actors die (0: a death ends the run). Under torchrun, give torchrun the same --max-restarts."""
    dump_rollouts: str | None = None
    """Folder where every rollout step's training batch is written as it reached the trainer, one file per step
    (docs/rollout_dumps.md)."""
    replay_rollouts: str | None = None
    """Folder of a --dump-rollouts run to train from instead of rolling out: no engine, sandbox or reward; the
    losses and weights equal the dumped run's (docs/rollout_dumps.md)."""


@dataclass(frozen=True, kw_only=True)
class LoggingSection:
    out: str = "outputs/run"
    """Folder of metrics.jsonl, TensorBoard events, plots and rollouts."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    plots: bool = True
    """Write PNG plots of the metrics (plots/, one per family) when the run ends; --no-plots skips them (about a
    second of the driver's CPU per run)."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project (when wandb is installed)."""
    progress_bar: bool = True
    """Show a progress bar with step, reward, loss and ETA on the driver."""
    log_expert_load: str = "summary"
    """Mixture-of-experts runs: "summary" logs the max and mean load imbalance over layers (and dropped tokens,
    when any are dropped) each step and draws plots/expert_load.png, a layers x experts heat map of the token
    share over the run; "per-expert" also logs every layer's imbalance and every expert's token count as
    series (layers x experts keys a step)."""


def algorithm_field_tables(config_cls: type = AlgorithmConfig) -> tuple[dict[str, Any], dict[str, type]]:
    """({name: default}, {name: value type}) of the hyperparameters `config_cls` declares: the known
    `algorithm:` keys (YAML and flags) and how their values are checked, derived, never restated."""
    fields = hyperparameter_fields(config_cls)
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in fields}
    return defaults, {f.name: scalar_type(f) for f in fields}


ALGORITHM_FIELDS, ALGORITHM_FIELD_TYPES = algorithm_field_tables()
ALGORITHM_FIELDS: dict[str, Any]
"""Known algorithm hyperparameters and their defaults, derived from the `AlgorithmConfig` dataclass
(stacx.objectives.algorithm_config); any other key is a custom hyperparameter (a name within a typo
of a known one is refused, see `check_custom_algorithm_key`)."""

ALGORITHM_FIELD_TYPES: dict[str, type]
"""Value type of every known algorithm field (None stays allowed where the field is optional),
derived from the dataclass annotations."""

CUSTOM_KEY_SIMILARITY_CUTOFF = 0.85
"""A custom algorithm key at least this similar (difflib ratio) to a known one is taken for a typo."""


FLUX_STYLE_KEYS = ("adv_estimator",)
"""Keys only a Flux-style `algorithm:` section uses (Flux's name for `advantage_estimator`). In such a
section `name` is the policy loss, as in Flux (`name: ppo` is the PPO-clip loss, not the two-role
`ppo` recipe); see `stacx.trainer.config.resolve.policy_loss_named_by_algorithm`."""


def is_flux_style_section(keys) -> bool:
    """Whether an `algorithm:` section with these keys is Flux-style (it uses a FLUX_STYLE_KEYS key)."""
    return any(key in keys for key in FLUX_STYLE_KEYS)


def recipe_named_in_algorithm_section(name: Any, source: str) -> str:
    """The refusal of `algorithm.name` outside a Flux-style section: the recipe has one field, train.algorithm."""
    return (f"algorithm.name in {source}: the recipe is named in one place, train.algorithm; write "
            f"`train: {{algorithm: {name}}}` (flag --algorithm {name}) and drop algorithm.name")


CUSTOM_HYPERPARAMETERS_KEY = "custom_hyperparameters"
"""`algorithm.custom_hyperparameters: [kl_coef, ...]` declares custom keys that are near a known one
on purpose; they are exempt from the near-miss check."""


def _is_word_subsequence(key: str, known: str) -> bool:
    """`kl_coef` in `kl_loss_coef`: the key's words (>= 2) appear in order among the known key's."""
    words, remaining = key.split("_"), iter(known.split("_"))
    return len(words) >= 2 and key != known and all(word in remaining for word in words)


def check_custom_algorithm_key(key: str, source: str, declared=frozenset()) -> None:
    """Refuse a custom hyperparameter name that is a near-miss of a known one (`clip_ratio_hgh`,
    `kl_coef` for `kl_loss_coef`): the kernels would silently read the known field's default
    instead. Keys in `declared` (algorithm.custom_hyperparameters) are accepted as custom."""
    if key in ALGORITHM_FIELDS or key in declared or key == CUSTOM_HYPERPARAMETERS_KEY:
        return
    known = list(ALGORITHM_FIELDS)
    close = difflib.get_close_matches(key, known, n=1, cutoff=CUSTOM_KEY_SIMILARITY_CUTOFF)
    close = close or [k for k in known if _is_word_subsequence(key, k)][:1]
    if close:
        raise ConfigError(
            f"algorithm key '{key}' in {source} looks like a misspelling of the known hyperparameter '{close[0]}'; "
            f"fix the name, or, if '{key}' is a custom hyperparameter on purpose, declare it: "
            f"algorithm: {{{CUSTOM_HYPERPARAMETERS_KEY}: [{key}]}}"
        )


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "parallel": ParallelSection,
    "rollout": RolloutSection,
    "teacher": TeacherSection,
    "optim": OptimSection,
    "train": TrainSection,
    "logging": LoggingSection,
}


FIELD_MINIMUMS: dict[str, int | float] = {
    "tensor_model_parallel_size": 1, "context_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "data_parallel_size": 1,
    "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1, "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.0,
    "rollout_batch_size": 1, "n_samples_per_prompt": 1, "rollout_max_response_len": 1,
    "eval_interval": 0, "eval_n_samples": 1, "save_rollouts_per_step": 0, "teacher_top_k": 1,
    "teacher_retries": 0, "lr_warmup_steps": 0, "num_steps": 0, "max_tokens_per_micro_batch": 1,
    "save_interval": 0, "exchange_every_n_steps": 0,
    "global_batch_size": 1, "num_steps_per_rollout": 1, "num_epochs": 1, "skip_nonfinite_steps": 0, "reward_timeout_s": 0.001,
    "max_restarts": 0,
    "max_staleness": 0, "agent_max_parallel_episodes": 1, "agent_timeout": 0.001, "lr": 0.0, "min_lr": 0.0,
    "lora_rank": 0, "lora_alpha": 0.0,
}
"""Smallest allowed value of numeric run-config fields, checked when a value is given (file or flag)."""

FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "lm_head_log_probs": ("auto", "fused", "logits"),
    "rollout_mode": ("sync", "async"),
    "log_expert_load": ("summary", "per-expert"),
    "lora_sync": ("merged", "adapters"),
    "lora_init": ("random", "principal", "gradient", "gradient-sign"),  # stacx.models.lora.LORA_INITS
    "lora_critic": tuple(CRITIC_MODES),
    "vllm_weight_transfer": ("auto", "http", "shm", "nccl", "gloo"),  # stacx.rollout.engines.vllm.VLLM_WEIGHT_TRANSFERS
}
"""Allowed values of string run-config fields with a fixed set of choices, checked when a value is given."""


def _section_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """field name -> (section name, Field); field names are unique across sections."""
    found: dict[str, tuple[str, dataclasses.Field]] = {}
    for section_name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in found, f"field {f.name} appears in two sections"
            found[f.name] = (section_name, f)
    return found


FIELDS = _section_fields()


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    given_keys: frozenset[str] = field(default=frozenset(), compare=False)
    """Section field names the user set (config file, flags, STACX_* overrides), e.g. 'dagger_sampling_mode':
    "set" comes from this record, never from comparing a value with its default. The algorithm
    section keeps its own record (`algorithm.given_keys`)."""

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> "RunConfig":
        """Build from flat keys (`tensor_model_parallel_size: 2`) and/or nested sections.

        Dashes in keys are accepted (`tensor-model-parallel-size`). `source` names where the
        values came from in error messages (a YAML path, "command line", ...).
        """
        per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        algorithm: dict[str, Any] = {}
        for raw_key, value in (values or {}).items():
            key = str(raw_key).replace("-", "_")
            if key == "algorithm" and isinstance(value, dict):
                declared = value.get(CUSTOM_HYPERPARAMETERS_KEY) or ()
                if isinstance(declared, str) or not all(isinstance(name, str) for name in declared):
                    raise ConfigError(f"algorithm.{CUSTOM_HYPERPARAMETERS_KEY} in {source} must be a list of names, "
                                      f"got {declared!r}")
                declared = frozenset(str(name).replace("-", "_") for name in declared)
                if "name" in value and not is_flux_style_section(value):
                    raise ConfigError(recipe_named_in_algorithm_section(value["name"], source))
                for sub_key, sub_value in value.items():
                    sub_key = str(sub_key).replace("-", "_")
                    check_custom_algorithm_key(sub_key, source, declared)
                    algorithm[sub_key] = _coerce_algorithm(sub_key, sub_value, source)
            elif key in SECTIONS and isinstance(value, dict):
                for sub_key, sub_value in value.items():
                    sub_key = str(sub_key).replace("-", "_")
                    if sub_key not in FIELDS or FIELDS[sub_key][0] != key:
                        raise ConfigError(_unknown(f"{key}.{sub_key}", sub_key, source))
                    per_section[key][sub_key] = _coerce(FIELDS[sub_key][1], sub_value, source)
            elif key in FIELDS:
                section_name, f = FIELDS[key]
                per_section[section_name][key] = _coerce(f, value, source)
            elif key in ALGORITHM_FIELDS:
                algorithm[key] = _coerce_algorithm(key, value, source)
            else:
                raise ConfigError(_unknown(raw_key, key, source))
        sections = {name: SECTIONS[name](**kwargs) for name, kwargs in per_section.items()}
        try:
            algorithm_config = AlgorithmConfig.from_values(algorithm)
        except AlgorithmConfigError as err:
            raise ConfigError(f"{err} (in {source})") from None
        given_keys = frozenset(key for kwargs in per_section.values() for key in kwargs)
        return cls(**sections, algorithm=algorithm_config, given_keys=given_keys)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (what checkpoints store and `--dry-run` prints)."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["algorithm"] = self.algorithm.to_dict()
        return out

    def replace(self, **flat_values: Any) -> "RunConfig":
        """A copy with some fields changed: flat keys as in from_dict, `algorithm={...}` updates
        algorithm keys (the others are kept), `train.algorithm` (the recipe) stays unless given."""
        nested: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        # Only the keys the user set: the copy must not turn generic defaults into explicit settings.
        algorithm = self.algorithm.given_values()
        for key, value in flat_values.items():
            key = key.replace("-", "_")
            if key == "algorithm" and isinstance(value, (dict, AlgorithmConfig)):
                updates = value.given_values() if isinstance(value, AlgorithmConfig) else value
                algorithm.update({str(k).replace("-", "_"): v for k, v in updates.items()})
            elif key in FIELDS:
                nested[FIELDS[key][0]][key] = value
            elif key in ALGORITHM_FIELDS or key in SECTIONS:
                if key in SECTIONS:
                    nested[key].update(value)
                else:
                    algorithm[key] = value
            else:
                raise ConfigError(_unknown(key, key, "replace()"))
        nested["algorithm"] = algorithm
        changed = {key.replace("-", "_") for key in flat_values if key.replace("-", "_") in FIELDS}
        for key in flat_values:
            if key in SECTIONS:
                changed |= set(flat_values[key])
        rebuilt = RunConfig.from_dict(nested, source="replace()")
        # Every section key went through from_dict again: keep the record of what the user set.
        return dataclasses.replace(rebuilt, given_keys=self.given_keys | changed)


OUT_PLACEHOLDER = "{out}"
"""In any path setting (save, export_hf, ...), replaced by the run's --out folder (logging.out): a config file
that writes `save: "{out}/checkpoints"` saves beside the run's other outputs wherever --out points."""


def with_out_placeholders(run_config: RunConfig) -> RunConfig:
    """`run_config` with OUT_PLACEHOLDER replaced by logging.out in every string setting that holds it."""
    out = run_config.logging.out
    if OUT_PLACEHOLDER in out:
        raise ConfigError(f"logging.out (--out) {out!r} contains {OUT_PLACEHOLDER}, which stands for --out itself; "
                          "give the folder itself")
    sections = {}
    for section_field in dataclasses.fields(run_config):
        section = getattr(run_config, section_field.name)
        if not dataclasses.is_dataclass(section):
            continue
        changed = {f.name: getattr(section, f.name).replace(OUT_PLACEHOLDER, out) for f in dataclasses.fields(section)
                   if isinstance(getattr(section, f.name), str) and OUT_PLACEHOLDER in getattr(section, f.name)}
        if changed:
            sections[section_field.name] = dataclasses.replace(section, **changed)
    return dataclasses.replace(run_config, **sections) if sections else run_config


def _unknown(raw_key: str, key: str, source: str) -> str:
    known = list(FIELDS) + list(SECTIONS) + ["algorithm"]
    close = difflib.get_close_matches(key, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown key '{raw_key}' in {source}{hint}"


def _coerce_algorithm(key: str, value: Any, source: str) -> Any:
    """Known algorithm fields are checked against their `AlgorithmConfig` annotation like section
    fields (a list of names for a string field is joined with commas); custom keys keep their value."""
    f = _ALGORITHM_FIELD_OBJECTS.get(key)
    if f is None or value is None:
        return value
    if scalar_type(f) is str and isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return _coerce(f, value, source)


_ALGORITHM_FIELD_OBJECTS: dict[str, dataclasses.Field] = {f.name: f for f in hyperparameter_fields()}


def _coerce(f: dataclasses.Field, value: Any, source: str) -> Any:
    """Check and convert a value to the field's declared type, its choices (FIELD_CHOICES) and its minimum (FIELD_MINIMUMS);
    errors name the key and its flag."""
    converted = _coerce_type(f, value, source)
    if isinstance(converted, float) and not math.isfinite(converted):  # `--lr nan` would train NaN weights
        raise ConfigError(f"key '{f.name}' in {source} must be a finite number, got {converted!r}; "
                          f"set --{f.name.replace('_', '-')} to a number")
    choices = FIELD_CHOICES.get(f.name)
    if choices is not None and converted not in choices:
        raise ConfigError(f"key '{f.name}' in {source} must be one of {list(choices)}, got {converted!r}; "
                          f"set --{f.name.replace('_', '-')} to one of them")
    minimum = FIELD_MINIMUMS.get(f.name)
    if minimum is not None and converted is not None and converted < minimum:
        raise ConfigError(f"key '{f.name}' in {source} must be >= {minimum}, got {converted!r}; "
                          f"set --{f.name.replace('_', '-')} to {minimum} or more")
    return converted


def _coerce_type(f: dataclasses.Field, value: Any, source: str) -> Any:
    """Convert a value to the field's declared type; errors name the key."""
    hint = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing) | {"types": types})  # noqa: S307
    args = typing.get_args(hint)
    optional = type(None) in args
    if value is None:
        if optional:
            return None
        raise ConfigError(f"key '{f.name}' in {source} must not be null")
    base = next((a for a in args if a is not type(None)), hint) if args and optional else hint
    origin = typing.get_origin(base)
    try:
        if origin is tuple:
            items = [value] if isinstance(value, (str, int, float)) else list(value)
            return tuple(str(v) for v in items)
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            raise ValueError(value)
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if base is float:
            return float(value)
        if base is str:
            if isinstance(value, (dict, list, tuple, set)):
                raise ConfigError(
                    f"key '{f.name}' in {source} expects a string, got a {type(value).__name__} {value!r}; "
                    f"give one value (--{f.name.replace('_', '-')} VALUE), or quote it in YAML")
            return str(value)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
    else:
        return value
    raise ConfigError(f"key '{f.name}' in {source} expects {getattr(base, '__name__', base)}, got {value!r}")
