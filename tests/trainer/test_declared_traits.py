"""What the framework asks of a plugin is a declared trait, never its name: an engine kind says whether it
records OpenAI sessions, a specialization whether it reads preference pairs, the SWE environment maps each
tool name to its method in one table, and a value-head specialization has `compute_values`."""

import sys

import pytest
import torch

from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.engines.registry import register_engine, resolve_engine_kind, unregister_engine
from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.specializations.base import Specialization
from stacx.specializations.dpo import DPOSpecialization
from stacx.trainer.config.checks import check_agent_supported
from stacx.trainer.config.recipe import ModelRole, TrainingConfig
from stacx.trainer.config.relevance import settings_the_recipe_reads
from stacx.trainer.config.run import RunConfig
from stacx.trainer.preflight import PreflightError
from stacx.trainer.recipes import get_recipe


def test_an_agent_run_accepts_any_engine_kind_that_records_sessions_and_refuses_the_others():
    assert resolve_engine_kind("cpu").records_sessions and resolve_engine_kind("http").records_sessions
    assert not resolve_engine_kind("sglang").records_sessions
    register_engine("session_recorder", records_sessions=True)(HttpEngine)
    try:
        agent = {"agent_command": f"{sys.executable} agent.py"}
        check_agent_supported(RunConfig.from_dict({"rollout_engine": "session_recorder", **agent}), get_recipe("grpo"))
        with pytest.raises(PreflightError, match=r"records the agent's sessions.*records_sessions=True.*'sglang'"):
            check_agent_supported(RunConfig.from_dict({"rollout_engine": "sglang", **agent}), get_recipe("grpo"))
    finally:
        unregister_engine("session_recorder")


class PairwisePreference(DPOSpecialization):
    """A DPO variant whose class name does not end in DPOSpecialization."""


def test_the_dpo_settings_apply_to_a_subclass_whatever_its_name():
    assert PairwisePreference.reads_preference_pairs and not Specialization.reads_preference_pairs
    dpo = get_recipe("dpo")
    role = ModelRole(name="policy", specialization_cls=PairwisePreference, reference_checkpoint_arg="ref_load")
    recipe = TrainingConfig(name="pairwise_preference", description="d", roles=(role,), data_source="dataset")
    resolved = {"algorithm": {"dpo_beta": 0.1}}
    for each in (dpo, recipe):
        shown, _ = settings_the_recipe_reads(resolved, each, AlgorithmConfig())
        assert shown["algorithm"] == {"dpo_beta": 0.1}, each.name


def test_the_swe_environment_runs_each_declared_tool_through_its_table():
    from stacx.sandbox import SandboxLimits
    from stacx.tasks.swe.environment import SweEnvironment, swe_tool_specs

    assert set(SweEnvironment.TOOL_METHODS) == set(swe_tool_specs(SandboxLimits())) == set(SweEnvironment.tools)
    SweEnvironment().close()  # before `reset`: nothing to close


def test_a_value_head_specialization_without_its_own_compute_values_gathers_its_output():
    class Layout:
        def split_local_responses(self, values):
            return [values[:2], values[2:]]

    batch = type("Batch", (), {"layout": Layout()})()
    values = Specialization().compute_values(torch.arange(5.0), batch)
    assert [v.tolist() for v in values] == [[0.0, 1.0], [2.0, 3.0, 4.0]]


def test_a_recipe_naming_an_unknown_kernel_lists_the_registrys_own_names():
    """The registries are the one list of kernel names (no copy in the recipe model)."""
    import re

    from stacx.objectives.registry import ADVANTAGES
    from stacx.trainer.config.recipe import RecipeError, recipe_algorithm

    with pytest.raises(RecipeError, match=re.escape(f"unknown name 'grp'; known: {', '.join(ADVANTAGES.names())}")):
        recipe_algorithm(advantage_estimator="grp")
