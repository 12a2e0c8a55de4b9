"""The metrics logger names a step's NaN/inf metrics and keeps metrics.jsonl strict JSON."""

import json
import math

from stacx.trainer.metrics import NONFINITE_METRICS_KEY, MetricsLogger


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_nonfinite_metrics_are_named_and_written_as_strict_json(tmp_path):
    with MetricsLogger(tmp_path, total_steps=2, tensorboard=False, progress_bar=False, plots=False) as logger:
        logger.log(0, {"policy/loss": 1.0, "rollout/reward_mean": 0.5})
        logger.log(1, {"policy/loss": float("nan"), "policy/grad_norm": float("inf"), "kl": -float("inf")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (_strict(line) for line in lines)  # no bare NaN / Infinity tokens
    assert NONFINITE_METRICS_KEY not in first
    assert second[NONFINITE_METRICS_KEY] == ["policy/loss", "policy/grad_norm", "kl"]
    assert (second["policy/loss"], second["policy/grad_norm"], second["kl"]) == ("nan", "inf", "-inf")
    assert math.isnan(float(second["policy/loss"]))
