"""The recipe model: frozen, validated descriptions of a run's model roles and the syncs between them.

A recipe is a `TrainingConfig`:

    TrainingConfig(name="ppo", roles=(ModelRole(name="actor", ...), ModelRole(name="critic", ...)),
                   syncs=(InjectSync(source_role="critic", target_role="actor", keys=("values",)),),
                   description="...", algorithm=recipe_algorithm(...))

- `ModelRole`: one model with a job (policy, critic, ...), its specialization class, whether it
  trains, whether its weights are pushed to the inference engine, the resource pool it owns or
  shares, its parallel layout and where its weights come from.
- `InjectSync`: a role computes per-token fields (reference log-probs, critic values) that are
  injected into another role's batch before that role trains.
- `ExchangeSync`: tensors (e.g. weights) move between two roles' workers over a collective group
  (NCCL on GPU, gloo on CPU).
- `recipe_algorithm(**overrides)`: the recipe's RL knobs (advantage estimator, policy loss, clip
  ratios, aggregation, KL) as overrides of the one `AlgorithmConfig` dataclass
  (stacx.objectives.algorithm_config), so that GRPO, Dr. GRPO, GSPO, DAPO, ... differ by values.

Everything is checked in `__post_init__`; a mistake raises `RecipeError` naming the field. The
`@recipe` decorator (stacx.trainer.recipes) adds the recipe name, so a malformed recipe fails at
import with both.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from stacx.objectives import registry
from stacx.objectives.algorithm_config import (
    AlgorithmConfig,
    AlgorithmConfigError,
    as_algorithm_config,
    hyperparameter_fields,
)
from stacx.plugins.registry import Registry
from stacx.trainer.config.workload import TEXT_MODALITY, WORKLOADS, known_modalities
from stacx.specializations.base import Specialization

#: Run-config fields (model section) a role may load its weights from; the flag is the name with dashes.
CHECKPOINT_ARGS = ("hf_checkpoint", "ref_load", "critic_load")
#: Where a run's training samples come from.
DATA_SOURCES = ("rollout", "dataset")
#: How a rollout is produced when the teacher takes part (None: the student alone).
ROLLIN_PROTOCOLS = ("teacher_relabel", "beta_mixture", "aggrevate")

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RecipeError(ValueError):
    """A recipe (or the name of a recipe or algorithm) is malformed; the message names the field."""


def _fail(where: str, message: str) -> None:
    raise RecipeError(f"{where}: {message}")


def _check_identifier(where: str, value: Any) -> None:
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        _fail(where, f"must be a non-empty identifier (letters, digits, _), got {value!r}")


def _check_choice(where: str, value: Any, known: tuple[str, ...]) -> None:
    if value not in known:
        _fail(where, f"unknown name {value!r}; known: {', '.join(known)}")


def _registered(kernels: registry.Registry) -> tuple[str, ...]:
    """The names `kernels` holds now: the built-ins (registered when `stacx.objectives` is imported) and
    any user kernel loaded before the recipe that names it (the registries are the one list of names)."""
    return tuple(kernels.names())


def _check_positive_int(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(where, f"must be an integer >= 1, got {value!r}")


def _check_keys(where: str, keys: Any) -> None:
    if isinstance(keys, str) or not isinstance(keys, tuple):
        _fail(where, f"must be a tuple of field names (e.g. ('values',)), got {keys!r}")
    if not keys:
        _fail(where, "must name at least one field")
    for index, key in enumerate(keys):
        _check_identifier(f"{where}[{index}]", key)
    if len(set(keys)) != len(keys):
        _fail(where, f"names a field twice: {keys!r}")


def recipe_algorithm(**overrides: Any) -> AlgorithmConfig:
    """A recipe's algorithm settings: the `AlgorithmConfig` defaults with `overrides` laid over them,
    validated now (at `@recipe` time). A misspelled field, a mistyped value or an unknown kernel name
    raises `RecipeError` naming `algorithm.<field>` (and the closest known field for a typo)."""
    known = [f.name for f in hyperparameter_fields()]
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"
            _fail(f"algorithm.{key}", f"is not an algorithm hyperparameter{hint}")
    if overrides.get("advantage_estimator") is None:
        _fail("algorithm.advantage_estimator", "a recipe with algorithm settings must name its advantage estimator")
    try:
        config = AlgorithmConfig(**overrides)
    except AlgorithmConfigError as err:
        raise RecipeError(str(err)) from None
    _check_choice("algorithm.advantage_estimator", config.advantage_estimator, _registered(registry.ADVANTAGES))
    _check_choice("algorithm.policy_loss", config.policy_loss, _registered(registry.POLICY_LOSSES))
    _check_choice("algorithm.loss_agg_mode", config.loss_agg_mode, _registered(registry.AGGREGATIONS))
    _check_choice("algorithm.kl_loss_type", config.kl_loss_type, _registered(registry.KL_ESTIMATORS))
    return config


AlgorithmDefaults = recipe_algorithm
"""The former name of `recipe_algorithm` (recipes written before the single AlgorithmConfig)."""


@dataclass(frozen=True, kw_only=True)
class ModelRole:
    """One model with a job in the run (policy, critic, ...), run by its own group of workers."""

    name: str
    """Role name, unique in the recipe (an identifier: it names Ray actors, log keys and checkpoint folders)."""
    specialization_cls: type[Specialization]
    """The per-algorithm loss assembly the role's workers call on every micro-batch: a Specialization subclass
    in a text recipe, a subclass of the workload's `objective_base` in a recipe of another modality."""
    trainable: bool = True
    """Whether the role's weights are updated (a frozen role only computes fields for other roles)."""
    sync_to_rollout: bool = False
    """Push this role's weights to the inference engine after every optimizer step (at most one role)."""
    pool: str | None = None
    """Name of the resource pool this role owns; None means a pool named after the role. Exclusive with shares_pool_with."""
    shares_pool_with: str | None = None
    """Another role whose pool (devices) this role shares: the two are colocated and time-share."""
    tensor_model_parallel_size: int = 1
    """Default tensor-parallel degree (run flags may override it)."""
    context_parallel_size: int = 1
    """Default context-parallel degree (run flags may override it)."""
    checkpoint_arg: str = "hf_checkpoint"
    """Run argument holding the checkpoint the role's weights start from (hf_checkpoint, ref_load, critic_load)."""
    reference_checkpoint_arg: str | None = None
    """Run argument holding a frozen reference checkpoint kept inside this role's workers and swapped in to compute
    reference log-probs (no separate worker); the reference is used only when the run sets this argument."""
    description: str = ""
    """One line on the role's job, shown by `stacx recipes`."""

    @property
    def outputs_values(self) -> bool:
        """Whether the role's model has a value head (critic) instead of a language-model head."""
        return bool(getattr(self.specialization_cls, "outputs_values", False))

    @property
    def own_pool_name(self) -> str | None:
        """The pool this role owns, or None when it shares another role's pool."""
        if self.shares_pool_with is not None:
            return None
        return self.pool or self.name

    def __post_init__(self) -> None:
        _check_identifier("role.name", self.name)
        where = f"roles[{self.name}]"
        if not isinstance(self.specialization_cls, type):
            _fail(f"{where}.specialization_cls", f"must be a class, got {self.specialization_cls!r}")
        for flag in ("trainable", "sync_to_rollout"):
            if not isinstance(getattr(self, flag), bool):
                _fail(f"{where}.{flag}", f"must be True or False, got {getattr(self, flag)!r}")
        if self.sync_to_rollout and not self.trainable:
            _fail(f"{where}.sync_to_rollout", "a frozen role has no new weights to push to the inference engine")
        if self.pool is not None and self.shares_pool_with is not None:
            _fail(f"{where}.pool", "set either pool (own a pool) or shares_pool_with (share one), not both")
        if self.pool is not None:
            _check_identifier(f"{where}.pool", self.pool)
        if self.shares_pool_with is not None:
            _check_identifier(f"{where}.shares_pool_with", self.shares_pool_with)
            if self.shares_pool_with == self.name:
                _fail(f"{where}.shares_pool_with", "a role cannot share its own pool")
        _check_positive_int(f"{where}.tensor_model_parallel_size", self.tensor_model_parallel_size)
        _check_positive_int(f"{where}.context_parallel_size", self.context_parallel_size)
        _check_choice(f"{where}.checkpoint_arg", self.checkpoint_arg, CHECKPOINT_ARGS)
        if self.reference_checkpoint_arg is not None:
            _check_choice(f"{where}.reference_checkpoint_arg", self.reference_checkpoint_arg, CHECKPOINT_ARGS)
            if self.reference_checkpoint_arg == self.checkpoint_arg:
                _fail(f"{where}.reference_checkpoint_arg",
                      f"must differ from checkpoint_arg ({self.checkpoint_arg!r}) so the reference can stay frozen")
        if not isinstance(self.description, str):
            _fail(f"{where}.description", f"must be a string, got {self.description!r}")


