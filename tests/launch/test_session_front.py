"""`stacx train` gives the trainer `stacx serve`'s HTTP server as the session recorder it starts in front of an engine
that records no agent sessions (vLLM), so `stacx.trainer` never imports `stacx.serving`: `run_workload` installs the
factory before the driver is built, and an agent run's sample source on a `sessions_through_recorder` kind starts
that factory's front (a fake stands in for the server here) and stops it when the rollout service closes."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

import stacx.serving.server as serving_server
from stacx.launch.commands.train import run_workload
from stacx.launch.session_front import engine_http_server
from stacx.rollout.agents.agent_rollout import AgentRollout
from stacx.rollout.engines.registry import resolve_engine_kind
from stacx.rollout.service import RolloutService
from stacx.trainer.config.run import RunConfig
from stacx.trainer.config.resolve import resolve_algorithm_config
from stacx.trainer.recipes import get_recipe
from stacx.trainer.sample_sources import RolloutSamples, choose_sample_source
from stacx.trainer.session_recorder import session_endpoint, session_front_factory, set_session_front_factory
from tests.rollout.agents.agent_fixtures import ScriptedEngine


TOKENIZER = SimpleNamespace(decode=lambda ids: "")
"""What an agent run's sample source reads of the tokenizer before a run starts."""


class FakeFront:
    """Stands in for `EngineHttpServer`: records how it was built, started and stopped."""

    built: list["FakeFront"] = []

    def __init__(self, engine, **settings):
        self.engine, self.settings = engine, settings
        self.url, self.api_key = "http://front.invalid:1", settings["api_key"]
        self.events: list[str] = []
        FakeFront.built.append(self)

    def start(self):
        self.events.append("start")
        return self

    def stop(self):
        self.events.append("stop")


class AgentRunDriver:
    """A workload driver whose run builds the text loop's sample source, as the trainer's factory does."""

    def __init__(self, run_config, recipe):
        self.run_config, self.recipe = run_config, recipe
        self.service = RolloutService(ScriptedEngine([]), engine_kind=run_config.rollout.rollout_engine,
                                      url="http://engine.invalid:1", tokenizer=TOKENIZER, rollout_section=None)
        self.samples = None

    def describe(self) -> str:
        return "agent run"

    def run(self) -> dict:
        algorithm = resolve_algorithm_config(self.recipe, self.run_config)
        self.samples = choose_sample_source(run_config=self.run_config, training_config=self.recipe,
                                            algorithm=algorithm, data=None, rollout=self.service, is_driver=True)
        return {}


@pytest.fixture
def no_session_front():
    """The process as a Python caller of the trainer finds it: no front given; restored afterwards."""
    previous = set_session_front_factory(None)
    FakeFront.built.clear()
    yield
    set_session_front_factory(previous)


def test_stacx_train_starts_the_servers_recorder_in_front_of_an_agent_runs_vllm_engine(no_session_front, monkeypatch):
    monkeypatch.setattr(serving_server, "EngineHttpServer", FakeFront)  # the class the launch's factory builds
    run_config = RunConfig.from_dict({"rollout_engine": "vllm", "agent_command": f"{sys.executable} agent.py"})
    recipe = get_recipe("grpo")
    drivers: list[AgentRunDriver] = []

    class Workload:
        @staticmethod
        def driver(config, chosen_recipe):
            drivers.append(AgentRunDriver(config, chosen_recipe))
            return drivers[-1]

    assert run_workload(Workload, run_config, recipe) == 0
    assert session_front_factory() is engine_http_server
    (driver,) = drivers
    assert type(driver.samples) is RolloutSamples
    rollout = driver.samples.step_rollout
    (front,) = FakeFront.built
    assert isinstance(rollout, AgentRollout) and rollout.server_url == front.url and front.events == ["start"]
    assert front.engine is driver.service.engine and front.settings["tokenizer"] is TOKENIZER
    assert front.settings["weight_updates"] is False
    assert rollout.api_key == front.api_key and front.api_key
    driver.service.close()
    assert front.events == ["start", "stop"]


def test_without_the_launch_layer_the_recorder_is_refused_naming_how_to_give_it(no_session_front):
    service = RolloutService(ScriptedEngine([]), engine_kind="vllm", url="http://engine.invalid:1", tokenizer=None,
                             rollout_section=None)
    with pytest.raises(RuntimeError, match=r"'vllm'.*install_session_front\(\) before stacx.trainer.run_training"):
        session_endpoint(resolve_engine_kind("vllm"), service, model_path="")
    assert FakeFront.built == []
