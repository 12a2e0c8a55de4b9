"""The one range check of settings (`stacx.ranges.require_in_range`) and the settings that use it: each refusal
names the flag or field, the allowed range and the value given."""

from __future__ import annotations

import math

import pytest

from stacx.models.lora import LoraSettings
from stacx.ranges import require_in_range
from stacx.rollout.sections import RolloutSection
from stacx.trainer.config.run import ConfigError, RunConfig
from stacx.wire.http_client import RetryPolicy


@pytest.mark.parametrize("bounds, value, message", [
    ({"at_least": 1}, 0, "--x must be >= 1, got 0"),
    ({"above": 0}, 0.0, "--x must be > 0, got 0.0"),
    ({"at_least": 0, "below": 1}, 1.0, r"--x must be in \[0, 1\), got 1.0"),
    ({"above": 0, "at_most": 2}, 3, r"--x must be in \(0, 2\], got 3"),
    ({"at_most": 0.5}, 0.75, "--x must be <= 0.5, got 0.75"),
    ({"above": 0}, math.nan, "--x must be > 0, got nan"),
])
def test_a_value_outside_its_range_is_refused_naming_the_setting_the_range_and_the_value(bounds, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        require_in_range("--x", value, **bounds)


def test_a_value_inside_its_range_passes_and_the_bounds_are_checked():
    require_in_range("--x", 0, at_least=0, below=1)
    require_in_range("--x", 1, above=0, at_most=1)
    with pytest.raises(TypeError, match="at most one lower bound"):
        require_in_range("--x", 1, at_least=0, above=0)
    with pytest.raises(TypeError, match="give a bound"):
        require_in_range("--x", 1)


def test_the_settings_refuse_out_of_range_values_naming_their_flags():
    with pytest.raises(ValueError, match=r"^--min-live-engines must be >= 1, got 0$"):
        RolloutSection(min_live_engines=0)
    with pytest.raises(ValueError, match=r"^--engine-health-interval-s must be > 0, got -1.0$"):
        RolloutSection(engine_health_interval_s=-1.0)
    with pytest.raises(ValueError, match=r"^timeout_s must be > 0, got 0$"):
        RetryPolicy(timeout_s=0)
    with pytest.raises(ValueError, match=r"^--lora-rank must be >= 1 to attach adapters, got 0$"):
        LoraSettings(rank=0, alpha=16.0)
    with pytest.raises(ValueError, match=r"^--lora-dropout must be in \[0, 1\), got 1.0$"):
        LoraSettings(rank=8, alpha=16.0, dropout=1.0)
    with pytest.raises(ConfigError, match=r"--lora-alpha must be > 0 with --lora-rank 8, got 0.0"):
        RunConfig.from_dict({"lora_rank": 8, "lora_alpha": 0.0})
    assert RunConfig.from_dict({"lora_rank": 0, "lora_alpha": 0.0}).model.lora_alpha == 0.0  # unused without LoRA