@dataclass(frozen=True, kw_only=True)
class InjectSync:
    """Per-token fields computed by `source_role` (a forward pass, no training) and injected into
    `target_role`'s batch before it trains, e.g. critic values into the actor's batch for GAE."""

    source_role: str
    """Role whose workers compute the fields."""
    target_role: str
    """Role whose batch receives them."""
    keys: tuple[str, ...]
    """Batch field names delivered, e.g. ('values',) or ('ref_log_probs',)."""

    kind = "inject"


@dataclass(frozen=True, kw_only=True)
class ExchangeSync:
    """Tensors (e.g. weights) sent from `source_role`'s workers to `target_role`'s workers over a collective
    group (NCCL on GPU, gloo on CPU), bitwise identical on arrival."""

    source_role: str
    """Role whose workers send."""
    target_role: str
    """Role whose workers receive."""
    keys: tuple[str, ...]
    """What moves: 'weights' (all parameters) or named tensors the two specializations agree on."""
    every_n_steps: int = 1
    """Run the exchange after every n-th optimizer step."""
    bucket_size_mb: int = 512
    """Tensors are flattened into buckets of about this size, one collective per bucket."""

    kind = "exchange"

    @property
    def name(self) -> str:
        """The sync's name: its exchange group's, and the prefix of its metrics."""
        return f"{self.source_role}_to_{self.target_role}"

    def __post_init__(self) -> None:
        _check_positive_int("syncs.every_n_steps", self.every_n_steps)
        _check_positive_int("syncs.bucket_size_mb", self.bucket_size_mb)


