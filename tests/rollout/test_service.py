"""The driver-side rollout service: engine selection, and a failed start releasing what it started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stacx.rollout import service as rollout_service
from stacx.rollout.service import engine_client, resolve_engine_kind
from stacx.trainer.config.run import RunConfig


def test_engine_kind_resolution():
    assert resolve_engine_kind("auto") == ("sglang" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="rollout_engine 'vllm'"):
        resolve_engine_kind("vllm")
    from stacx.rollout.engines.sglang import SglangEngine

    assert isinstance(engine_client("sglang", "http://127.0.0.1:1"), SglangEngine)
    assert type(engine_client("cpu", "http://127.0.0.1:1")).__name__ == "HttpEngine"


def test_a_rollout_service_that_fails_to_start_stops_the_server_it_started(monkeypatch):
    stopped = []

    class FakeServer:
        def __init__(self, hf_checkpoint, *, seed, api_key=None, wait=True):
            self.url = "http://127.0.0.1:1"

        def wait_until_ready(self):
            return self.url

        def stop(self):
            stopped.append(self.url)

    monkeypatch.setattr(rollout_service, "CpuServerProcess", FakeServer)
    run_config = RunConfig.from_dict({"rollout_engine": "cpu", "hf_checkpoint": "tiny"})
    distill = SimpleNamespace(name="opd", uses_teacher=True)
    with pytest.raises(ValueError, match="--teacher-url"):
        rollout_service.RolloutService.start(run_config, distill, tokenizer=object())
    assert stopped == ["http://127.0.0.1:1"]
