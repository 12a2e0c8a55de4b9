"""Exchange syncs without workers: recipe checks, sender choice, the schedule, and the `weights`
payload round trip (produce on one model, consume into another) in a single process."""

from __future__ import annotations

import types

import pytest
import torch

from stacx.specializations.actor import ActorSpecialization
from stacx.specializations.critic import CriticSpecialization
from stacx.trainer.config.recipe import AlgorithmDefaults, ExchangeSync, ModelRole, TrainingConfig
from stacx.trainer.config.layout import RankCoords
from stacx.trainer.exchange import ExchangeSchedule, check_exchange_syncs, sources_by_target
from stacx.trainer.runtime.exchange_payloads import consume_hf_weights, produce_hf_weights
from stacx.trainer.recipes import get_recipe


def _recipe(*, keys=("weights",), target_trainable=False, target_cls=ActorSpecialization, every_n_steps=3):
    return TrainingConfig(
        name="exchange_case",
        roles=(ModelRole(name="policy", specialization_cls=ActorSpecialization, sync_to_rollout=True),
               ModelRole(name="shadow", specialization_cls=target_cls, trainable=target_trainable,
                         shares_pool_with="policy")),
        syncs=(ExchangeSync(source_role="policy", target_role="shadow", keys=keys, every_n_steps=every_n_steps),),
        description="test recipe",
        algorithm=AlgorithmDefaults(advantage_estimator="grpo"),
        uses_reward=True,
    )


def test_recipe_checks_name_the_sync_and_the_problem():
    check_exchange_syncs(get_recipe("grpo_reference_refresh"))
    check_exchange_syncs(_recipe())
    with pytest.raises(ValueError, match=r"recipe 'exchange_case'.*policy -> shadow.*'optimizer_state'.*known keys: weights"):
        check_exchange_syncs(_recipe(keys=("optimizer_state",)))
    with pytest.raises(ValueError, match=r"frozen role; 'shadow' is trainable"):
        check_exchange_syncs(_recipe(target_trainable=True))
    with pytest.raises(ValueError, match=r"'shadow' has a value head"):
        check_exchange_syncs(_recipe(target_cls=CriticSpecialization))


def test_the_reference_refresh_recipe_injects_reference_log_probs_and_refreshes_weights():
    config = get_recipe("grpo_reference_refresh")
    graph = config.role_graph()
    assert [(s.source_role, s.target_role, s.keys) for s in graph.inject_syncs] == [("reference", "policy", ("ref_log_probs",))]
    assert [(s.source_role, s.target_role, s.keys) for s in graph.exchange_syncs] == [("policy", "reference", ("weights",))]
    assert not config.role("reference").trainable and config.role("policy").reference_checkpoint_arg is None
    assert config.algorithm.use_kl_loss


def test_senders_are_tp0_cp0_ranks_round_robin():
    # tp=2, cp=2, dp=2 in megatron rank order (tp fastest, then cp, then dp)
    coords = [RankCoords(tp_rank=r % 2, cp_rank=(r // 2) % 2, dp_rank=r // 4) for r in range(8)]
    assert sources_by_target(coords, 3, tp_rank0_only=True) == [0, 4, 0]
    assert sources_by_target(coords, 3, tp_rank0_only=False) == [0, 1, 2]


class _Group:
    def __init__(self, coords):
        self.coords = coords


def test_schedule_runs_every_n_steps_and_the_run_flag_overrides_it():
    config = _recipe(every_n_steps=3)
    roles = {"policy": _Group([RankCoords(tp_rank=0, cp_rank=0, dp_rank=0)]), "shadow": _Group([])}
    schedule = ExchangeSchedule(config, {"policy_to_shadow": object()}, roles)
    sync = schedule.syncs[0]
    assert [s for s in range(7) if schedule.is_due(sync, s)] == [3, 6]
    overridden = ExchangeSchedule(config, {"policy_to_shadow": object()}, roles, every_n_steps_override=2)
    assert [s for s in range(7) if overridden.is_due(sync, s)] == [2, 4, 6]
    with pytest.raises(NotImplementedError, match=r"policy_to_shadow.*not connected.*torchrun"):
        ExchangeSchedule(config, None, roles)
    with pytest.raises(ValueError, match="exchange_every_n_steps must be >= 0"):
        ExchangeSchedule(config, {}, roles, every_n_steps_override=-1)
    assert ExchangeSchedule(get_recipe("grpo"), None, {}).run_due(5) == {}  # no exchange syncs: nothing to do


def _runtime(model, groups, name):
    from stacx.models import iter_hf_weight_buckets

    return types.SimpleNamespace(
        model=model, groups=groups, role=types.SimpleNamespace(name=name),
        weight_buckets=lambda bucket_bytes, only_to_tp_rank=0: iter_hf_weight_buckets(
            model, groups, bucket_bytes, only_to_tp_rank=only_to_tp_rank))


@pytest.fixture(scope="module")
def groups():
    """This process as a one-rank world (megatron-core builds layers from its global groups)."""
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.serving.cpu_engine import ensure_single_process_layout

    yield ensure_single_process_layout()
    destroy_parallel_layout()


@pytest.mark.parametrize("tied", [False, True])
def test_weights_payload_round_trip_is_bitwise(groups, tied):
    from stacx.models import build_model
    from stacx.models.testing import tiny_hf_config

    config = tiny_hf_config("llama", tie_word_embeddings=tied)
    torch.manual_seed(0)
    source = build_model(config, groups)
    torch.manual_seed(1)
    target = build_model(config, groups)
    assert any(not torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters()))
    tensors = produce_hf_weights(_runtime(source, groups, "policy"))
    assert ("lm_head.weight" in tensors) is (not tied)
    assert consume_hf_weights(_runtime(target, groups, "reference"), tensors) == len(tensors)
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert torch.equal(a, b), name
    incomplete = dict(tensors)
    incomplete.pop("model.norm.weight")
    with pytest.raises(ValueError, match=r"role 'reference': weight exchange is missing tensors \['model.norm.weight'\]"):
        consume_hf_weights(_runtime(target, groups, "reference"), incomplete)