Sync = InjectSync | ExchangeSync


@dataclass(frozen=True)
class RoleGraph:
    """The resolved structure of a recipe: what the factory builds and `--dry-run` prints."""

    recipe: str
    roles: tuple[ModelRole, ...]
    pools: dict[str, tuple[str, ...]]
    """Resource pool name -> roles colocated on it (the owner first)."""
    inject_order: tuple[str, ...]
    """Roles in an order where every inject sync's source comes before its target."""
    inject_syncs: tuple[InjectSync, ...]
    exchange_syncs: tuple[ExchangeSync, ...]


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """A recipe: the roles of a run and the syncs between them, validated on construction."""

    name: str
    """Recipe name, the value of --algorithm (an identifier)."""
    roles: tuple[ModelRole, ...]
    """The run's model roles (at least one)."""
    syncs: tuple[Sync, ...] = ()
    """Cross-role data movement; () for single-role recipes (an external teacher server needs no sync)."""
    description: str
    """One or two sentences on what the recipe trains and how."""
    algorithm: AlgorithmConfig | None = None
    """RL knobs for recipes that compute advantages (`recipe_algorithm(...)`: the declared defaults with the
    recipe's overrides); None for SFT, distillation and DPO."""
    data_source: str = "rollout"
    """'rollout': the inference engine generates from the policy every step; 'dataset': a fixed SFT/preference set."""
    uses_teacher: bool = False
    """Whether rollouts are scored (or relabeled) by an external teacher server returning per-token log-probs."""
    uses_reward: bool = False
    """Whether a reward function scores each rollout (RL recipes)."""
    rollin_protocol: str | None = None
    """How the teacher shares rollouts with the student: teacher_relabel (DAgger), beta_mixture, aggrevate; None: student only."""
    modality: str = TEXT_MODALITY
    """What the policy generates: 'text' (an LLM recipe, run by the core) or the modality of a registered
    workload ('image': the diffusion recipes; `stacx.trainer.config.workload`)."""
    experimental: bool = False
    """Marked experimental by `stacx recipes` and docs/recipes.md (the diffusion recipes)."""

    def __post_init__(self) -> None:
        _check_identifier("name", self.name)
        fail = lambda where, message: _fail(f"recipe {self.name!r}: field {where!r}", message)  # noqa: E731
        if not isinstance(self.description, str) or not self.description.strip():
            fail("description", "must be a non-empty string")
        if not isinstance(self.roles, tuple) or not self.roles:
            fail("roles", f"must be a non-empty tuple of ModelRole, got {self.roles!r}")
        for index, role in enumerate(self.roles):
            if not isinstance(role, ModelRole):
                fail(f"roles[{index}]", f"must be a ModelRole, got {type(role).__name__}")
        names = [role.name for role in self.roles]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            fail("roles", f"role names must be unique; repeated: {', '.join(duplicates)}")
        rollout_roles = [role.name for role in self.roles if role.sync_to_rollout]
        if len(rollout_roles) > 1:
            fail("roles.sync_to_rollout", f"at most one role may push weights to the inference engine, got {rollout_roles}")
        if self.data_source == "rollout" and not rollout_roles:
            # Without a role syncing to rollout the engine would keep generating from the initial weights.
            fail("roles.sync_to_rollout", "a rollout recipe needs one role with sync_to_rollout=True")
        if not any(role.trainable for role in self.roles):
            fail("roles.trainable", "at least one role must be trainable")
        self._check_pools(fail)
        self._check_syncs(fail)
        if self.algorithm is not None and not isinstance(self.algorithm, AlgorithmConfig):
            fail("algorithm", f"must be an AlgorithmConfig (recipe_algorithm(...)) or None, got {type(self.algorithm).__name__}")
        if self.algorithm is not None and self.algorithm.advantage_estimator == "gae" and not any(
            role.outputs_values for role in self.roles
        ):
            fail("algorithm.advantage_estimator", "'gae' needs a critic role (a specialization with outputs_values)")
        if self.data_source not in DATA_SOURCES:
            fail("data_source", f"unknown name {self.data_source!r}; known: {', '.join(DATA_SOURCES)}")
        for flag in ("uses_teacher", "uses_reward"):
            if not isinstance(getattr(self, flag), bool):
                fail(flag, f"must be True or False, got {getattr(self, flag)!r}")
        if self.rollin_protocol is not None:
            if self.rollin_protocol not in ROLLIN_PROTOCOLS:
                fail("rollin_protocol", f"unknown name {self.rollin_protocol!r}; known: {', '.join(ROLLIN_PROTOCOLS)}")
            if not self.uses_teacher:
                fail("rollin_protocol", f"{self.rollin_protocol!r} needs uses_teacher=True")
        if self.uses_reward and self.data_source != "rollout":
            fail("uses_reward", "rewards score rollouts; a 'dataset' recipe has none")
        if self.modality not in known_modalities():
            fail("modality", f"unknown name {self.modality!r}; known: {', '.join(known_modalities())} (a modality "
                             "other than 'text' needs its workload registered first: register_workload)")
        loss_base = WORKLOADS[self.modality].objective_base  # no discovery: recipes are built while modules import
        for role in self.roles:
            if not issubclass(role.specialization_cls, loss_base):
                fail(f"roles[{role.name}].specialization_cls",
                     f"must be a subclass of {loss_base.__module__}.{loss_base.__qualname__} (the loss base of "
                     f"{self.modality!r} recipes), got {role.specialization_cls!r}")

    def _check_pools(self, fail) -> None:
        by_name = {role.name: role for role in self.roles}
        owned = {}
        for role in self.roles:
            if role.shares_pool_with is not None and role.shares_pool_with not in by_name:
                fail(f"roles[{role.name}].shares_pool_with",
                     f"names no role of this recipe: {role.shares_pool_with!r}; roles: {', '.join(by_name)}")
            if role.own_pool_name is not None:
                if role.own_pool_name in owned:
                    fail(f"roles[{role.name}].pool",
                         f"pool {role.own_pool_name!r} is already owned by role {owned[role.own_pool_name]!r}; "
                         f"use shares_pool_with={owned[role.own_pool_name]!r} to colocate")
                owned[role.own_pool_name] = role.name
        for role in self.roles:
            seen = [role.name]
            current = role
            while current.shares_pool_with is not None:
                current = by_name[current.shares_pool_with]
                if current.name in seen:
                    fail(f"roles[{role.name}].shares_pool_with",
                         f"pool sharing forms a cycle: {' -> '.join(seen + [current.name])}")
                seen.append(current.name)

    def _check_syncs(self, fail) -> None:
        if not isinstance(self.syncs, tuple):
            fail("syncs", f"must be a tuple (use () for none), got {self.syncs!r}")
        names = {role.name for role in self.roles}
        injected: dict[tuple[str, str], str] = {}
        for index, sync in enumerate(self.syncs):
            where = f"syncs[{index}]"
            if not isinstance(sync, (InjectSync, ExchangeSync)):
                fail(where, f"must be an InjectSync or ExchangeSync, got {type(sync).__name__}")
            for end in ("source_role", "target_role"):
                if getattr(sync, end) not in names:
                    fail(f"{where}.{end}", f"names no role of this recipe: {getattr(sync, end)!r}; roles: {', '.join(sorted(names))}")
            if sync.source_role == sync.target_role:
                fail(where, f"source_role and target_role are both {sync.source_role!r}")
            try:
                _check_keys("keys", sync.keys)
            except RecipeError as err:
                fail(f"{where}.keys", str(err).split(": ", 1)[1])
            if isinstance(sync, InjectSync):
                for key in sync.keys:
                    previous = injected.get((sync.target_role, key))
                    if previous is not None:
                        fail(f"{where}.keys", f"field {key!r} is already injected into {sync.target_role!r} by {previous!r}")
                    injected[(sync.target_role, key)] = sync.source_role
        try:
            self._inject_order()
        except _CycleError as err:
            fail("syncs", f"inject syncs form a cycle ({err}); a role cannot wait on fields that depend on itself")

    # ---- structure -------------------------------------------------------------------------

    def role(self, name: str) -> ModelRole:
        """The role called `name`; RecipeError listing the roles otherwise."""
        for role in self.roles:
            if role.name == name:
                return role
        raise RecipeError(f"recipe {self.name!r} has no role {name!r}; roles: {', '.join(r.name for r in self.roles)}")

    @property
    def trainable_roles(self) -> tuple[ModelRole, ...]:
        return tuple(role for role in self.roles if role.trainable)

    @property
    def rollout_role(self) -> ModelRole | None:
        """The role whose weights the inference engine serves, if any."""
        return next((role for role in self.roles if role.sync_to_rollout), None)

    def pool_of(self, role_name: str) -> str:
        """The resource pool a role runs on, following shares_pool_with to the owner."""
        role = self.role(role_name)
        while role.shares_pool_with is not None:
            role = self.role(role.shares_pool_with)
        return role.own_pool_name

    def _inject_order(self) -> tuple[str, ...]:
        edges = {role.name: set() for role in self.roles}  # target -> sources it waits on
        for sync in self.syncs:
            if isinstance(sync, InjectSync):
                edges[sync.target_role].add(sync.source_role)
        order: list[str] = []
        state: dict[str, str] = {}

        def visit(name: str, path: list[str]) -> None:
            if state.get(name) == "done":
                return
            if state.get(name) == "active":
                raise _CycleError(" -> ".join(path[path.index(name):] + [name]))
            state[name] = "active"
            for source in sorted(edges[name]):
                visit(source, path + [name])
            state[name] = "done"
            order.append(name)

        for role in self.roles:
            visit(role.name, [])
        return tuple(order)

    def role_graph(self) -> RoleGraph:
        """Pools with their colocated roles, the inject order and the syncs by kind."""
        pools: dict[str, list[str]] = {}
        for role in self.roles:
            if role.own_pool_name is not None:
                pools.setdefault(role.own_pool_name, []).insert(0, role.name)
        for role in self.roles:
            if role.shares_pool_with is not None:
                pools[self.pool_of(role.name)].append(role.name)
        return RoleGraph(
            recipe=self.name,
            roles=self.roles,
            pools={pool: tuple(members) for pool, members in pools.items()},
            inject_order=self._inject_order(),
            inject_syncs=tuple(s for s in self.syncs if isinstance(s, InjectSync)),
            exchange_syncs=tuple(s for s in self.syncs if isinstance(s, ExchangeSync)),
        )

    def describe(self) -> str:
        """A human-readable summary (what `stacx recipes NAME` and `--dry-run` print)."""
        lines = [f"recipe {self.name}{' (experimental, ' + self.modality + ')' if self.experimental else ''}: "
                 f"{self.description}",
                 f"  data: {self.data_source}" + (" + teacher" if self.uses_teacher else "")
                 + (" + reward" if self.uses_reward else "")
                 + (f", roll-in {self.rollin_protocol}" if self.rollin_protocol else "")]
        lines.append("  roles:")
        for role in self.roles:
            traits = ["trainable" if role.trainable else "frozen"]
            if role.sync_to_rollout:
                traits.append("syncs to rollout")
            if role.outputs_values:
                traits.append("value head")
            traits.append(f"pool {self.pool_of(role.name)}" + (" (shared)" if role.shares_pool_with else ""))
            traits.append(f"tp={role.tensor_model_parallel_size} cp={role.context_parallel_size}")
            traits.append(f"weights from --{role.checkpoint_arg.replace('_', '-')}")
            if role.reference_checkpoint_arg:
                traits.append(f"in-worker reference from --{role.reference_checkpoint_arg.replace('_', '-')}")
            lines.append(f"    {role.name} [{role.specialization_cls.__name__}]: {', '.join(traits)}")
        lines.append("  syncs:" + ("" if self.syncs else " none"))
        for sync in self.syncs:
            lines.append(f"    {sync.kind}: {sync.source_role} -> {sync.target_role} ({', '.join(sync.keys)})")
        if self.algorithm is not None and self.modality == TEXT_MODALITY:  # a workload's driver describes its own
            lines.append(algorithm_line(self.algorithm, self.roles))
        return "\n".join(lines)


