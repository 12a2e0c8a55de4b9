"""The driver-side rollout service and the engine registry it asks: kind resolution, clients,
duplicate names, and a failed start releasing what it started."""

from __future__ import annotations

import pytest
import torch

from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.engines.registry import (EngineKind, add_engine_kind, engine_client, register_engine,
                                            resolve_engine_kind, unregister_engine)
from stacx.rollout.engines.sglang import SglangEngine
from stacx.rollout.plan import RolloutPlan
from stacx.rollout.sections import RolloutSection, TeacherSection
from stacx.rollout.service import RolloutService


def test_engine_kind_resolution_and_clients():
    assert resolve_engine_kind("auto").name == ("sglang" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"--rollout-engine 'sglan' .*did you mean 'sglang'.*adding-an-engine"):
        resolve_engine_kind("sglan")
    assert isinstance(engine_client("sglang", "http://127.0.0.1:1"), SglangEngine)
    assert type(engine_client("cpu", "http://127.0.0.1:1")) is HttpEngine
    assert resolve_engine_kind("http").attaches and not resolve_engine_kind("cpu").attaches


def test_a_kind_is_registered_once():
    with pytest.raises(ValueError, match=r"engine kind 'http' is already registered.*\['cpu', 'http', 'sglang'"):
        add_engine_kind(EngineKind(name="http", client=HttpEngine))
    with pytest.raises(ValueError, match="other than 'auto'"):
        EngineKind(name="auto", client=HttpEngine)


def test_a_rollout_service_that_fails_to_start_stops_the_servers_it_started():
    stopped = []

    class FakeServers:
        def wait_until_ready(self):
            return ("http://127.0.0.1:1",)

        def stop(self):
            stopped.append("stopped")

    register_engine("fake_launched", launcher=lambda launch: FakeServers())(HttpEngine)
    try:
        distill = RolloutPlan(recipe="opd", data_source="rollout", uses_teacher=True)
        with pytest.raises(ValueError, match="--teacher-url"):
            RolloutService.start(RolloutSection(rollout_engine="fake_launched"), TeacherSection(), plan=distill,
                                 hf_checkpoint="tiny", tokenizer=object())
    finally:
        unregister_engine("fake_launched")
    assert stopped == ["stopped"]
