"""Algorithm resolution: recipe defaults fill only the keys the user did not set (from a dict, YAML
or flags), the known fields match what the kernels read, and near-miss custom names are refused."""

from __future__ import annotations

import argparse
import ast
import pickle
from pathlib import Path

import pytest

from stacx.launch.run_flags import add_run_config_arguments, run_config_from_args
from stacx.trainer.recipes import get_recipe
from stacx.trainer.resolved_config import resolve_algorithm_config
from stacx.trainer.run_config import ALGORITHM_FIELDS, FIELDS, AlgorithmConfig, ConfigError, RunConfig

REPO = Path(__file__).resolve().parents[2]


def _from_flags(argv: list[str]) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return run_config_from_args(parser.parse_args(argv))


def test_a_user_value_equal_to_the_generic_default_still_wins_over_the_recipe():
    ppo = get_recipe("ppo")
    assert ALGORITHM_FIELDS["lam"] == 1.0 and ppo.algorithm.lam == 0.95
    unset = resolve_algorithm_config(ppo, RunConfig.from_dict({"algorithm": {"name": "ppo"}}))
    assert unset.lam == 0.95
    for cfg in (RunConfig.from_dict({"algorithm": {"name": "ppo", "lam": 1.0}}),
                RunConfig.from_dict({"lam": 1.0}),
                _from_flags(["--algorithm", "ppo", "--lam", "1.0"])):
        assert resolve_algorithm_config(ppo, cfg).lam == 1.0
    # grpo's kl_loss_coef default is 0.001; an explicit 0.0 (the generic default) must stay 0.0.
    grpo = get_recipe("grpo")
    assert resolve_algorithm_config(grpo, RunConfig()).kl_loss_coef == 0.001
    assert resolve_algorithm_config(grpo, _from_flags(["--kl-loss-coef", "0.0"])).kl_loss_coef == 0.0
    # dr_grpo turns norm_adv_by_std off; --norm-adv-by-std (= the generic True) turns it back on.
    dr_grpo = get_recipe("dr_grpo")
    assert resolve_algorithm_config(dr_grpo, RunConfig()).norm_adv_by_std is False
    assert resolve_algorithm_config(dr_grpo, _from_flags(["--norm-adv-by-std"])).norm_adv_by_std is True