ALGORITHM_LINE_PREFIX = "  algorithm:"


def algorithm_line(algorithm: AlgorithmConfig, roles: Sequence[ModelRole]) -> str:
    """The algorithm settings the recipe's losses use: the policy loss and its clip bounds only when a
    trainable role's specialization runs the registered policy loss; otherwise the class whose
    `per_token_terms` is the loss (a custom specialization)."""
    a = algorithm
    trainable = [role.specialization_cls for role in roles if role.trainable]
    runs_policy_loss = any(cls.policy_loss_in_use() for cls in trainable)
    uses_advantages = any(cls.reads_advantages() for cls in trainable)
    parts = [f"advantages {a.advantage_estimator}"] if uses_advantages or runs_policy_loss else []
    if runs_policy_loss:
        parts.append(f"loss {a.policy_loss} (clip {a.clip_ratio_low}/{a.clip_ratio_high})")
        parts.append(f"aggregation {a.loss_agg_mode}")
        kl = f"KL loss {a.kl_loss_type} x {a.kl_loss_coef}" if a.use_kl_loss else "no KL loss"
        if a.use_kl_in_reward:
            kl += f", KL in reward {a.kl_in_reward_type} x {a.kl_in_reward_coef}"
        parts.append(kl)
    else:
        owners = ", ".join(sorted({cls.__name__ for cls in trainable}))
        parts.append(f"loss {owners}.per_token_terms (no registered policy loss)")
        parts.append(f"aggregation {a.loss_agg_mode}")
    return f"{ALGORITHM_LINE_PREFIX} {', '.join(parts)}"


