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
from stacx.trainer.config.resolve import resolve_algorithm_config
from stacx.trainer.config.run import ALGORITHM_FIELDS, FIELDS, AlgorithmConfig, ConfigError, RunConfig

REPO = Path(__file__).resolve().parents[3]


def _from_flags(argv: list[str]) -> RunConfig:
    parser = argparse.ArgumentParser()
    add_run_config_arguments(parser)
    return run_config_from_args(parser.parse_args(argv))


def test_a_user_value_equal_to_the_generic_default_still_wins_over_the_recipe():
    ppo = get_recipe("ppo")
    assert ppo.algorithm.lam == 0.95
    unset = resolve_algorithm_config(ppo, RunConfig.from_dict({"train": {"algorithm": "ppo"}}))
    assert unset.lam == 0.95
    for cfg in (RunConfig.from_dict({"train": {"algorithm": "ppo"}, "algorithm": {"lam": 1.0}}),
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
    config.write_text("train:\n  algorithm: ppo\nalgorithm:\n  lam: 1.0\n  gamma: 0.99\n")
    cfg = _from_flags(["--config", str(config), "--gamma", "1.0"])
    assert cfg.algorithm.given_keys == {"lam", "gamma"} and cfg.train.algorithm == "ppo"
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
    cfg = RunConfig.from_dict({"train": {"algorithm": "ppo"}, "algorithm": {"lam": 1.0, "my_knob": 2}}).replace(num_steps=3)
    assert cfg.algorithm.given_keys == {"lam", "my_knob"}
    changed = cfg.replace(gamma=0.9)
    assert changed.algorithm.given_keys == {"lam", "my_knob", "gamma"} and changed.train.algorithm == "ppo"
    assert resolve_algorithm_config(get_recipe("ppo"), changed).lam == 1.0
    copy = pickle.loads(pickle.dumps(changed.algorithm))
    assert copy.given_keys == changed.algorithm.given_keys and copy.to_dict() == changed.algorithm.to_dict()
    assert not {"given_keys", "extras"} & set(changed.algorithm.to_dict())  # checkpoints see only hyperparameters
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


CONFIG_NAMES = ("config", "algorithm")
"""What the loss code and the driver call the algorithm config (`config`, `self.config`, `self.algorithm`)."""

PENDING_DIFFUSION_READS: set[tuple[str, str]] = set()
"""getattr reads with a restated default still to move (diffusion's moved into DiffusionAlgorithmConfig);
none may be added."""


def _config_reads(root: Path = REPO) -> list[tuple[str, str, bool]]:
    """(file, name, restates a default) of every read of an algorithm knob in stacx/: the typed reads
    `config.<knob>` / `self.config.<knob>` / `self.algorithm.<knob>` (False), `hyperparameter(config,
    "name"[, default])` and `self.setting("name"[, default])` (True with a default), and any
    `getattr(x, "<declared knob>", default)` (True: the typed config has every knob, so a fallback
    restates its default or hides a config of another type)."""
    found = []
    for path in sorted((root / "stacx").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ALGORITHM_FIELDS:
                owner = node.value
                owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
                if owner_name in CONFIG_NAMES:
                    found.append((where, node.attr, False))
                continue
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name == "hyperparameter" and len(node.args) >= 2:
                key, restates = node.args[1], len(node.args) > 2 or bool(node.keywords)
            elif name == "setting" and isinstance(func, ast.Attribute):
                key, restates = node.args[0], len(node.args) > 1 or bool(node.keywords)
            elif name == "getattr" and len(node.args) == 3:
                key, restates = node.args[1], True
                if not (isinstance(key, ast.Constant) and key.value in ALGORITHM_FIELDS):
                    continue
            else:
                continue
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                found.append((where, key.value, restates))
    return found


def test_kernels_read_declared_hyperparameters_with_no_default_at_the_read_site():
    reads = _config_reads()
    assert len(reads) > 60, "the scan should find the kernels' hyperparameter reads"
    restated = {(f, n) for f, n, restates in reads if restates}
    assert restated <= PENDING_DIFFUSION_READS, \
        f"a default at the read site restates AlgorithmConfig's: {sorted(restated - PENDING_DIFFUSION_READS)}"
    unknown = sorted({(f, n) for f, n, _ in reads if n not in ALGORITHM_FIELDS})
    assert not unknown, f"kernels read hyperparameters AlgorithmConfig does not declare: {unknown}"
    # Copied from other run-config sections at resolution: the dataclass default equals the section's.
    for name in ("rollout_temperature", "distill_kl_mode", "teacher_top_k"):
        assert FIELDS[name][1].default == ALGORITHM_FIELDS[name], name


def test_the_scan_sees_a_default_at_a_read_site(tmp_path):
    """Guard: the AST scan flags `hyperparameter(config, "lam", 1.0)`, `self.setting("gamma", 1.0)` and a
    getattr fallback on a declared knob under any name (so an empty result means something)."""
    planted = tmp_path / "stacx" / "rollout" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text('def f(config, self, run):\n    return (hyperparameter(config, "lam", 1.0), self.setting("gamma", 1.0),\n'
                       '            getattr(run.algo, "teacher_kl_coef", 0.0), getattr(run, "eos_token_id", 2), '
                       'self.algorithm.gamma)\n')
    assert _config_reads(tmp_path) == [("stacx/rollout/planted.py", "lam", True),
                                       ("stacx/rollout/planted.py", "gamma", True),
                                       ("stacx/rollout/planted.py", "teacher_kl_coef", True),
                                       ("stacx/rollout/planted.py", "gamma", False)]


def test_a_key_close_to_a_known_one_is_refused_unless_declared_custom():
    """`kl_coef` would silently leave `kl_loss_coef` at its default: refused, naming both and the fix."""
    from stacx.trainer.config.run import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=r"'kl_coef' in run.yaml looks like a misspelling of .*'kl_loss_coef'.*"
                                          r"custom_hyperparameters: \[kl_coef\]"):
        RunConfig.from_dict({"algorithm": {"kl_coef": 0.1}}, source="run.yaml")
    declared = RunConfig.from_dict({"algorithm": {"kl_coef": 0.1, "custom_hyperparameters": ["kl_coef"]}})
    assert declared.algorithm.kl_coef == 0.1 and declared.algorithm.kl_loss_coef == ALGORITHM_FIELDS["kl_loss_coef"]
    for custom in ("pg_temperature", "rank_scale", "rwr_max_weight", "adv_estimator"):  # the examples' keys
        RunConfig.from_dict({"algorithm": {custom: 1.0}})
    with pytest.raises(ConfigError, match="custom_hyperparameters in config must be a list of names"):
        RunConfig.from_dict({"algorithm": {"custom_hyperparameters": "kl_coef"}})


def test_recipe_defaults_yield_to_user_values_only_where_the_user_set_them():
    ppo = get_recipe("ppo")
    resolved = resolve_algorithm_config(ppo, RunConfig.from_dict({"train": {"algorithm": "ppo"}, "algorithm": {"my_knob": 3}}))
    assert resolved.value_clip == 0.5  # ppo's declared default, not the generic None
    assert ALGORITHM_FIELDS["value_clip"] is None and resolved.lam == 0.95
    assert resolved.my_knob == 3 and "name" not in resolved.to_dict()  # the recipe is train.algorithm
    user = resolve_algorithm_config(ppo, RunConfig.from_dict({"lam": 0.5, "clip_ratio_high": 0.3,
                                                              "rollout_temperature": 0.7}))
    assert user.lam == 0.5 and user.clip_ratio_high == 0.3 and user.clip_ratio_low == 0.2
    assert user.rollout_temperature == 0.7  # the actor's training log-probs use the sampling temperature
    gspo = resolve_algorithm_config(get_recipe("gspo"), RunConfig())
    assert (gspo.clip_ratio_low, gspo.clip_ratio_high) == (3e-4, 4e-4)
