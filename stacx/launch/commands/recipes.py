"""`stacx recipes`: list the recipe catalog, describe one recipe, or print the catalog as Markdown.

    stacx recipes                 one line per recipe: name, roles, description
    stacx recipes ppo             the recipe's roles, pools, syncs and algorithm defaults
    stacx recipes --markdown      the catalog page (docs/recipes.md is this output)
    stacx recipes --custom-module my_algo.py    include recipes registered by a user module
    stacx recipes --objectives    the registered estimators, losses, corrections and rewards
                                  (built-in, stacx/custom/ and --custom-module ones, marked custom)
"""

from __future__ import annotations

import re
import sys

HELP = ("list the recipe catalog (roles, syncs, algorithm defaults) or describe one recipe; --objectives lists "
        "the registered estimators, losses and rewards")

_MARKDOWN_HEADER = """# Recipe catalog

Every algorithm Stacx runs is a recipe: a frozen `TrainingConfig` in `stacx/trainer/recipes/`
naming the run's model roles and the syncs between them (see `docs/architecture.md`). Select one
with `--algorithm NAME`; without it, `--use-critic` selects `ppo` and otherwise
`--advantage-estimator` picks the recipe built around that estimator (default `grpo`).

This page is generated from the catalog: `stacx recipes --markdown > docs/recipes.md`
(a test fails when it is out of date). `stacx recipes NAME` prints the same facts for one recipe.

Terms: **data** is where samples come from (`rollout`: the inference engine generates from the
policy every step; `dataset`: a fixed SFT or preference set), plus `teacher` when a teacher
server scores or relabels rollouts and `reward` when a reward function scores them. A role's
**pool** is the set of devices it runs on; roles sharing a pool are colocated and time-share.
An **inject** sync adds per-token fields computed by one role to another role's batch; an
**exchange** sync moves tensors between two roles' workers over a collective group.
"""


def add_arguments(parser) -> None:
    parser.add_argument("name", nargs="?", help="a recipe to describe (default: list them all)")
    parser.add_argument("--markdown", action="store_true", help="print the whole catalog as Markdown")
    parser.add_argument("--objectives", action="store_true",
                        help="list the registered advantage estimators, policy losses, off-policy corrections, KL "
                             "estimators, other losses and rewards (custom ones marked, with their file and knobs)")
    parser.add_argument("--custom-module", action="append", default=[], metavar="FILE_OR_MODULE",
                        help="import a user module first so that its registrations show (repeatable)")


def _role_cell(config, role) -> str:
    traits = ["trainable" if role.trainable else "frozen"]
    if role.sync_to_rollout:
        traits.append("syncs to rollout")
    if role.outputs_values:
        traits.append("value head")
    pool = config.pool_of(role.name)
    traits.append(f"pool `{pool}`" + (" (shared)" if role.shares_pool_with else ""))
    traits.append(f"weights `--{role.checkpoint_arg.replace('_', '-')}`")
    if role.reference_checkpoint_arg:
        traits.append(f"in-worker reference `--{role.reference_checkpoint_arg.replace('_', '-')}`")
    return f"`{role.name}` ({role.specialization_cls.__name__}: {', '.join(traits)})"


def _algorithm_cell(algorithm) -> str:
    if algorithm is None:
        return "-"
    parts = [f"adv `{algorithm.advantage_estimator}`", f"loss `{algorithm.policy_loss}`",
             f"clip {algorithm.clip_ratio_low:g}/{algorithm.clip_ratio_high:g}", f"agg `{algorithm.loss_agg_mode}`"]
    if algorithm.use_kl_loss:
        parts.append(f"KL loss `{algorithm.kl_loss_type}` x {algorithm.kl_loss_coef:g}")
    if algorithm.use_kl_in_reward:
        parts.append(f"KL in reward x {algorithm.kl_in_reward_coef:g}")
    if not algorithm.norm_adv_by_std:
        parts.append("no std normalization")
    if algorithm.filter_zero_variance_groups:
        parts.append("drops zero-variance groups")
    if algorithm.overlong_buffer_length:
        parts.append(f"overlong buffer {algorithm.overlong_buffer_length}")
    elif algorithm.overlong_buffer_fraction:
        parts.append(f"overlong buffer {algorithm.overlong_buffer_fraction:g} x max response length")
    if algorithm.teacher_kl_coef:
        parts.append(f"teacher reverse-KL shaping x {algorithm.teacher_kl_coef:g}")
    if algorithm.advantage_estimator == "gae":
        parts.append(f"gamma {algorithm.gamma:g}, lambda {algorithm.lam:g}")
    return ", ".join(parts)


# A sentence ends at ". " unless the period closes a short capitalized abbreviation ("Dr. GRPO",
# "e.g. ", "vs. "): one or two letters, or a word from this list, right before the period.
_ABBREVIATIONS = ("e.g", "i.e", "vs", "etc", "cf", "approx", "resp")
_SENTENCE_END = re.compile(r"(?<=\.)\s+")


def first_sentence(description: str) -> str:
    """The description's first sentence without its final period, for the one-line listing.

    A period followed by white space ends the sentence unless the word before it is an
    abbreviation: one or two letters ("Dr.", "e.g.") or one of _ABBREVIATIONS. A description
    with no sentence end is returned whole.
    """
    text = " ".join(description.split())
    for match in _SENTENCE_END.finditer(text):
        word = text[:match.start() - 1].rsplit(" ", 1)[-1].lower()
        if len(word.replace(".", "")) > 2 and word not in _ABBREVIATIONS:
            return text[:match.start()].rstrip(".")
    return text.rstrip(".")