class _CycleError(Exception):
    pass


__all__ = [
    "AlgorithmDefaults",
    "recipe_algorithm",
    "CHECKPOINT_ARGS",
    "ExchangeSync",
    "InjectSync",
    "ModelRole",
    "RecipeError",
    "RoleGraph",
    "Sync",
    "TrainingConfig",
]


def role_checkpoint_path(role: ModelRole, model_section: Any, arg: str | None = None) -> str | None:
    """The checkpoint folder the run config names for `arg` (default: the role's checkpoint_arg).

    critic_load falls back to hf_checkpoint (a critic starts from the policy's weights).
    """
    arg = arg or role.checkpoint_arg
    path = getattr(model_section, arg, None)
    if path is None and arg == "critic_load":
        path = model_section.hf_checkpoint
    return path


def role_wants_reference(role, training_config, algorithm) -> bool:
    """True when a trainable role computes reference log-probs in its own workers: its specialization
    needs them, or a KL term to the reference is on and the role holds an in-worker reference. A frozen
    role has no loss, and a separate reference role that injects `ref_log_probs` makes them unneeded."""
    if not role.trainable or any(s.target_role == role.name and "ref_log_probs" in s.keys
                                 for s in training_config.role_graph().inject_syncs):
        return False
    algorithm = as_algorithm_config(algorithm, "role_wants_reference(algorithm)")
    kl = algorithm.use_kl_loss or algorithm.use_kl_in_reward
    return role.specialization_cls(algorithm, None).needs_reference() or (kl and role.reference_checkpoint_arg is not None)