def test_yaml_values_count_as_set_and_flags_override_them(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("algorithm:\n  name: ppo\n  lam: 1.0\n  gamma: 0.99\n")
    cfg = _from_flags(["--config", str(config), "--gamma", "1.0"])
    assert cfg.algorithm.given_keys >= {"lam", "gamma", "name"}
    resolved = resolve_algorithm_config(get_recipe("ppo"), cfg)
    assert (resolved.lam, resolved.gamma, resolved.value_clip) == (1.0, 1.0, 0.5)


def test_clip_ratio_sets_unset_bounds_and_explicit_bounds_win():
    grpo, dapo = get_recipe("grpo"), get_recipe("dapo")
    both = resolve_algorithm_config(dapo, RunConfig.from_dict({"clip_ratio": 0.3}))
    assert (both.clip_ratio_low, both.clip_ratio_high) == (0.3, 0.3)
    mixed = resolve_algorithm_config(dapo, RunConfig.from_dict({"clip_ratio": 0.3, "clip_ratio_high": 0.2}))
    assert (mixed.clip_ratio_low, mixed.clip_ratio_high) == (0.3, 0.2)  # 0.2 is the generic default, still set
    only_high = resolve_algorithm_config(grpo, RunConfig.from_dict({"clip_ratio_high": 0.28}))
    assert (only_high.clip_ratio_low, only_high.clip_ratio_high) == (0.2, 0.28)
    assert resolve_algorithm_config(dapo, RunConfig()).clip_ratio_high == 0.28


def test_given_keys_survive_replace_and_pickling():
    cfg = RunConfig.from_dict({"algorithm": {"name": "ppo", "lam": 1.0, "my_knob": 2}}).replace(num_steps=3)
    assert cfg.algorithm.given_keys == {"name", "lam", "my_knob"}
    changed = cfg.replace(gamma=0.9)
    assert changed.algorithm.given_keys == {"name", "lam", "my_knob", "gamma"}
    assert resolve_algorithm_config(get_recipe("ppo"), changed).lam == 1.0
    copy = pickle.loads(pickle.dumps(changed.algorithm))
    assert copy.given_keys == changed.algorithm.given_keys and copy.to_dict() == changed.algorithm.to_dict()
    assert "_given_keys" not in changed.algorithm.to_dict()  # kernels and checkpoints see only hyperparameters
    assert AlgorithmConfig().given_keys == frozenset()


def test_custom_names_are_allowed_but_near_misses_of_known_names_are_refused():
    cfg = RunConfig.from_dict({"algorithm": {"my_temperature": 0.3, "reward_scale": 2}})
    assert cfg.algorithm.custom_hyperparameters() == {"my_temperature": 0.3, "reward_scale": 2}
    for typo, known in (("clip_ratio_hgh", "clip_ratio_high"), ("tis_treshold", "tis_threshold"),
                        ("kl_los_coef", "kl_loss_coef"), ("gama", "gamma")):
        with pytest.raises(ConfigError, match=f"'{typo}'.*misspelling.*'{known}'"):
            RunConfig.from_dict({"algorithm": {typo: 1.0}}, source="run.yaml")
    with pytest.raises(ConfigError, match="m2po_treshold.*m2po_threshold"):
        _from_flags(["--algorithm-param", "m2po_treshold=0.1"])


def test_newly_known_fields_have_flags_and_are_type_checked():
    cfg = _from_flags(["--tis-threshold", "3", "--whiten-advantages", "--student-top-k", "4",
                       "--off-policy-corrections", "tis,mis", "--overlong-buffer-length", "16"])
    a = cfg.algorithm
    assert (a.tis_threshold, a.whiten_advantages, a.student_top_k, a.overlong_buffer_length) == (3.0, True, 4, 16)
    assert a.off_policy_corrections == "tis,mis" and a.custom_hyperparameters() == {}
    with pytest.raises(ConfigError, match="'mis_upper'.*expects float"):
        RunConfig.from_dict({"algorithm": {"mis_upper": "high"}})
    with pytest.raises(ConfigError, match="'student_top_k'.*expects int"):
        RunConfig.from_dict({"algorithm": {"student_top_k": 2.5}})
    # The recipe's DAPO shaping fields are known fields now (not custom hyperparameters).
    dapo = resolve_algorithm_config(get_recipe("dapo"), RunConfig())
    assert dapo.filter_zero_variance_groups is True and dapo.overlong_buffer_fraction == 0.2
    assert dapo.overlong_buffer_length is None
    assert dapo.custom_hyperparameters().keys() <= {"rollout_temperature", "distill_kl_mode", "teacher_top_k"}


def _kernel_reads() -> list[tuple[str, str, object]]:
    """(file, name, default or ...) of every `hyperparameter(config, "name", default)`,
    `self.setting("name", default)` and `getattr(config, "name", default)` in the kernels and
    specializations (default `...` when it is not a literal)."""
    found = []
    for folder in ("stacx/objectives", "stacx/specializations"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or len(node.args) < 2:
                    continue
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name == "hyperparameter" and len(node.args) == 3:
                    key, default = node.args[1], node.args[2]
                elif name == "setting" and len(node.args) == 2:
                    key, default = node.args
                elif (name == "getattr" and len(node.args) == 3 and isinstance(node.args[0], ast.Name)
                      and node.args[0].id == "config"):
                    key, default = node.args[1], node.args[2]
                else:
                    continue
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    continue
                try:
                    value = ast.literal_eval(default)
                except ValueError:
                    value = ...
                found.append((str(path.relative_to(REPO)), key.value, value))
    return found


def test_every_hyperparameter_the_kernels_read_is_known_with_the_kernels_default():
    reads = _kernel_reads()
    assert len(reads) > 30, "the scan should find the kernels' hyperparameter reads"
    # Read from other run-config sections through the resolved algorithm config.
    from_sections = {"rollout_temperature", "distill_kl_mode", "teacher_top_k"}
    unknown = sorted({(f, n) for f, n, _ in reads if n not in ALGORITHM_FIELDS and n not in from_sections})
    assert not unknown, f"kernels read hyperparameters missing from ALGORITHM_FIELDS: {unknown}"
    assert from_sections <= set(FIELDS)
    # A known field whose default is None means "unset": the reader's own default applies (hyperparameter()
    # maps None to it), e.g. policy_loss -> ppo_clip. clip_ratio_low/high are read with a computed default.
    mismatched = sorted({(f, n, d, ALGORITHM_FIELDS[n]) for f, n, d in reads
                         if n in ALGORITHM_FIELDS and ALGORITHM_FIELDS[n] is not None and d is not ...
                         and d != ALGORITHM_FIELDS[n]})
    assert not mismatched, f"kernel defaults differ from ALGORITHM_FIELDS: {mismatched}"


def test_a_key_close_to_a_known_one_is_refused_unless_declared_custom():
    """`kl_coef` would silently leave `kl_loss_coef` at its default: refused, naming both and the fix."""
    from stacx.trainer.run_config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=r"'kl_coef' in run.yaml looks like a misspelling of .*'kl_loss_coef'.*"
                                          r"custom_hyperparameters: \[kl_coef\]"):
        RunConfig.from_dict({"algorithm": {"kl_coef": 0.1}}, source="run.yaml")
    declared = RunConfig.from_dict({"algorithm": {"kl_coef": 0.1, "custom_hyperparameters": ["kl_coef"]}})
    assert declared.algorithm.kl_coef == 0.1 and declared.algorithm.kl_loss_coef == ALGORITHM_FIELDS["kl_loss_coef"]
    for custom in ("pg_temperature", "rank_scale", "rwr_max_weight", "adv_estimator"):  # the examples' keys
        RunConfig.from_dict({"algorithm": {custom: 1.0}})
    with pytest.raises(ConfigError, match="custom_hyperparameters in config must be a list of names"):
        RunConfig.from_dict({"algorithm": {"custom_hyperparameters": "kl_coef"}})
