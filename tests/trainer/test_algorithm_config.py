"""The one AlgorithmConfig: every table derived from the dataclass, recipe overrides validated at
`@recipe` time, the resolution layers (recipe < file < flags < STACX_*) and the record of what the user set."""

from __future__ import annotations

import argparse
import dataclasses
import pickle

import pytest

from stacx.launch.run_flags import add_run_config_arguments, run_config_from_args
from stacx.objectives.algorithm_config import ALGORITHM_DEFAULTS, AlgorithmConfig, AlgorithmConfigError, hyperparameter_fields
from stacx.objectives.validation import hyperparameter
from stacx.trainer.config.recipe import RecipeError, TrainingConfig, recipe_algorithm
from stacx.trainer.recipes import TRAINING_CONFIGS, rl_recipe, get_recipe, recipe
from stacx.trainer.config.resolve import resolve_algorithm_config
from stacx.rollout.rollin import resolve_rollin
from stacx.trainer.config.run import ALGORITHM_FIELD_TYPES, ALGORITHM_FIELDS, FIELDS, ConfigError, RunConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return parser


def _from_flags(argv: list[str]) -> RunConfig:
    return run_config_from_args(_parser().parse_args(argv))


# ---- one declaration: the tables are derived -------------------------------------------------------


def test_every_field_is_typed_defaulted_and_documented_once():
    import ast
    import inspect

    import stacx.objectives.algorithm_config as module

    tree = ast.parse(inspect.getsource(module.AlgorithmConfig))
    body = tree.body[0].body
    documented = {node.target.id for node, after in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                  and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}
    names = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    assert names == documented, f"fields without a docstring: {sorted(names - documented)}"
    assert all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
               for f in dataclasses.fields(AlgorithmConfig))
    assert dataclasses.fields(AlgorithmConfig)[0].kw_only
    with pytest.raises(dataclasses.FrozenInstanceError):
        AlgorithmConfig().lam = 0.5


def test_run_config_tables_flags_and_yaml_keys_come_from_the_dataclass():
    fields = hyperparameter_fields()
    assert list(ALGORITHM_FIELDS) == [f.name for f in fields] == list(ALGORITHM_DEFAULTS)
    assert ALGORITHM_FIELDS == {f.name: f.default for f in fields}
    assert set(ALGORITHM_FIELD_TYPES) == set(ALGORITHM_FIELDS)
    flags = {action.dest: action for action in _parser()._actions}
    for f in fields:
        if f.name in FIELDS:  # section settings have their section's flag
            continue
        assert f.name in flags, f"algorithm field {f.name} has no flag"
        # Every field is a YAML key checked against its annotation.
        assert RunConfig.from_dict({"algorithm": {f.name: ALGORITHM_DEFAULTS[f.name]}}).algorithm.given_keys == {f.name}


def test_a_field_added_to_the_dataclass_is_a_known_key_with_its_type_and_default():
    """Adding one field to the dataclass is all it takes: the tables are computed from the class."""
    from stacx.trainer.config.run import algorithm_field_tables

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended(AlgorithmConfig):
        my_new_knob: int | None = 3
        """A knob added for this test."""

    defaults, types = algorithm_field_tables(Extended)
    assert defaults == {**ALGORITHM_FIELDS, "my_new_knob": 3} and types["my_new_knob"] is int
    assert algorithm_field_tables() == (ALGORITHM_FIELDS, ALGORITHM_FIELD_TYPES)


def test_hyperparameter_reads_an_algorithm_config_and_refuses_any_other_object():
    assert hyperparameter(None, "lam") == AlgorithmConfig().lam == 0.95
    assert hyperparameter(AlgorithmConfig(lam=0.5), "lam") == 0.5
    assert hyperparameter(AlgorithmConfig.from_values({"my_knob": 2}), "my_knob") == 2
    with pytest.raises(TypeError, match=r"hyperparameter\(config, 'lam'\) needs a .*AlgorithmConfig.*got Namespace"):
        hyperparameter(argparse.Namespace(gamma=0.5), "lam")
    with pytest.raises(AttributeError, match="no hyperparameter 'my_knob'"):
        hyperparameter(None, "my_knob")


def test_extras_read_like_fields_pickle_and_refuse_known_names():
    config = AlgorithmConfig.from_values({"lam": 0.9, "rwr_temperature": 0.5}, given_keys={"lam"})
    assert config.rwr_temperature == 0.5 and config.extras == {"rwr_temperature": 0.5}
    with pytest.raises(AttributeError, match="no hyperparameter 'rwr_temprature'.*custom: rwr_temperature"):
        config.rwr_temprature  # noqa: B018
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and copy.given_keys == {"lam"} and copy.rwr_temperature == 0.5
    with pytest.raises(AlgorithmConfigError, match=r"extras holds known hyperparameters \['lam'\]"):
        AlgorithmConfig(extras={"lam": 0.1})
    with pytest.raises(AlgorithmConfigError, match="algorithm.lam expects float, got str"):
        AlgorithmConfig(lam="0.9")


