"""The recipe model and catalog: every recipe validates and builds its graph; malformed recipes fail at import."""

from __future__ import annotations

import importlib
import sys
import textwrap
from argparse import Namespace
from dataclasses import FrozenInstanceError, replace

import pytest

from stacx.specializations.actor import ActorSpecialization
from stacx.specializations.base import Specialization
from stacx.specializations.critic import CriticSpecialization
from stacx.trainer.config.algorithm import ESTIMATOR_TO_RECIPE, infer_algorithm
from stacx.trainer.config.recipe import (
    AlgorithmDefaults,
    InjectSync,
    ModelRole,
    RecipeError,
    TrainingConfig,
)
from stacx.trainer.recipes import TRAINING_CONFIGS, get_recipe

ISSUE_RECIPES = (
    "sft", "online_dagger", "grpo", "dr_grpo", "gspo", "dapo", "cispo", "reinforce_pp", "reinforce_pp_baseline",
    "rloo", "ppo", "opd", "opd_rl", "mixture_dagger_opd", "mixture_aggrevate_opd", "dpo",
)
RL_RECIPES = ("grpo", "dr_grpo", "gspo", "dapo", "cispo", "reinforce_pp", "reinforce_pp_baseline", "rloo")


# ---- the catalog --------------------------------------------------------------------------------


def test_catalog_holds_every_recipe_of_the_issue():
    assert set(ISSUE_RECIPES) <= set(TRAINING_CONFIGS)


@pytest.mark.parametrize("name", sorted(TRAINING_CONFIGS))
def test_catalog_recipe_builds_its_role_graph(name):
    config = TRAINING_CONFIGS[name]
    assert config.name == name and config.description.strip()
    graph = config.role_graph()
    pooled = [role for members in graph.pools.values() for role in members]
    assert sorted(pooled) == sorted(role.name for role in config.roles), "every role sits in exactly one pool"
    assert sorted(graph.inject_order) == sorted(role.name for role in config.roles)
    for sync in graph.inject_syncs:
        assert graph.inject_order.index(sync.source_role) < graph.inject_order.index(sync.target_role)
    assert len(graph.inject_syncs) + len(graph.exchange_syncs) == len(config.syncs)
    text = config.describe()
    for role in config.roles:
        assert role.name in text and role.specialization_cls.__name__ in text
    if config.data_source == "rollout":
        assert config.rollout_role is not None and config.rollout_role.trainable
    if config.uses_reward:
        assert config.algorithm is not None, "a recipe with rewards needs advantage/loss defaults"


def test_rl_recipes_share_one_specialization_and_differ_only_by_algorithm_data():
    configs = [TRAINING_CONFIGS[name] for name in RL_RECIPES]
    assert {c.roles[0].specialization_cls for c in configs} == {ActorSpecialization}
    algorithms = [c.algorithm for c in configs]
    assert len(set(algorithms)) == len(algorithms), "two RL recipes have identical algorithm defaults"
    assert TRAINING_CONFIGS["dapo"].algorithm.clip_ratio_high > TRAINING_CONFIGS["dapo"].algorithm.clip_ratio_low
    assert TRAINING_CONFIGS["gspo"].algorithm.policy_loss == "gspo"
    assert TRAINING_CONFIGS["cispo"].algorithm.policy_loss == "cispo"
    assert TRAINING_CONFIGS["dr_grpo"].algorithm.norm_adv_by_std is False


def test_ppo_has_a_colocated_critic_and_a_values_inject_sync():
    ppo = TRAINING_CONFIGS["ppo"]
    critic = ppo.role("critic")
    assert critic.outputs_values and critic.trainable and critic.checkpoint_arg == "critic_load"
    assert ppo.pool_of("critic") == ppo.pool_of("actor")
    assert ppo.role_graph().pools == {"actor": ("actor", "critic")}
    assert ppo.syncs == (InjectSync(source_role="critic", target_role="actor", keys=("values",)),)
    assert ppo.role_graph().inject_order == ("critic", "actor")


def test_reference_is_held_in_the_policy_worker_not_a_separate_role():
    for name in ("grpo", "dpo", "ppo"):
        config = TRAINING_CONFIGS[name]
        assert config.trainable_roles[0].reference_checkpoint_arg == "ref_load"
        assert all(role.trainable for role in config.roles), "no separate frozen reference role"


def test_specialization_shells_are_specializations():
    from stacx.trainer.config.workload import TEXT_MODALITY, get_workload

    for config in TRAINING_CONFIGS.values():
        base = Specialization if config.modality == TEXT_MODALITY else get_workload(config.modality).objective_base
        for role in config.roles:
            assert issubclass(role.specialization_cls, base)
    assert CriticSpecialization.outputs_values is True
    assert ActorSpecialization.outputs_values is False


