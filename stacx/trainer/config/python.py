"""A run configuration from Python keywords, in guide 001's style:

    from stacx import StacxConfig

    config = StacxConfig(model_path="Qwen/Qwen3-8B",
                         algorithm={"name": "my_loss", "adv_estimator": "my_advantage", "clip_ratio": 0.2})
    stacx.trainer.run_training(config)

It is `RunConfig.from_dict` with `model_path` as `hf_checkpoint`: every other keyword is a run
config field by its flat name (`num_steps=2`, `prompt_data="builtin:sorting"`) or a section
(`rollout={...}`), checked exactly like a YAML file, errors naming the keyword.
"""

from __future__ import annotations

from typing import Any, Mapping

from stacx.trainer.config.run import RunConfig


def StacxConfig(*, model_path: str | None = None, algorithm: Mapping[str, Any] | None = None, **fields: Any):  # noqa: N802 - a config "class" in guide 001's spelling
    """The `RunConfig` these keywords describe (`model_path` = `hf_checkpoint`)."""
    values: dict[str, Any] = dict(fields)
    if model_path is not None:
        if values.get("hf_checkpoint") not in (None, model_path):
            raise ValueError("StacxConfig: model_path and hf_checkpoint name different models; pass one of them")
        values["hf_checkpoint"] = model_path
    if algorithm is not None:
        if not isinstance(algorithm, Mapping):
            raise ValueError(f"StacxConfig: algorithm must be a mapping of hyperparameters, got {type(algorithm).__name__}")
        values["algorithm"] = dict(algorithm)
    return RunConfig.from_dict(values, source="StacxConfig(...)")
