"""Guide 001's padded plugins as written (examples/padded_plugins), and the semantics they need
(issue 13, item 4): name selects the loss, adv_estimator is accepted, plugin defaults hold unless
the user set the key, no term counted twice, importance weights passed, returns kept."""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import pytest
import torch

from stacx.objectives import load_custom_modules
from stacx.objectives.registry import POLICY_LOSSES, get_advantage, get_policy_loss, register_policy_loss
from stacx.trainer.config.run import AlgorithmConfig

SEED_001 = pathlib.Path(__file__).resolve().parents[2] / "examples" / "padded_plugins"


@pytest.fixture(scope="module", autouse=True)
def plugins():
    load_custom_modules([str(SEED_001 / "my_algorithm.py"), str(SEED_001 / "custom_reinforce.py")])


def _trajectories(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 5, 2]
    old = [-torch.rand(n, generator=g, dtype=torch.float64) for n in lengths]
    new = [(o + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_() for o, n in zip(old, lengths)]
    adv = [torch.full((n,), float(a), dtype=torch.float64) for a, n in zip([1.0, -0.5, 2.0], lengths)]
    masks = [torch.ones(n, dtype=torch.float64) for n in lengths]
    return old, new, adv, masks


def test_a_padded_plugin_given_to_the_native_decorator_is_refused_at_registration():
    def padded(old_log_prob, log_prob, advantages, response_mask, **kwargs):
        return log_prob.sum(), {}

    with pytest.raises(ValueError, match=r"'padded_native_test'.*padded-tensor plugin.*register_padded_policy_loss"):
        register_policy_loss("padded_native_test")(padded)
    assert "padded_native_test" not in POLICY_LOSSES


def test_plugin_defaults_hold_unless_the_user_set_the_key_and_its_entropy_bonus_is_its_own():
    old, new, adv, masks = _trajectories()
    loss_fn = get_policy_loss("reinforce_pg")
    assert POLICY_LOSSES.traits("reinforce_pg").applies_entropy_bonus
    unset = AlgorithmConfig(loss_agg_mode="token-mean", given_keys=frozenset())  # as resolved: nothing set
    user_set = AlgorithmConfig(loss_agg_mode="token-mean", entropy_coef=0.5, given_keys=frozenset({"entropy_coef"}))

    def expected(coef):
        lp, a = torch.cat(new).detach(), torch.cat(adv)
        return float((-lp * a + coef * lp).mean())

    for config, coef in ((unset, 0.01), (user_set, 0.5)):
        per_token, _ = loss_fn(config, old, new, adv, masks)
        total = float(sum(t.sum() for t in per_token)) / sum(len(m) for m in masks)
        assert total == pytest.approx(expected(coef), rel=1e-9), coef


def test_importance_weights_are_passed_to_a_plugin_that_takes_them_and_not_applied_twice():
    from stacx.specializations.actor import ActorSpecialization

    old, new, adv, masks = _trajectories(1)
    assert POLICY_LOSSES.traits("my_loss").applies_importance_weights
    loss_fn = get_policy_loss("my_loss")
    config = AlgorithmConfig.from_values({"loss_agg_mode": "token-mean"})
    weights = [torch.full((len(m),), w, dtype=torch.float64) for m, w in zip(masks, [0.5, 1.0, 2.0])]
    plain, _ = loss_fn(config, old, new, adv, masks)
    weighted, _ = loss_fn(config, old, new, adv, masks, importance_weights=weights)
    # The plugin aggregates itself (token-mean), so per-sequence weights scale its terms inside the mean.
    ratio = [torch.exp(n.detach() - o) for n, o in zip(new, old)]
    terms = [-torch.min(r * a, r.clamp(0.8, 1.2) * a) for r, a in zip(ratio, adv)]
    want = float(sum((t * w).sum() for t, w in zip(terms, weights)))
    assert float(sum(t.sum() for t in weighted)) == pytest.approx(want, rel=1e-9)
    assert float(sum(t.sum() for t in plain)) == pytest.approx(float(sum(t.sum() for t in terms)), rel=1e-9)
    actor = ActorSpecialization(AlgorithmConfig(policy_loss="my_loss"))
    assert actor.policy_loss_traits.applies_importance_weights


def test_the_advantage_plugins_returns_become_critic_targets():
    from stacx.trainer.batch import StepBatch
    from stacx.trainer.loop import StacxTrainer

    lengths = [2, 3]
    rollout = {"rewards": torch.tensor([1.0, 3.0]), "response_lengths": lengths,
               "loss_masks": [torch.ones(n) for n in lengths], "prompt_id": [0, 0]}
    advantages = get_advantage("my_advantage")(AlgorithmConfig(), rollout)
    assert [a.tolist() for a in advantages] == [[-1.0, -1.0], [1.0, 1.0, 1.0]]
    assert [r.tolist() for r in advantages.returns] == [[-1.0, -1.0], [1.0, 1.0, 1.0]]
    batch = StepBatch(tokens=[torch.zeros(n + 1, dtype=torch.long) for n in lengths], rewards=[1.0, 3.0],
                      prompt_id=[0, 0], response_lengths=lengths, loss_masks=[torch.ones(n) for n in lengths],
                      rollout_log_probs=[torch.zeros(n) for n in lengths])
    trainer = SimpleNamespace(algorithm=AlgorithmConfig(advantage_estimator="my_advantage"),
                              training_config=SimpleNamespace(roles=[SimpleNamespace(outputs_values=True)]))
    StacxTrainer.compute_advantages(trainer, batch)
    assert [r.tolist() for r in batch.returns] == [[-1.0, -1.0], [1.0, 1.0, 1.0]]


def test_the_yaml_and_python_config_select_the_loss_by_name_and_accept_adv_estimator():
    import yaml

    from stacx import StacxConfig
    from stacx.trainer.factory import resolve_recipe
    from stacx.trainer.config.run import RunConfig

    from_yaml = RunConfig.from_dict(yaml.safe_load((SEED_001 / "my_algorithm.yaml").read_text()), source="my_algorithm.yaml")
    from_python = StacxConfig(model_path="some/model", algorithm={"name": "my_loss", "adv_estimator": "my_advantage",
                                                                 "clip_ratio": 0.2})
    assert from_python.model.hf_checkpoint == "some/model"
    for run_config in (from_yaml, from_python):
        recipe, algorithm = resolve_recipe(run_config)
        assert recipe.name == "grpo"
        assert (algorithm.policy_loss, algorithm.advantage_estimator, algorithm.clip_ratio) == ("my_loss", "my_advantage", 0.2)
        assert algorithm.given_keys == {"policy_loss", "advantage_estimator", "clip_ratio", "clip_ratio_low", "clip_ratio_high"}
    with pytest.raises(ValueError, match="StacxConfig: algorithm must be a mapping"):
        StacxConfig(algorithm=["my_loss"])


def test_the_plugins_own_entropy_metric_is_kept_beside_the_frameworks():
    """`reinforce_pg` logs its own `entropy` (mean of -log pi); the framework's (the policy's
    entropy H) was written over it. Now the plugin's keeps its name, the framework's is `entropy_framework`."""
    from stacx.parallel.groups import ProcessGroups
    from tests.specializations.cases import VOCAB, Case, make_samples, run_case

    samples = make_samples()
    total = sum(len(s) for s in samples["sequences"])
    logits = 2.0 * torch.randn(total, VOCAB, generator=torch.Generator().manual_seed(5))
    case = Case("ActorSpecialization", dict(policy_loss="reinforce_pg", loss_agg_mode="token-mean"),
                ("loss_masks", "advantages"), reference=None)
    metrics = run_case(lambda tokens, padded: logits.clone().requires_grad_(), ProcessGroups.single_process(), case,
                       samples)["metrics"]

    neg_log_prob, entropy = 0.0, 0.0
    for row, (sequence, response, mask) in enumerate(zip(samples["sequences"], samples["response_lengths"],
                                                         samples["loss_masks"])):
        start = sum(len(s) for s in samples["sequences"][:row])
        log_softmax = torch.log_softmax(logits[start + len(sequence) - response - 1: start + len(sequence) - 1].double(), -1)
        neg_log_prob -= float((log_softmax.gather(-1, sequence[-response:, None]).squeeze(-1) * mask).sum())
        entropy += float((-(log_softmax.exp() * log_softmax).sum(-1) * mask).sum())
    assert abs(neg_log_prob - entropy) > 0.1 * entropy  # the two are different quantities here
    assert float(metrics["entropy"]) == pytest.approx(neg_log_prob, rel=1e-4)
    assert float(metrics["entropy_framework"]) == pytest.approx(entropy, rel=1e-4)


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_in_a_flux_style_algorithm_section_name_is_the_policy_loss_even_where_it_names_a_recipe(name):
    """`algorithm: {name: ppo, adv_estimator: grpo}` picked the two-role PPO recipe (a critic); Flux
    users mean the PPO-clip loss. It now selects the loss, with a warning saying how to get the recipe."""
    import warnings

    from stacx.launch.run_flags import merge_run_config
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.factory import resolve_recipe

    flux = {"algorithm": {"name": name, "adv_estimator": "grpo", "clip_ratio": 0.2}}
    with pytest.warns(UserWarning, match=rf"algorithm.name '{name}' is taken as the policy loss.*--algorithm {name}"):
        recipe, algorithm = resolve_recipe(RunConfig.from_dict(flux, source="flux.yaml"))
    assert (recipe.name, algorithm.policy_loss, algorithm.advantage_estimator) == ("grpo", name, "grpo")
    # --algorithm still names the recipe, beside the file's loss.
    run_config = merge_run_config(flux, {"train": {"algorithm": "dr_grpo"}}, file_source="flux.yaml")
    with pytest.warns(UserWarning, match="the recipe is 'dr_grpo'"):
        recipe, algorithm = resolve_recipe(run_config)
    assert (recipe.name, algorithm.policy_loss) == ("dr_grpo", name)
    # Outside a Flux-style section the recipe has one field, train.algorithm: algorithm.name is refused.
    with pytest.raises(ValueError, match=rf"algorithm.name in config: .*train: {{algorithm: {name}}}.*--algorithm {name}"):
        RunConfig.from_dict({"algorithm": {"name": name}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe, _ = resolve_recipe(RunConfig.from_dict({"train": {"algorithm": name}}))
    assert recipe.name == name


def test_a_flux_style_name_that_is_only_a_recipe_stays_the_recipe_and_an_unknown_one_is_named():
    import warnings

    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.factory import resolve_recipe

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe, algorithm = resolve_recipe(RunConfig.from_dict({"algorithm": {"name": "rloo", "adv_estimator": "grpo"}}))
    assert (recipe.name, algorithm.policy_loss) == ("rloo", "ppo_clip")
    with pytest.raises(ValueError, match=r"algorithm.name 'ppo_clp'.*Flux-style.*did you mean 'ppo_clip'\?"):
        resolve_recipe(RunConfig.from_dict({"algorithm": {"name": "ppo_clp", "adv_estimator": "grpo"}}))