def test_the_custom_hyperparameters_declaration_keeps_typo_detection():
    with pytest.raises(ConfigError, match="'kl_coef'.*misspelling.*'kl_loss_coef'"):
        RunConfig.from_dict({"algorithm": {"kl_coef": 0.1}})
    declared = RunConfig.from_dict({"algorithm": {"kl_coef": 0.1, "custom_hyperparameters": ["kl_coef"]}}).algorithm
    assert declared.extras["kl_coef"] == 0.1 and declared.kl_loss_coef == ALGORITHM_DEFAULTS["kl_loss_coef"]


# ---- recipes: partial overrides validated at @recipe time -----------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"clip_ratio_hgh": 0.3}, r"recipe 'typo_recipe'.*algorithm\.clip_ratio_hgh.*did you mean 'clip_ratio_high'"),
    ({"clip_ratio_high": "0.3"}, r"recipe 'typo_recipe'.*algorithm\.clip_ratio_high expects float, got str"),
    ({"lam": 1.5}, r"recipe 'typo_recipe'.*algorithm\.lam must be in \[0, 1\]"),
    ({"policy_loss": "ppo_clipp"}, r"recipe 'typo_recipe'.*algorithm\.policy_loss.*unknown name 'ppo_clipp'"),
])
def test_a_bad_recipe_override_fails_at_recipe_time_naming_recipe_and_field(overrides, message):
    with pytest.raises(RecipeError, match=message):
        @recipe("typo_recipe")
        def typo_recipe_config() -> TrainingConfig:
            return rl_recipe("typo_recipe", "a recipe with a bad override",
                              recipe_algorithm(advantage_estimator="grpo", **overrides))
    assert "typo_recipe" not in TRAINING_CONFIGS


def test_recipe_overrides_are_not_recorded_as_user_settings():
    dapo = get_recipe("dapo").algorithm
    assert dapo.clip_ratio_high == 0.28 and dapo.given_keys == frozenset()
    assert resolve_algorithm_config(get_recipe("dapo"), RunConfig()).given_keys == frozenset()


# ---- resolution: one record of what the user set, one layering ------------------------------------


def test_a_dagger_sampling_mode_equal_to_the_default_overrides_a_kappa_recipe():
    aggrevate = get_recipe("mixture_aggrevate_opd")
    assert aggrevate.rollin_protocol == "aggrevate"
    unset = _from_flags(["--algorithm", "mixture_aggrevate_opd"])
    assert resolve_rollin(aggrevate.rollin_protocol, unset.teacher, environ={}, given_keys=unset.given_keys).mode == "kappa"
    beta = _from_flags(["--algorithm", "mixture_aggrevate_opd", "--dagger-sampling-mode", "beta"])
    assert "dagger_sampling_mode" in beta.given_keys
    assert resolve_rollin(aggrevate.rollin_protocol, beta.teacher, environ={}, given_keys=beta.given_keys).mode == "beta"
    # The record survives replace() (which rebuilds every section).
    assert "dagger_sampling_mode" in beta.replace(num_steps=2).given_keys


def test_layers_on_one_key_recipe_then_file_then_flag_then_env(tmp_path):
    training_config = TrainingConfig(**{**{f.name: getattr(get_recipe("grpo"), f.name)
                                           for f in dataclasses.fields(TrainingConfig)},
                                        "name": "topk_recipe",
                                        "algorithm": recipe_algorithm(advantage_estimator="grpo", distill_kl_mode="topk")})
    config_file = tmp_path / "run.yaml"

    def resolved(file_value, argv, environ):
        if file_value is None:
            config_file.write_text("num_steps: 1\n")
        else:
            config_file.write_text(f"distill_kl_mode: {file_value}\n")
        run_config = _from_flags(["--config", str(config_file), *argv])
        return resolve_algorithm_config(training_config, run_config, environ=environ)

    assert resolved(None, [], {}).distill_kl_mode == "topk"  # the recipe
    assert resolved(None, [], {}).given_keys == frozenset()
    from_file = resolved("k3_sample", [], {})
    assert from_file.distill_kl_mode == "k3_sample" and "distill_kl_mode" in from_file.given_keys  # file > recipe
    assert resolved("k3_sample", ["--distill-kl-mode", "topk"], {}).distill_kl_mode == "topk"  # flag > file
    from_env = resolved("topk", ["--distill-kl-mode", "topk"], {"STACX_DISTILL_KL_MODE": "k3_sample"})
    assert from_env.distill_kl_mode == "k3_sample" and "distill_kl_mode" in from_env.given_keys  # env > flag


def test_an_algorithm_key_layers_recipe_then_file_then_flag(tmp_path):
    ppo = get_recipe("ppo")
    config_file = tmp_path / "run.yaml"
    config_file.write_text("algorithm:\n  value_clip: 0.3\n")
    assert resolve_algorithm_config(ppo, RunConfig()).value_clip == 0.5
    assert resolve_algorithm_config(ppo, _from_flags(["--config", str(config_file)])).value_clip == 0.3
    flagged = resolve_algorithm_config(ppo, _from_flags(["--config", str(config_file), "--value-clip", "0.2"]))
    assert flagged.value_clip == 0.2 and flagged.given_keys == {"value_clip"}


