"""Which recipe a run uses: `infer_algorithm(args)`.

Resolution, first match wins:
1. `--algorithm NAME` set explicitly: NAME verbatim (distillation, DAgger, SFT and DPO always use this).
2. `use_critic` set: `ppo`.
3. `--advantage-estimator NAME`: the recipe built around that estimator
   (e.g. `reinforce_plus_plus` -> `reinforce_pp`); without one, `grpo`. Any other registered
   estimator (a custom one, or a built-in without a recipe of its own such as `reward_centered`)
   runs in the generic actor recipe, `grpo`, whose algorithm settings it overrides; a custom
   `policy_loss` alone changes nothing here (it is a setting of the actor recipe).

The result always names a registered recipe; an unknown name lists the known ones.
"""

from __future__ import annotations

import difflib

from typing import Any, Mapping

from stacx.objectives.registry import list_advantages
from stacx.trainer.config.recipe import RecipeError, TRAINING_CONFIGS

#: Advantage estimator -> the recipe whose defaults are built around it.
ESTIMATOR_TO_RECIPE: dict[str, str] = {
    "grpo": "grpo",
    "dr_grpo": "dr_grpo",
    "rloo": "rloo",
    "reinforce_plus_plus": "reinforce_pp",
    "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
    "gae": "ppo",
}

DEFAULT_ADVANTAGE_ESTIMATOR = "grpo"
GENERIC_ACTOR_RECIPE = "grpo"
"""The recipe a registered estimator without a recipe of its own runs in (ActorSpecialization)."""


def _read(args: Any, name: str) -> Any:
    if isinstance(args, Mapping):
        return args.get(name)
    return getattr(args, name, None)


def infer_algorithm(args: Any) -> str:
    """The recipe name for a run, from an argparse namespace or a mapping with the optional keys
    `algorithm`, `use_critic` and `advantage_estimator`."""

    known = ", ".join(sorted(TRAINING_CONFIGS))
    algorithm = _read(args, "algorithm")
    if algorithm:
        if algorithm not in TRAINING_CONFIGS:
            raise RecipeError(f"--algorithm {algorithm!r} is not a known recipe; {did_you_mean(algorithm, TRAINING_CONFIGS)}"
                              f"known recipes: {known}")
        return algorithm
    if _read(args, "use_critic"):
        return "ppo"
    estimator = _read(args, "advantage_estimator") or DEFAULT_ADVANTAGE_ESTIMATOR
    if estimator in ESTIMATOR_TO_RECIPE:
        return ESTIMATOR_TO_RECIPE[estimator]
    if estimator in registered_advantage_estimators():
        # A custom (or recipe-less built-in) estimator runs in the generic actor recipe.
        return GENERIC_ACTOR_RECIPE
    raise RecipeError(
        f"--advantage-estimator {estimator!r} is not a registered advantage estimator; "
        f"{did_you_mean(estimator, registered_advantage_estimators())}registered: "
        f"{', '.join(sorted(registered_advantage_estimators()))} (register yours with @register_advantage and "
        "load its file with --custom-module, or place it in stacx/custom/)"
    )


def did_you_mean(name: str, known) -> str:
    """'did you mean 'x' or 'y'? ' for the known names close to a mistyped `name` (empty when none is)."""
    close = difflib.get_close_matches(str(name), sorted(known), n=3, cutoff=0.6)
    return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


def registered_advantage_estimators() -> set[str]:
    """Every advantage estimator name: built-in, in stacx/custom/, and from loaded user modules."""
    return set(list_advantages())


__all__ = ["DEFAULT_ADVANTAGE_ESTIMATOR", "ESTIMATOR_TO_RECIPE", "GENERIC_ACTOR_RECIPE", "infer_algorithm"]