# ---- the registry: recipes by name (the built-in catalog is stacx.trainer.recipes) -------------

TRAINING_CONFIGS: Registry[TrainingConfig] = Registry("recipe", entries_are_callable=False, known_as="known recipes",
                                                     error=RecipeError)
"""Recipe name -> its validated TrainingConfig, filled by @recipe at import (a `stacx.plugins.registry.Registry`:
a name registered twice is refused)."""


def recipe(name: str) -> Callable[[Callable[[], TrainingConfig]], Callable[[], TrainingConfig]]:
    """Decorator: build the recipe now, validate it and register it under `name` (duplicates are rejected)."""
    try:
        _check_identifier("name", name)
    except RecipeError as err:
        raise RecipeError(f"@recipe({name!r}): {err}") from None

    def decorator(build: Callable[[], TrainingConfig]) -> Callable[[], TrainingConfig]:
        try:
            config = build()
        except RecipeError as err:
            message = str(err)
            raise RecipeError(message if message.startswith(f"recipe {name!r}") else f"recipe {name!r}: {message}") from None
        except TypeError as err:  # a missing or misspelled dataclass field
            raise RecipeError(f"recipe {name!r}: {err}") from None
        if not isinstance(config, TrainingConfig):
            raise RecipeError(f"recipe {name!r}: {build.__name__}() must return a TrainingConfig, got {type(config).__name__}")
        if config.name != name:
            raise RecipeError(f"recipe {name!r}: field 'name' is {config.name!r}; it must match @recipe({name!r})")
        TRAINING_CONFIGS.add(name, config, origin=build)  # a user recipe's module reaches the Ray workers too
        return build

    return decorator


def get_recipe(name: str) -> TrainingConfig:
    """The registered recipe called `name`; RecipeError listing the known recipes otherwise."""
    return TRAINING_CONFIGS.get(name)