def test_a_specialization_reads_declared_knobs_without_a_default_and_custom_ones_with_the_plugins():
    from stacx.specializations.base import Specialization

    holder = Specialization(AlgorithmConfig.from_values({"lam": 0.5, "rwr_temperature": 0.2}))
    assert Specialization.setting(holder, "lam") == holder.config.lam == 0.5
    assert Specialization.setting(Specialization(None), "lam") == ALGORITHM_DEFAULTS["lam"]
    assert Specialization.setting(holder, "rwr_temperature", 1.0) == 0.2
    assert Specialization.setting(holder, "rwr_max_weight", 5.0) == 5.0
    with pytest.raises(TypeError, match=r"'lam' is declared in AlgorithmConfig \(default 0.95\)"):
        Specialization.setting(holder, "lam", 1.0)
    with pytest.raises(TypeError, match=r"'rwr_max_weight' is a custom hyperparameter.*give its default"):
        Specialization.setting(holder, "rwr_max_weight")


def test_the_checkpointed_config_is_the_resolved_one_and_resume_refuses_a_changed_knob():
    import json

    from stacx.trainer.config.resolve import check_resumed_algorithm, resolved_run_config_dict

    run_config = RunConfig.from_dict({"algorithm": {"lam": 0.9, "my_knob": [1, 2], "off_policy_corrections": ["tis"]}})
    algorithm = resolve_algorithm_config(get_recipe("ppo"), run_config)
    saved = json.loads(json.dumps(resolved_run_config_dict(run_config, algorithm, recipe="ppo")))  # as run_config.json
    assert saved["algorithm"]["lam"] == 0.9 and saved["algorithm"]["value_clip"] == 0.5
    assert saved["train"]["algorithm"] == "ppo" and "name" not in saved["algorithm"]
    assert saved["algorithm"]["my_knob"] == [1, 2]
    check_resumed_algorithm(saved, algorithm, where="ckpt/step_1")  # the same settings resume
    # A run saved while the recipe had two fields also carries it as algorithm.name: it still resumes.
    check_resumed_algorithm({**saved, "algorithm": {**saved["algorithm"], "name": "ppo"}}, algorithm, where="old")
    resumed = resolve_algorithm_config(get_recipe("ppo"), RunConfig.from_dict({"algorithm": {
        "lam": 1.0, "off_policy_corrections": ["tis"]}}))
    with pytest.raises(ValueError, match=r"checkpoint ckpt/step_1 .*lam: saved 0.9, now 1.0; my_knob: saved \[1, 2\], "
                                         r"now unset.*run_config.json"):
        check_resumed_algorithm(saved, resumed, where="ckpt/step_1")


def test_an_object_of_another_type_is_refused_where_the_config_enters_the_loss_code():
    """Typed for real: a specialization and a padded plugin refuse a config that is not an AlgorithmConfig
    when they receive it, naming the receiver and the fix, instead of a kernel failing on a missing knob
    mid-step (or, worse, reading a default). The trainer's check: tests/trainer/test_loop.py."""
    from types import SimpleNamespace

    from stacx.objectives.adapters import adapt_padded_policy_loss
    from stacx.specializations.actor import ActorSpecialization

    look_alike = SimpleNamespace(policy_loss="ppo_clip", loss_agg_mode="token-mean")
    fix = r"needs a stacx.objectives.algorithm_config.AlgorithmConfig .*AlgorithmConfig.from_values.*got SimpleNamespace"
    with pytest.raises(TypeError, match=r"ActorSpecialization\(config\) " + fix):
        ActorSpecialization(look_alike)

    def plugin(old_log_prob, log_prob, advantages, response_mask, clip_ratio=0.2):
        raise AssertionError("never called with a look-alike config")

    with pytest.raises(TypeError, match=r"padded policy loss .*plugin " + fix):
        adapt_padded_policy_loss(plugin)(look_alike, [], [], [], [])
    # None stays "the declared defaults" (a bare specialization, a kernel called in a test).
    assert ActorSpecialization(None).config == AlgorithmConfig()


def test_a_run_config_saved_with_the_recipe_in_algorithm_name_loads_with_it_in_train_algorithm():
    from stacx.trainer.config.resolve import current_run_config_keys

    old = {"train": {"algorithm": None, "num_steps": 3}, "algorithm": {"name": "rloo", "lam": 0.9}}
    loaded = RunConfig.from_dict(current_run_config_keys(old), source="run_config.json")
    assert loaded.train.algorithm == "rloo" and loaded.algorithm.lam == 0.9 and loaded.train.num_steps == 3
    assert old["algorithm"]["name"] == "rloo"  # the saved values are not modified
    flux = {"algorithm": {"name": "my_loss", "adv_estimator": "grpo"}}
    assert current_run_config_keys(flux) is flux  # a Flux-style name is the policy loss: it stays
    with pytest.raises(ConfigError, match=r"algorithm.name in run_config.json: .*train.algorithm"):
        RunConfig.from_dict(old, source="run_config.json")
