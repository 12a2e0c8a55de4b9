"""Registries, automatic discovery, and custom algorithms loaded from user files."""

import sys
import textwrap

import pytest
import torch

from stacx.objectives import aggregate_mean, load_custom_modules
from stacx.plugins.discovery import _import_package_tree
from stacx.objectives.registry import (
    Registry,
    get_advantage,
    get_kl_estimator,
    get_loss,
    get_off_policy_correction,
    get_policy_loss,
    list_advantages,
    list_kl_estimators,
    list_losses,
    list_off_policy_corrections,
    list_policy_losses,
    register_policy_loss,
    ADVANTAGES,
    POLICY_LOSSES,
)

import pathlib

from tests.objectives.trajectories import config

EXAMPLE = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "custom_algorithm" / "my_algo.py")


def test_every_builtin_is_registered():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae",
            "reward_centered"} <= set(list_advantages())
    assert {"ppo_clip", "gspo", "cispo", "vanilla_pg", "reinforce"} <= set(list_policy_losses())
    assert {"k1", "k2", "k3", "low_var_kl"} <= set(list_kl_estimators())
    assert {"token_tis", "sequence_tis", "token_mis", "sequence_mis", "opsm", "m2po"} <= set(list_off_policy_corrections())
    assert {"value_clipped", "sft_cross_entropy", "dpo", "dpo_sigmoid", "dpo_ipo", "distill_reverse_kl_k3",
            "distill_topk_reverse_kl", "distill_mixed"} <= set(list_losses())
    assert get_kl_estimator("low_var_kl") is get_kl_estimator("k3")


