"""The one Registry every kind of plugin uses: its rules (duplicates, close matches, same entry again,
built-in replacement) and the registries that were plain dicts before (engine kinds, rewards, built-in
tasks, recipes, workloads) answering with them."""

import warnings

import pytest

from stacx.plugins.registry import ImportedOnCall, Registry


def test_a_duplicate_is_refused_naming_the_registry_the_holder_and_the_names():
    things = Registry("thing")
    things.register("spoon")(len)
    with pytest.raises(ValueError, match=r"thing 'spoon' is already registered \(by builtins.len\); registered thing "
                                         r"names: \['spoon'\]"):
        things.register("spoon")(abs)
    with pytest.raises(ValueError, match=r"unknown thing 'spon'; did you mean 'spoon'\? registered thing names"):
        things.get("spon")
    assert things.pop("spoon") is len and "spoon" not in things and things.pop("spoon", None) is None


def test_same_entry_again_and_user_replacement_of_a_builtin_are_opt_in():
    kinds = Registry("kind", entries_are_callable=False, same_entry_again_is_noop=True, known_as="known kinds")
    entry = ("a",)
    assert kinds.add("a", entry) is entry and kinds.add("a", ("a",)) is entry  # an equal entry: a no-op
    with pytest.raises(ValueError, match=r"kind 'a' is already registered .*; known kinds: a"):
        kinds.add("a", ("b",))
    kernels = Registry("kernel", user_may_replace_builtins=True)
    kernels.add("mean", len, origin=ImportedOnCall)  # defined inside stacx: a built-in
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels.register("mean")(test_same_entry_again_and_user_replacement_of_a_builtin_are_opt_in)
    assert "replaces the built-in" in str(caught[0].message)
    kernels.unregister("mean")
    assert kernels["mean"] is len  # the built-in is back


def test_imported_on_call_imports_its_target_at_the_first_call():
    join = ImportedOnCall("os.path:join")
    assert join("a", "b") == "a/b" and join == ImportedOnCall("os.path:join")
    with pytest.raises(ValueError, match="expected 'package.module:attribute'"):
        ImportedOnCall("os.path.join")


def test_engine_kinds_rewards_tasks_and_recipes_answer_with_the_registry_rules():
    from stacx.rollout.engines.http import HttpEngine
    from stacx.rollout.engines.registry import register_engine
    from stacx.rollout.rewards import register_reward
    from stacx.tasks import get_task
    from stacx.trainer.config.recipe import RecipeError
    from stacx.trainer.recipes import get_recipe

    with pytest.raises(ValueError, match=r"engine kind 'cpu' is already registered \(by stacx.rollout.engines.registry."
                                         r"launched_stacx_serve_client\); registered engine kind names: \['cpu', 'http', 'sglang'"):
        register_engine("cpu")(HttpEngine)
    with pytest.raises(ValueError, match=r"reward function 'exact_match' is already registered \(by stacx.rollout"):
        register_reward("exact_match")(len)
    with pytest.raises(ValueError, match=r"unknown built-in task 'addtion'; did you mean 'addition'\? known tasks: "):
        get_task("addtion")
    with pytest.raises(RecipeError, match=r"unknown recipe 'grpoo'; did you mean 'grpo'\? known recipes: "):
        get_recipe("grpoo")