def render_catalog_markdown(configs: dict) -> str:
    """The catalog page: a summary table, then per recipe its description, roles, syncs and algorithm defaults."""
    lines = [_MARKDOWN_HEADER, "## Summary", "", "| recipe | data | roles | syncs |", "| --- | --- | --- | --- |"]
    for name in sorted(configs):
        config = configs[name]
        data = " + ".join([config.data_source] + (["teacher"] if config.uses_teacher else [])
                          + (["reward"] if config.uses_reward else []))
        syncs = "; ".join(f"{s.kind} {s.source_role} -> {s.target_role}" for s in config.syncs) or "none"
        label = f"[`{name}`](#{name})" + (f" (experimental, {config.modality})" if config.experimental else "")
        lines.append(f"| {label} | {data} | {', '.join(r.name for r in config.roles)} | {syncs} |")
    for name in sorted(configs):
        config = configs[name]
        lines += ["", f"## {name}", ""]
        if config.experimental:
            lines += [f"**Experimental** ({config.modality} recipe, see `docs/diffusion.md`).", ""]
        lines += [config.description, ""]
        if config.rollin_protocol:
            lines.append(f"- roll-in: `{config.rollin_protocol}`")
        for role in config.roles:
            lines.append(f"- role {_role_cell(config, role)}" + (f": {role.description}" if role.description else ""))
        if config.syncs:
            for sync in config.syncs:
                lines.append(f"- {sync.kind} sync: `{sync.source_role}` -> `{sync.target_role}`, keys "
                             + ", ".join(f"`{key}`" for key in sync.keys))
        else:
            lines.append("- syncs: none")
        if config.algorithm is not None and config.algorithm.advantage_estimator is not None:
            lines.append(f"- algorithm defaults: {_algorithm_cell(config.algorithm)}")  # (a recipe without RL has none)
    return "\n".join(lines) + "\n"


def _origin(fn) -> str:
    """'custom, FILE' for a user entry (stacx/custom/, --custom-module), '' for a built-in."""
    from stacx.plugins.registry import is_builtin_entry

    if is_builtin_entry(fn):
        return ""
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    return f"custom, {getattr(module, '__file__', None) or getattr(fn, '__module__', '?')}"


def render_objectives() -> str:
    """Every registered name, one section per registry: built-ins plain, custom ones with their
    file and the knobs they declare (`hyperparameters=`)."""
    from stacx.plugins.discovery import import_builtin_and_custom_modules
    from stacx.objectives.registry import (ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, LOSSES, OFF_POLICY_CORRECTIONS,
                                           POLICY_LOSSES)
    from stacx.rollout.rewards import REWARD_FUNCTIONS

    import_builtin_and_custom_modules()  # stacx/custom/ registrations count too
    sections = [("advantage estimators (--advantage-estimator)", ADVANTAGES),
                ("policy losses (--policy-loss)", POLICY_LOSSES),
                ("off-policy corrections (--off-policy-corrections)", OFF_POLICY_CORRECTIONS),
                ("KL estimators (--kl-loss-type)", KL_ESTIMATORS), ("other losses", LOSSES),
                ("loss aggregation modes (--loss-agg-mode)", AGGREGATIONS)]
    lines = []
    for title, registry in sections:
        lines.append(f"{title}:")
        for name in registry.names():
            notes = []
            if registry.entries_are_callable:
                notes.append(_origin(registry.get(name)))
                knobs = registry.traits(name).hyperparameters
                notes.append(f"knobs: {', '.join(knobs)}" if knobs else "")
            notes = [note for note in notes if note]
            lines.append(f"  {name}" + (f"  ({'; '.join(notes)})" if notes else ""))
    lines.append("rewards (--reward-fn):")
    for name in sorted(REWARD_FUNCTIONS):
        notes = [note for note in (_origin(REWARD_FUNCTIONS[name]),
                                   "needs a label" if getattr(REWARD_FUNCTIONS[name], "needs_label", False) else "")
                 if note]
        lines.append(f"  {name}" + (f"  ({'; '.join(notes)})" if notes else ""))
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from stacx.trainer.config.recipe import RecipeError
    from stacx.launch.workloads import discover_workloads
    from stacx.trainer.recipes import TRAINING_CONFIGS, get_recipe

    discover_workloads()  # the workloads' recipes (the experimental diffusion ones) join the catalog

    if args.custom_module:
        from stacx.plugins.discovery import load_custom_modules

        try:
            load_custom_modules(args.custom_module)
        except ValueError as err:
            print(f"stacx recipes: {err}", file=sys.stderr)
            return 2
    if args.objectives:
        print(render_objectives(), end="")
        return 0
    if args.markdown:
        print(render_catalog_markdown(TRAINING_CONFIGS), end="")
        return 0
    if args.name:
        try:
            print(get_recipe(args.name).describe())
        except RecipeError as err:
            print(f"stacx recipes: {err}", file=sys.stderr)
            return 2
        return 0
    width = max(len(name) for name in TRAINING_CONFIGS)
    for name in sorted(TRAINING_CONFIGS):
        config = TRAINING_CONFIGS[name]
        roles = ", ".join(role.name for role in config.roles)
        experimental = f"(experimental, {config.modality}) " if config.experimental else ""
        print(f"{name:<{width}}  [{roles}]  {experimental}{first_sentence(config.description)}")
    return 0