def test_unknown_and_duplicate_names_list_the_registered_names():
    with pytest.raises(ValueError, match=r"unknown policy loss 'nope'.*ppo_clip"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'.*grpo"):
        get_advantage("nope")
    for lookup in (get_kl_estimator, get_loss, get_off_policy_correction):
        with pytest.raises(ValueError, match="registered"):
            lookup("nope")
    register_policy_loss("dup_name_test")(lambda *a, **k: None)
    try:
        with pytest.raises(ValueError, match=r"'dup_name_test' is already registered.*registered policy loss names"):
            register_policy_loss("dup_name_test")(lambda *a, **k: None)
    finally:
        POLICY_LOSSES.unregister("dup_name_test")
    registry = Registry("thing")
    registry.register("a", aliases=("b",))(len)
    with pytest.raises(ValueError, match="'b' is already registered"):
        registry.register("b")(len)
    with pytest.raises(ValueError, match="not callable"):
        registry.register("c")(3)


def test_custom_algorithm_from_a_user_file_end_to_end():
    """Load the example file, select both kernels by name, and check them against formulas."""
    load_custom_modules([EXAMPLE])
    load_custom_modules(EXAMPLE)  # loading again must not re-register (no duplicate error)
    cfg = config(rank_scale=2.0, pg_temperature=0.5, advantage_estimator="rank_centered", policy_loss="tempered_pg")
    rollout = {"rewards": [1.0, 3.0, 2.0, 5.0, 7.0], "prompt_id": ["a", "a", "a", "b", "c"],
               "response_lengths": [2, 3, 1, 2, 4]}
    advantages = get_advantage(cfg.advantage_estimator)(cfg, rollout)
    # group a: ranks 0, 2, 1 of 3 -> scaled to [-1, 1] -> -1, 1, 0; times 2; lone b, c -> 0
    expected = [-2.0, 2.0, 0.0, 0.0, 0.0]
    for adv, value, n in zip(advantages, expected, rollout["response_lengths"]):
        torch.testing.assert_close(adv, torch.full((n,), value))

    g = torch.Generator().manual_seed(0)
    lengths = rollout["response_lengths"]
    old = [-torch.rand(n, generator=g, dtype=torch.float64) for n in lengths]
    new = [(o + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_() for o, n in zip(old, lengths)]
    masks = [torch.ones(n, dtype=torch.float64) for n in lengths]
    adv64 = [a.to(torch.float64) for a in advantages]
    per_token, metrics = get_policy_loss(cfg.policy_loss)(cfg, old, new, adv64, masks)
    loss = aggregate_mean(per_token, masks, "token-mean")
    reference = sum((-a * torch.exp(0.5 * (n_ - o))).sum() for a, n_, o in zip(adv64, new, old)) / sum(lengths)
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-12)
    loss.backward()
    assert all(p.grad is not None for p in new)
    assert set(metrics) == {"pg_loss", "tempered_ratio"}


def test_load_custom_modules_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.py"
    with pytest.raises(ValueError, match=r"--custom-module .*missing.py.*no such file"):
        load_custom_modules([str(missing)])
    broken = tmp_path / "broken_algo.py"
    broken.write_text("def oops(:\n")
    with pytest.raises(ValueError, match=r"--custom-module .*broken_algo.py.*SyntaxError"):
        load_custom_modules([str(broken)])
    clash = tmp_path / "clash_algo.py"
    clash.write_text("from stacx.objectives.registry import register_policy_loss\n"
                     "register_policy_loss('tempered_pg_clash_test')(lambda *a, **k: None)\n"
                     "register_policy_loss('tempered_pg_clash_test')(lambda *a, **k: None)\n")
    try:
        with pytest.raises(ValueError, match=r"clash_algo.py.*'tempered_pg_clash_test' is already registered"):
            load_custom_modules([str(clash)])
    finally:
        POLICY_LOSSES.unregister("tempered_pg_clash_test")
    # The failed file registered once before raising: it must not be shipped to workers.
    from stacx.plugins.discovery import user_module_sources

    assert not any(source.origin.endswith("clash_algo.py") for source in user_module_sources())
    with pytest.raises(ValueError, match=r"--custom-module 'no_such_module_xyz'"):
        load_custom_modules(["no_such_module_xyz"])


def test_module_names_and_folder_walk_register(tmp_path, monkeypatch):
    """A dotted module name is imported; a package folder is walked recursively (as stacx/custom is)."""
    package = tmp_path / "user_algos_pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "deep.py").write_text(textwrap.dedent("""
        from stacx.objectives.registry import register_policy_loss

        @register_policy_loss("walked_pg_test")
        def walked(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
            return [-a * lp for a, lp in zip(advantages, log_prob)], {}
    """))
    (tmp_path / "named_module_algo.py").write_text(
        "from stacx.objectives.registry import register_advantage\n"
        "@register_advantage('named_module_adv_test')\n"
        "def adv(config, rollout_data):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert "user_algos_pkg.sub.deep" in _import_package_tree("user_algos_pkg")
        assert "walked_pg_test" in list_policy_losses()
        load_custom_modules(["named_module_algo"])
        assert get_advantage("named_module_adv_test")(None, {}) == []
    finally:
        POLICY_LOSSES.unregister("walked_pg_test")
        ADVANTAGES.unregister("named_module_adv_test")
        for module in [m for m in sys.modules if m.startswith(("user_algos_pkg", "named_module_algo"))]:
            del sys.modules[module]


def test_docs_have_a_section_for_every_builtin():
    docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "objectives.md").read_text()
    lookups = {get_advantage: list_advantages(), get_policy_loss: list_policy_losses(),
               get_kl_estimator: list_kl_estimators(), get_off_policy_correction: list_off_policy_corrections(),
               get_loss: list_losses()}
    builtins = [name for get, names in lookups.items() for name in names
                if get(name).__module__.startswith("stacx.objectives.")]
    assert len(builtins) >= 30
    missing = [name for name in builtins if f"`{name}`" not in docs]
    assert not missing, f"docs/objectives.md does not document {missing}"


def test_registering_a_taken_aggregation_name_names_it_even_for_non_callable_entries():
    from stacx.objectives.registry import AGGREGATIONS

    existing = AGGREGATIONS.get("token-mean")
    with pytest.raises(ValueError, match="'token-mean' is already registered"):
        AGGREGATIONS.register("token-mean")(existing)


def test_a_user_registration_replaces_a_builtin_name_with_a_warning_and_unregister_restores_it(tmp_path):
    """The guide's own examples reuse built-in names (`reward_centered`, `vanilla_pg`): they must load."""
    builtin = get_policy_loss("vanilla_pg")
    user_file = tmp_path / "reuses_builtin_name.py"
    user_file.write_text("from stacx.objectives.registry import register_policy_loss\n"
                         "@register_policy_loss('vanilla_pg')\n"
                         "def vanilla_pg(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs):\n"
                         "    return 'user', {}\n")
    try:
        with pytest.warns(UserWarning, match=r"policy loss 'vanilla_pg': .*replaces the built-in"):
            load_custom_modules([str(user_file)])
        assert get_policy_loss("vanilla_pg")(None, [], [], [], []) == ("user", {})
        # A second user registration of the same name is still a duplicate.
        with pytest.raises(ValueError, match="'vanilla_pg' is already registered"):
            register_policy_loss("vanilla_pg")(lambda *a, **k: None)
    finally:
        POLICY_LOSSES.unregister("vanilla_pg")
        for module in [m for m in sys.modules if "reuses_builtin_name" in m]:
            del sys.modules[module]
    assert get_policy_loss("vanilla_pg") is builtin


def test_a_raising_file_in_the_custom_folder_is_skipped_with_a_warning_naming_it(tmp_path, monkeypatch):
    from stacx.plugins import discovery

    package = tmp_path / "fake_custom_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "broken_user_algo.py").write_text("raise RuntimeError('user bug')\n")
    (package / "good_user_algo.py").write_text(
        "from stacx.objectives.registry import register_advantage\n"
        "@register_advantage('good_user_adv_test')\n"
        "def adv(config, rollout_data):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(discovery, "USER_PACKAGE", "fake_custom_pkg")
    try:
        with pytest.warns(RuntimeWarning, match=r"skipped .*fake_custom_pkg.broken_user_algo\.py.*user bug"):
            discovery._import_user_package()
        assert "good_user_adv_test" in ADVANTAGES
        assert "fake_custom_pkg.broken_user_algo" not in sys.modules
        shipped = {entry.module_name for entry in discovery.user_module_sources()}
        assert "fake_custom_pkg.good_user_algo" in shipped and "fake_custom_pkg.broken_user_algo" not in shipped
    finally:
        ADVANTAGES.unregister("good_user_adv_test")
        for module in [m for m in sys.modules if m.startswith("fake_custom_pkg")]:
            del sys.modules[module]
        discovery._USER_MODULE_SOURCES.pop("fake_custom_pkg.good_user_algo", None)


def test_shipped_sources_recreate_a_user_module_under_its_name_without_the_file(tmp_path):
    """What a Ray worker on another node does: the file is gone, the shipped source suffices, and an
    object pickled by reference to the module's class unpickles."""
    import pickle

    from stacx.plugins import discovery

    user_file = tmp_path / "shipped_user_algo.py"
    user_file.write_text(textwrap.dedent("""
        from stacx.objectives.registry import register_policy_loss

        class ShippedThing:
            pass

        @register_policy_loss("shipped_pg_test")
        def shipped(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
            return [-a * lp for a, lp in zip(advantages, log_prob)], {}
    """))
    (module,) = load_custom_modules([str(user_file)])
    sources = [entry for entry in discovery.user_module_sources() if entry.module_name == module.__name__]
    assert len(sources) == 1 and "ShippedThing" in sources[0].source
    payload = pickle.dumps((pickle.dumps(module.ShippedThing), sources))
    # Forget everything, as a fresh process would not have it, and delete the file.
    POLICY_LOSSES.unregister("shipped_pg_test")
    del sys.modules[module.__name__]
    user_file.unlink()
    pickled_class, received = pickle.loads(payload)
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(pickled_class)
    try:
        assert discovery.import_user_module_sources(received) == [module.__name__]
        assert discovery.import_user_module_sources(received) == []  # already imported: nothing twice
        assert pickle.loads(pickled_class).__module__ == module.__name__
        assert "shipped_pg_test" in POLICY_LOSSES
    finally:
        POLICY_LOSSES.unregister("shipped_pg_test")
        sys.modules.pop(module.__name__, None)
        discovery._USER_MODULE_SOURCES.pop(module.__name__, None)


def test_a_shipped_module_that_raises_names_its_origin():
    from stacx.plugins.discovery import UserModuleSource, import_user_module_sources

    bad = UserModuleSource("stacx_user_module_bad_ship_test", "raise KeyError('x')\n", "/somewhere/bad_ship.py")
    with pytest.raises(ImportError, match=r"'stacx_user_module_bad_ship_test' \(from /somewhere/bad_ship.py\).*KeyError"):
        import_user_module_sources([bad])
    assert "stacx_user_module_bad_ship_test" not in sys.modules