def test_configs_are_frozen_and_keyword_only():
    config = TRAINING_CONFIGS["grpo"]
    with pytest.raises(FrozenInstanceError):
        config.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelRole("policy", ActorSpecialization)  # type: ignore[misc]


def test_get_recipe_lists_known_names():
    assert get_recipe("grpo") is TRAINING_CONFIGS["grpo"]
    with pytest.raises(RecipeError, match=r"unknown recipe 'grpoo'.*known recipes: .*grpo"):
        get_recipe("grpoo")


# ---- malformed recipes fail at import, naming recipe and field ------------------------------------

_PREAMBLE = """
from stacx.specializations.actor import ActorSpecialization
from stacx.specializations.critic import CriticSpecialization
from stacx.trainer.config.recipe import AlgorithmDefaults, ExchangeSync, InjectSync, ModelRole, TrainingConfig
from stacx.trainer.recipes import recipe

def policy(**kw):
    kw.setdefault("sync_to_rollout", True)
    return ModelRole(name=kw.pop("name", "policy"), specialization_cls=kw.pop("cls", ActorSpecialization), **kw)
"""

MALFORMED = {
    "duplicate_roles": (
        "TrainingConfig(name='bad', roles=(policy(), policy(sync_to_rollout=False)), description='d')",
        r"recipe 'bad'.*'roles'.*unique.*policy",
    ),
    "sync_to_missing_role": (
        "TrainingConfig(name='bad', roles=(policy(),), description='d', "
        "syncs=(InjectSync(source_role='critic', target_role='policy', keys=('values',)),))",
        r"recipe 'bad'.*'syncs\[0\]\.source_role'.*'critic'",
    ),
    "empty_keys": (
        "TrainingConfig(name='bad', roles=(policy(), policy(name='critic', cls=CriticSpecialization, "
        "sync_to_rollout=False)), description='d', syncs=(InjectSync(source_role='critic', target_role='policy', keys=()),))",
        r"recipe 'bad'.*'syncs\[0\]\.keys'.*at least one",
    ),
    "keys_as_string": (
        "TrainingConfig(name='bad', roles=(policy(), policy(name='critic', cls=CriticSpecialization, "
        "sync_to_rollout=False)), description='d', "
        "syncs=(ExchangeSync(source_role='policy', target_role='critic', keys='weights'),))",
        r"recipe 'bad'.*'syncs\[0\]\.keys'.*tuple",
    ),
    "pool_cycle": (
        "TrainingConfig(name='bad', roles=(policy(shares_pool_with='critic'), policy(name='critic', "
        "cls=CriticSpecialization, sync_to_rollout=False, shares_pool_with='policy')), description='d')",
        r"recipe 'bad'.*shares_pool_with.*cycle.*policy -> critic -> policy",
    ),
    "pool_shared_with_missing_role": (
        "TrainingConfig(name='bad', roles=(policy(shares_pool_with='actor'),), description='d')",
        r"recipe 'bad'.*'roles\[policy\]\.shares_pool_with'.*'actor'",
    ),
    "no_roles": (
        "TrainingConfig(name='bad', roles=(), description='d')",
        r"recipe 'bad'.*'roles'.*non-empty",
    ),
    "two_rollout_roles": (
        "TrainingConfig(name='bad', roles=(policy(), policy(name='other')), description='d')",
        r"recipe 'bad'.*sync_to_rollout.*at most one",
    ),
    "inject_cycle": (
        "TrainingConfig(name='bad', roles=(policy(), policy(name='critic', cls=CriticSpecialization, "
        "sync_to_rollout=False)), description='d', syncs=("
        "InjectSync(source_role='critic', target_role='policy', keys=('values',)), "
        "InjectSync(source_role='policy', target_role='critic', keys=('log_probs',))))",
        r"recipe 'bad'.*'syncs'.*cycle",
    ),
    "unknown_policy_loss": (
        "TrainingConfig(name='bad', roles=(policy(),), description='d', uses_reward=True, "
        "algorithm=AlgorithmDefaults(advantage_estimator='grpo', policy_loss='ppo_clipp'))",
        r"recipe 'bad'.*algorithm\.policy_loss.*'ppo_clipp'.*known: .*ppo_clip",
    ),
    "bad_tensor_parallel_size": (
        "TrainingConfig(name='bad', roles=(policy(tensor_model_parallel_size=0),), description='d')",
        r"recipe 'bad'.*roles\[policy\]\.tensor_model_parallel_size.*>= 1",
    ),
    "misspelled_field": (
        "TrainingConfig(name='bad', roles=(policy(tp=2),), description='d')",
        r"recipe 'bad'.*unexpected keyword argument 'tp'",
    ),
    "not_a_specialization": (
        "TrainingConfig(name='bad', roles=(policy(cls=dict),), description='d')",
        r"recipe 'bad'.*roles\[policy\]\.specialization_cls.*Specialization",
    ),
    "name_mismatch": (
        "TrainingConfig(name='other', roles=(policy(),), description='d')",
        r"recipe 'bad'.*field 'name' is 'other'",
    ),
    "gae_without_critic": (
        "TrainingConfig(name='bad', roles=(policy(),), description='d', uses_reward=True, "
        "algorithm=AlgorithmDefaults(advantage_estimator='gae'))",
        r"recipe 'bad'.*algorithm\.advantage_estimator.*critic",
    ),
    "frozen_role_pushing_weights": (
        "TrainingConfig(name='bad', roles=(policy(trainable=False),), description='d')",
        r"recipe 'bad'.*roles\[policy\]\.sync_to_rollout.*frozen",
    ),
    "empty_description": (
        "TrainingConfig(name='bad', roles=(policy(),), description='  ')",
        r"recipe 'bad'.*'description'",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_recipe_fails_at_import_naming_recipe_and_field(case, tmp_path, monkeypatch):
    body, pattern = MALFORMED[case]
    module_name = f"stacx_bad_recipe_{case}"
    source = _PREAMBLE + textwrap.dedent(f"""
        @recipe("bad")
        def bad():
            return {body}
    """)
    (tmp_path / f"{module_name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(RecipeError, match=pattern):
            importlib.import_module(module_name)
        assert "bad" not in TRAINING_CONFIGS, "a malformed recipe must not be registered"
    finally:
        sys.modules.pop(module_name, None)
        TRAINING_CONFIGS.pop("bad", None)


def test_well_formed_recipe_in_a_user_module_registers_at_import(tmp_path, monkeypatch):
    source = _PREAMBLE + textwrap.dedent("""
        @recipe("my_algo_under_test")
        def my_algo():
            return TrainingConfig(
                name="my_algo_under_test",
                roles=(policy(), policy(name="critic", cls=CriticSpecialization, sync_to_rollout=False,
                                        shares_pool_with="policy", checkpoint_arg="critic_load")),
                syncs=(InjectSync(source_role="critic", target_role="policy", keys=("values",)),
                       ExchangeSync(source_role="policy", target_role="critic", keys=("weights",))),
                description="a test recipe",
            )
    """)
    (tmp_path / "stacx_good_recipe.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("stacx_good_recipe")
        graph = TRAINING_CONFIGS["my_algo_under_test"].role_graph()
        assert graph.pools == {"policy": ("policy", "critic")}
        assert [s.keys for s in graph.exchange_syncs] == [("weights",)]
        # Registering the same name again is rejected.
        sys.modules.pop("stacx_good_recipe")
        with pytest.raises(RecipeError, match=r"recipe 'my_algo_under_test'.*already registered"):
            importlib.import_module("stacx_good_recipe")
    finally:
        sys.modules.pop("stacx_good_recipe", None)
        TRAINING_CONFIGS.pop("my_algo_under_test", None)


def test_duplicate_inject_of_one_field_is_rejected():
    roles = (
        ModelRole(name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True),
        ModelRole(name="critic_a", specialization_cls=CriticSpecialization, checkpoint_arg="critic_load"),
        ModelRole(name="critic_b", specialization_cls=CriticSpecialization, checkpoint_arg="critic_load"),
    )
    syncs = (InjectSync(source_role="critic_a", target_role="policy", keys=("values",)),
             InjectSync(source_role="critic_b", target_role="policy", keys=("values",)))
    with pytest.raises(RecipeError, match=r"'syncs\[1\]\.keys'.*'values'.*already injected.*critic_a"):
        TrainingConfig(name="two_critics", roles=roles, syncs=syncs, description="d")


def test_replace_revalidates():
    with pytest.raises(RecipeError, match="roles"):
        replace(TRAINING_CONFIGS["grpo"], roles=())
    with pytest.raises(RecipeError, match="algorithm.clip_ratio_high"):
        AlgorithmDefaults(advantage_estimator="grpo", clip_ratio_high=-0.1)


# ---- infer_algorithm ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (Namespace(algorithm="opd", use_critic=True, advantage_estimator="rloo"), "opd"),  # explicit wins verbatim
        (Namespace(algorithm=None, use_critic=True, advantage_estimator="grpo"), "ppo"),  # critic selects ppo
        (Namespace(algorithm=None, use_critic=False, advantage_estimator="reinforce_plus_plus"), "reinforce_pp"),
        ({"advantage_estimator": "reinforce_plus_plus_baseline"}, "reinforce_pp_baseline"),
        ({"advantage_estimator": "dr_grpo"}, "dr_grpo"),
        ({"advantage_estimator": "gae"}, "ppo"),
        (Namespace(), "grpo"),  # nothing set: the default estimator
    ],
)
def test_infer_algorithm(args, expected):
    assert infer_algorithm(args) == expected


def test_infer_algorithm_rejects_unknown_names_listing_known_ones():
    with pytest.raises(RecipeError, match=r"--algorithm 'grpoo'.*known recipes: .*dapo.*grpo"):
        infer_algorithm({"algorithm": "grpoo"})
    with pytest.raises(RecipeError, match=r"--advantage-estimator 'foo' is not a registered.*reinforce_plus_plus.*--custom-module"):
        infer_algorithm({"advantage_estimator": "foo"})


def test_an_estimator_without_a_recipe_of_its_own_runs_in_the_generic_actor_recipe():
    """Guide 000: setting only `algorithm.advantage_estimator: <custom name>` used to fail with
    "selects no recipe"."""
    from stacx.objectives.registry import ADVANTAGES, register_advantage

    assert infer_algorithm({"advantage_estimator": "reward_centered"}) == "grpo"  # built-in, no recipe
    register_advantage("infer_custom_adv_test")(lambda config, rollout_data: [])
    try:
        assert infer_algorithm({"advantage_estimator": "infer_custom_adv_test"}) == "grpo"
        assert infer_algorithm({"advantage_estimator": "infer_custom_adv_test", "use_critic": True}) == "ppo"
    finally:
        ADVANTAGES.unregister("infer_custom_adv_test")


def test_every_estimator_mapping_points_at_a_recipe_using_that_estimator():
    for estimator, name in ESTIMATOR_TO_RECIPE.items():
        assert TRAINING_CONFIGS[name].algorithm.advantage_estimator == estimator


# ---- agreement with the run configuration and the objectives registries ---------------------------


def test_algorithm_defaults_use_the_run_config_algorithm_keys():
    from stacx.trainer.config.run import ALGORITHM_FIELDS, AlgorithmConfig

    for name, config in TRAINING_CONFIGS.items():
        if config.algorithm is None:
            continue
        values = config.algorithm.to_dict()
        shared = {"advantage_estimator", "policy_loss", "loss_agg_mode", "clip_ratio_low", "clip_ratio_high",
                  "clip_ratio_c", "use_kl_loss", "kl_loss_type", "kl_loss_coef", "use_kl_in_reward",
                  "kl_in_reward_coef", "entropy_coef", "gamma", "lam", "norm_adv_by_std", "value_clip"}
        assert shared <= set(values) and shared <= set(ALGORITHM_FIELDS)
        algorithm = AlgorithmConfig.from_values(values)
        assert algorithm.loss_agg_mode == config.algorithm.loss_agg_mode
        assert algorithm.clip_ratio_high == config.algorithm.clip_ratio_high


def test_every_kernel_named_by_the_catalog_is_registered_in_objectives():
    from stacx.objectives.registry import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES

    for name, config in TRAINING_CONFIGS.items():
        if config.algorithm is None:
            continue
        a = config.algorithm
        if a.advantage_estimator is not None:  # a diffusion SFT / DPO recipe computes no advantages
            ADVANTAGES.get(a.advantage_estimator)  # raises ValueError listing registered names
        POLICY_LOSSES.get(a.policy_loss)
        AGGREGATIONS.get(a.loss_agg_mode)
        KL_ESTIMATORS.get(a.kl_loss_type)


def test_a_custom_registered_policy_loss_can_be_named_by_a_recipe():
    from stacx.objectives.registry import POLICY_LOSSES, register_policy_loss

    with pytest.raises(RecipeError, match="algorithm.policy_loss"):
        AlgorithmDefaults(advantage_estimator="grpo", policy_loss="my_test_loss")

    @register_policy_loss("my_test_loss")
    def my_test_loss(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
        raise AssertionError("never called")

    try:
        assert AlgorithmDefaults(advantage_estimator="grpo", policy_loss="my_test_loss").policy_loss == "my_test_loss"
    finally:
        POLICY_LOSSES.unregister("my_test_loss")


def test_checkpoint_args_name_run_config_model_fields():
    from dataclasses import fields

    from stacx.trainer.config.recipe import CHECKPOINT_ARGS
    from stacx.trainer.config.run import ModelSection

    model_fields = {f.name for f in fields(ModelSection)}
    assert set(CHECKPOINT_ARGS) <= model_fields
    for config in TRAINING_CONFIGS.values():
        for role in config.roles:
            assert role.checkpoint_arg in model_fields
            assert role.reference_checkpoint_arg in model_fields | {None}
