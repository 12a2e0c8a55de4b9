"""PPO with LoRA (--lora-rank) on the actor and the critic as --lora-critic says (stacx.trainer.config.critic_modes).

One forked gloo rank resolves the ppo recipe from a run config for each --lora-critic mode, builds the actor's and
the critic's `RoleRuntime` from it, and trains three steps of every role the recipe trains (the critic on returns
and the values it computed first, the actor on the same batch):
- the actor's base weights are bitwise its start weights, with requires_grad False; its adapters move;
- `full`: every critic parameter is in the optimizer and moves;
- `adapters`: the critic's base weights are bitwise its start weights; its adapters and its value head (a new
  layer, trained as PEFT's modules_to_save) are all the optimizer holds, and they move;
- `frozen`: the recipe trains the actor only; the critic has no optimizer, no parameter needing a gradient, and
  its weights stay bitwise its start weights.
Plus the configuration errors, which name --lora-critic.
"""

from __future__ import annotations

import pytest
import torch

from stacx.testing.distributed import run_distributed



LORA = {"lora_rank": 4, "lora_alpha": 8.0}
MODES = ("full", "adapters", "frozen")


def _snapshot(runtime) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in runtime.model.named_parameters()}


def _role_report(runtime, before: dict[str, torch.Tensor]) -> dict:
    """Which parameters need gradients, are in the optimizer and moved, by kind (base, adapter, value head)."""
    from stacx.models.lora import is_adapter_param_name

    optimized = set() if runtime.optimizer is None else {
        id(p) for group in runtime.optimizer.param_groups for p in group["params"]}

    def kind(name):
        if is_adapter_param_name(name):
            return "adapter"
        return "head" if name.startswith("output_layer.") else "base"

    report = {}
    for name, param in runtime.model.named_parameters():
        entry = report.setdefault(kind(name), {"grad": [], "optimized": [], "moved": [], "count": 0})
        entry["count"] += 1
        entry["grad"].append(param.requires_grad)
        entry["optimized"].append(id(param) in optimized)
        entry["moved"].append(not torch.equal(param.detach(), before[name]))
    return {kind: {"count": e["count"], "grad": sorted(set(e["grad"])), "optimized": sorted(set(e["optimized"])),
                   "moved": sorted(set(e["moved"]))} for kind, e in report.items()}


def train_ppo_per_critic_mode(groups, checkpoint: str) -> dict:
    from stacx.parallel.reduction import compute_step_counts
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.factory import resolve_recipe
    from stacx.trainer.runtime.role_runtime import RoleRuntime
    from tests.trainer.runtime.test_lm_head_mode import step_batch

    results = {}
    for mode in MODES:
        run_config = RunConfig.from_dict({"train": {"algorithm": "ppo"}, "hf_checkpoint": checkpoint,
                                          "clip_grad": 0.0, "lr": 1e-2, "lora_critic": mode, **LORA})
        recipe, algorithm = resolve_recipe(run_config)
        runtimes = {role.name: RoleRuntime(role, algorithm, groups, model=run_config.model, optim=run_config.optim,
                                           train=run_config.train, rank=0) for role in recipe.roles}
        before = {name: _snapshot(runtime) for name, runtime in runtimes.items()}
        batch = step_batch()
        values = runtimes["critic"].compute_fields([batch], ["values"])[0]["values"]
        batch.values = values
        batch.returns = [v + a for v, a in zip(values, batch.advantages)]
        counts = compute_step_counts(batch.loss_masks, groups.dp)
        # A zero value head passes the critic's adapters no gradient in the first step, and B = 0 none to A in the
        # second: the third moves every adapter.
        for _ in range(3):
            for role in recipe.trainable_roles:
                runtimes[role.name].train_step([batch], counts)
        results[mode] = dict(trained=[role.name for role in recipe.trainable_roles],
                             critic_has_optimizer=runtimes["critic"].optimizer is not None,
                             **{name: _role_report(runtime, before[name]) for name, runtime in runtimes.items()})
    return results


