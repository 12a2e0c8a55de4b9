"""What a LoRA run does with its critic (`--lora-critic`): train it whole, give it adapters of its own, or freeze it.

    recipe = with_critic_as_configured(get_recipe("ppo"), run_config.model)   # resolve_recipe does this

A critic is a role with a value head (PPO's `critic`). `--lora-rank` puts adapters on the language-model roles;
`--lora-critic` says what the critic does meanwhile:

| mode       | the critic's decoder                      | its value head | optimizer state          |
| ---------- | ----------------------------------------- | -------------- | ------------------------ |
| `full`     | trained whole (as without LoRA)           | trained        | every parameter          |
| `adapters` | frozen, with adapters of its own (the run's --lora-rank, --lora-alpha, ...) | trained | adapters + head |
| `frozen`   | frozen (a frozen role: no optimizer, it only computes values) | frozen | none  |

The value head of `adapters` trains with the adapters, as PEFT's `modules_to_save` does for a new head: it starts
at zero, and a zero head passes no gradient to the adapters below it. `frozen` turns the critic into a frozen role
of the recipe, so the loop never trains it and it keeps its start weights (`--critic-load`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class CriticMode:
    """One `--lora-critic` choice."""

    trainable: bool
    """Whether the critic role trains (False: a frozen role, no optimizer)."""
    adapters: bool
    """Whether the critic's decoder gets LoRA adapters (its base weights then frozen, its value head trained)."""
    description: str
    """One line for the error that lists the choices."""


CRITIC_MODES: dict[str, CriticMode] = {
    "full": CriticMode(trainable=True, adapters=False, description="the critic is trained whole"),
    "adapters": CriticMode(trainable=True, adapters=True,
                           description="the critic's base weights are frozen; its own adapters and its value head train"),
    "frozen": CriticMode(trainable=False, adapters=False,
                         description="the critic keeps its --critic-load weights and only computes values"),
}
"""--lora-critic choices, by name."""

DEFAULT_CRITIC_MODE = "full"


class CriticModeError(ValueError):
    """--lora-critic is set where it cannot apply; the message names the flag and the fix."""


def critic_mode(name: str) -> CriticMode:
    """The CriticMode called `name`; CriticModeError naming --lora-critic and its choices otherwise."""
    try:
        return CRITIC_MODES[name]
    except KeyError:
        choices = "; ".join(f"{key}: {mode.description}" for key, mode in CRITIC_MODES.items())
        raise CriticModeError(f"--lora-critic {name!r}: choose one of {list(CRITIC_MODES)} ({choices})") from None


def check_critic_mode(name: str, lora_rank: int) -> None:
    """CriticModeError for an unknown mode, or a mode other than `full` without --lora-rank."""
    critic_mode(name)
    if name != DEFAULT_CRITIC_MODE and lora_rank <= 0:
        raise CriticModeError(f"--lora-critic {name} needs --lora-rank > 0: without LoRA every role, the critic "
                              f"included, is trained whole (set --lora-rank or drop --lora-critic)")


def with_critic_as_configured(training_config, model_section):
    """`training_config` with its critic as `model_section.lora_critic` says (`frozen`: the critic role becomes
    frozen); CriticModeError when a mode other than `full` is set for a recipe without a critic."""
    name = model_section.lora_critic
    mode = critic_mode(name)
    if name == DEFAULT_CRITIC_MODE:
        return training_config
    critics = [role.name for role in training_config.roles if role.outputs_values]
    if not critics:
        raise CriticModeError(f"--lora-critic {name}: recipe {training_config.name!r} has no critic (a role with a "
                              "value head, as ppo's); drop --lora-critic")
    if mode.trainable:
        return training_config
    roles = tuple(dataclasses.replace(role, trainable=False) if role.outputs_values else role
                  for role in training_config.roles)
    return dataclasses.replace(training_config, roles=roles)


__all__ = [
    "CRITIC_MODES",
    "CriticMode",
    "CriticModeError",
    "DEFAULT_CRITIC_MODE",
    "check_critic_mode",
    "critic_mode",
    "with_critic_as_configured",
]
