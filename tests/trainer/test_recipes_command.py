"""`stacx recipes` and docs/recipes.md, which is its --markdown output and must stay current."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from stacx.launch.cli import main
from stacx.launch.commands.recipes import render_catalog_markdown
from stacx.trainer.recipes import TRAINING_CONFIGS
from tests.warm import warm_python

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


@pytest.mark.slow
def test_docs_recipes_md_is_the_current_catalog():
    # In a fresh process: recipes that other tests registered in this one are not the catalog.
    completed = subprocess.run([warm_python(), "-m", "stacx", "recipes", "--markdown"], capture_output=True,
                               text=True, timeout=300, cwd=DOC.parents[1],
                               env={k: v for k, v in os.environ.items() if k != "STACX_TEST_CUSTOM_DIRS"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert DOC.read_text() == completed.stdout, (
        "docs/recipes.md is out of date; regenerate it with: stacx recipes --markdown > docs/recipes.md"
    )


def test_catalog_page_lists_every_recipe_with_roles_and_syncs():
    page = render_catalog_markdown(TRAINING_CONFIGS)
    sections = dict(re.findall(r"^## (\w+)\n\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S))
    assert set(TRAINING_CONFIGS) <= set(sections)
    for name, config in TRAINING_CONFIGS.items():
        body = sections[name]
        for role in config.roles:
            assert f"role `{role.name}` ({role.specialization_cls.__name__}" in body
        for sync in config.syncs:
            assert f"{sync.kind} sync: `{sync.source_role}` -> `{sync.target_role}`" in body
        if not config.syncs:
            assert "- syncs: none" in body


def test_recipes_command_lists_describes_and_rejects_unknown(capsys):
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in listed) == sorted(TRAINING_CONFIGS)
    assert main(["recipes", "ppo"]) == 0
    described = capsys.readouterr().out
    assert "inject: critic -> actor (values)" in described and "pool actor (shared)" in described
    assert main(["recipes", "grpoo"]) == 2
    assert "unknown recipe 'grpoo'; did you mean 'grpo'? known recipes:" in capsys.readouterr().err


def test_recipes_command_shows_recipes_from_a_custom_module(tmp_path, capsys):
    module = tmp_path / "my_recipe_plugin.py"
    module.write_text(
        "from stacx.specializations.causal_decoder import CausalDecoderSpecialization\n"
        "from stacx.trainer.config.recipe import ModelRole, TrainingConfig\n"
        "from stacx.trainer.recipes import recipe\n\n"
        "@recipe('plugin_sft_under_test')\n"
        "def build():\n"
        "    return TrainingConfig(name='plugin_sft_under_test', description='plugin SFT', data_source='dataset',\n"
        "                          roles=(ModelRole(name='policy', specialization_cls=CausalDecoderSpecialization),))\n"
    )
    try:
        assert main(["recipes", "--custom-module", str(module), "plugin_sft_under_test"]) == 0
        assert "recipe plugin_sft_under_test: plugin SFT" in capsys.readouterr().out
    finally:
        TRAINING_CONFIGS.pop("plugin_sft_under_test", None)


def test_first_sentence_keeps_abbreviations_and_stops_at_the_sentence_end():
    from stacx.launch.commands.recipes import first_sentence

    assert first_sentence("Dr. GRPO: no std normalization. More text.") == "Dr. GRPO: no std normalization"
    assert first_sentence("Uses e.g. a reference vs. a teacher. Then more.") == "Uses e.g. a reference vs. a teacher"
    assert first_sentence("One sentence only.") == "One sentence only"
    assert first_sentence("No period at all") == "No period at all"


def test_recipes_listing_shows_the_whole_first_sentence_of_every_recipe(capsys):
    assert main(["recipes"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "Dr. GRPO: group-centered rewards without std normalization" in listed["dr_grpo"]
    for line in listed.values():
        description = line.split("]  ", 1)[1]
        assert len(description) > 20, f"listing cut a description short: {line!r}"


OBJECTIVES_PLUGIN = '''
from stacx import register_advantage, register_policy_loss, register_reward


@register_advantage("listed_adv_under_test")
def listed_adv(config, rollout_data):
    return []


@register_policy_loss("listed_loss_under_test", hyperparameters=("listed_temperature",))
def listed_loss(config, old_log_prob, log_prob, advantages, loss_masks, **kwargs):
    return list(log_prob), {}


@register_reward("listed_reward_under_test", needs_label=True)
def listed_reward(response, label, metadata=None):
    return 0.0
'''


def test_recipes_objectives_lists_built_in_and_custom_estimators_losses_and_rewards(tmp_path, capsys):
    from stacx.objectives.registry import ADVANTAGES, POLICY_LOSSES
    from stacx.rollout.rewards import REWARD_FUNCTIONS

    module = tmp_path / "listed_plugin.py"
    module.write_text(OBJECTIVES_PLUGIN)
    try:
        assert main(["recipes", "--objectives", "--custom-module", str(module)]) == 0
        out = capsys.readouterr().out
    finally:
        for registry, name in ((ADVANTAGES, "listed_adv_under_test"), (POLICY_LOSSES, "listed_loss_under_test")):
            if name in registry:
                registry.unregister(name)
        REWARD_FUNCTIONS.pop("listed_reward_under_test", None)
    sections = {block.split(":", 1)[0]: block for block in re.split(r"\n(?=\S)", out)}
    assert {"advantage estimators (--advantage-estimator)", "policy losses (--policy-loss)",
            "rewards (--reward-fn)"} <= set(sections)
    assert "\n  grpo\n" in sections["advantage estimators (--advantage-estimator)"]
    assert f"  listed_adv_under_test  (custom, {module})" in sections["advantage estimators (--advantage-estimator)"]
    assert "\n  ppo_clip\n" in sections["policy losses (--policy-loss)"]
    assert (f"  listed_loss_under_test  (custom, {module}; knobs: listed_temperature)"
            in sections["policy losses (--policy-loss)"])
    assert "  exact_match  (needs a label)" in sections["rewards (--reward-fn)"]
    assert f"  listed_reward_under_test  (custom, {module}; needs a label)" in sections["rewards (--reward-fn)"]