@pytest.fixture(scope="module")
def ppo_results(tmp_path_factory):
    from stacx.models.testing import save_tiny_hf_checkpoint

    path = str(tmp_path_factory.mktemp("ppo_lora") / "qwen3")
    save_tiny_hf_checkpoint(path, "qwen3", seed=3, vocab_size=101)
    return run_distributed(train_ppo_per_critic_mode, 1, args=(path,), timeout_s=300)[0]


FROZEN_UNMOVED = {"grad": [False], "optimized": [False], "moved": [False]}
TRAINED = {"grad": [True], "optimized": [True], "moved": [True]}


def _without_count(entry: dict) -> dict:
    return {key: value for key, value in entry.items() if key != "count"}


@pytest.mark.slow  # one spawn that trains (about 18 s of CPU)
@pytest.mark.distributed
@pytest.mark.parametrize("mode", MODES)
def test_the_lora_actor_trains_only_its_adapters_whatever_the_critic_does(ppo_results, mode):
    actor = ppo_results[mode]["actor"]
    assert _without_count(actor["base"]) == FROZEN_UNMOVED
    assert _without_count(actor["adapter"]) == TRAINED and actor["adapter"]["count"] > 0


@pytest.mark.slow  # one spawn that trains (about 18 s of CPU)
@pytest.mark.distributed
def test_a_full_critic_trains_every_parameter(ppo_results):
    result = ppo_results["full"]
    assert result["trained"] == ["actor", "critic"]
    assert "adapter" not in result["critic"]
    for kind in ("base", "head"):
        assert _without_count(result["critic"][kind]) == TRAINED, kind


@pytest.mark.slow  # one spawn that trains (about 18 s of CPU)
@pytest.mark.distributed
def test_an_adapted_critic_trains_its_adapters_and_value_head_only(ppo_results):
    result = ppo_results["adapters"]
    assert result["trained"] == ["actor", "critic"]
    critic = result["critic"]
    assert _without_count(critic["base"]) == FROZEN_UNMOVED
    assert _without_count(critic["adapter"]) == TRAINED and critic["adapter"]["count"] > 0
    assert _without_count(critic["head"]) == TRAINED


@pytest.mark.slow  # one spawn that trains (about 18 s of CPU)
@pytest.mark.distributed
def test_a_frozen_critic_is_not_trained_and_holds_no_optimizer(ppo_results):
    result = ppo_results["frozen"]
    assert result["trained"] == ["actor"]
    assert not result["critic_has_optimizer"]
    assert "adapter" not in result["critic"]
    for kind in ("base", "head"):
        assert _without_count(result["critic"][kind]) == FROZEN_UNMOVED, kind


@pytest.mark.parametrize("values, message", [
    ({"lora_critic": "adapters"}, "--lora-critic adapters needs --lora-rank > 0"),
    ({"lora_critic": "frozen", "lora_rank": 0}, "--lora-critic frozen needs --lora-rank > 0"),
    ({"lora_critic": "half", **LORA}, "--lora-critic"),
])
def test_invalid_critic_modes_name_the_flag(values, message):
    from stacx.trainer.config.run import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict({"train": {"algorithm": "ppo"}, **values})


def test_a_critic_mode_on_a_recipe_without_a_critic_is_refused():
    from stacx.trainer.config.critic_modes import CriticModeError
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.factory import resolve_recipe

    with pytest.raises(CriticModeError, match="--lora-critic frozen: recipe 'grpo' has no critic"):
        resolve_recipe(RunConfig.from_dict({"train": {"algorithm": "grpo"}, "lora_critic": "frozen", **LORA}))
    recipe, _ = resolve_recipe(RunConfig.from_dict({"train": {"algorithm": "grpo"}, **LORA}))  # full: no-op
    assert recipe.name == "grpo"
