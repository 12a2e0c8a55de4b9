"""Fast checks of the loop's pieces that need no workers: algorithm resolution, micro-batch plans,
launcher detection, unsupported-recipe errors, engine selection, the critic's value head."""

from __future__ import annotations

import pytest
import torch

from stacx.trainer.recipes import get_recipe
from stacx.trainer.config.resolve import resolve_algorithm_config
from stacx.trainer.config.run import RunConfig
from stacx.trainer.step_data import dpo_batch, plan_micro_batches, sft_batch


def test_recipe_defaults_yield_to_user_values_only_where_the_user_set_them():
    ppo = get_recipe("ppo")
    resolved = resolve_algorithm_config(ppo, RunConfig.from_dict({"algorithm": {"name": "ppo", "my_knob": 3}}))
    assert resolved.lam == 0.95 and resolved.value_clip == 0.5  # ppo's defaults, not the generic 1.0 / 0.2
    assert resolved.my_knob == 3 and resolved.name == "ppo"
    user = resolve_algorithm_config(ppo, RunConfig.from_dict({"lam": 0.5, "clip_ratio_high": 0.3,
                                                              "rollout_temperature": 0.7}))
    assert user.lam == 0.5 and user.clip_ratio_high == 0.3 and user.clip_ratio_low == 0.2
    assert user.rollout_temperature == 0.7  # the actor's training log-probs use the sampling temperature
    gspo = resolve_algorithm_config(get_recipe("gspo"), RunConfig())
    assert (gspo.clip_ratio_low, gspo.clip_ratio_high) == (3e-4, 4e-4)


def _example(prompt, chosen, rejected):
    from stacx.rollout.data import Example

    return Example(prompt_ids=prompt, source="test", chosen_ids=chosen, rejected_ids=rejected)


def test_plan_keeps_dpo_pairs_together_and_balances_ranks():
    batch = dpo_batch([_example([1, 2], [3] * n, [4] * (5 - n)) for n in (1, 2, 3, 4)])
    plan = plan_micro_batches(batch, dp_size=2, cp_size=1, max_tokens_per_micro_batch=20)
    assert len(plan) == 2 and len(plan[0]) == len(plan[1])
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == list(range(8))
    for rank in plan:
        for mb in rank:
            pairs = [batch["pair_ids"][i] for i in mb]
            assert all(pairs.count(p) == 2 for p in pairs)  # chosen and rejected share the micro-batch


def test_plan_errors_name_the_problem():
    batch = sft_batch([[1, 2]] * 2, [[3, 4, 5]] * 2)
    with pytest.raises(ValueError, match="2 samples .* for 4 data-parallel ranks"):
        plan_micro_batches(batch, dp_size=4, cp_size=1, max_tokens_per_micro_batch=64)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=4"):
        plan_micro_batches(batch, dp_size=1, cp_size=1, max_tokens_per_micro_batch=4)
    # Under CP every sample is padded to a multiple of 2*cp before it is packed.
    # 5 + 5 tokens fit a budget of 12 at cp=1; padded to 8 + 8 at cp=2 they need two micro-batches.
    assert plan_micro_batches(batch, dp_size=1, cp_size=1, max_tokens_per_micro_batch=12) == [[[0, 1]]]
    assert sorted(plan_micro_batches(batch, dp_size=1, cp_size=2, max_tokens_per_micro_batch=12)[0]) == [[0], [1]]


def test_torchrun_is_detected_from_its_environment():
    from stacx.trainer.spmd import launched_by_torchrun

    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launched_by_torchrun({**base, "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"})
    assert not launched_by_torchrun(base)  # e.g. a Ray worker's variables
    assert not launched_by_torchrun({})


def test_bad_rollin_settings_are_refused_before_any_worker_starts():
    from stacx.trainer.factory import check_supported

    # Live roll-ins run (tests/trainer/test_loop_rollout_dagger.py); a bad schedule or mode fails at start.
    check_supported(get_recipe("mixture_dagger_opd"), RunConfig())
    check_supported(get_recipe("online_dagger"), RunConfig())
    with pytest.raises(ValueError, match="dagger_beta_start"):
        check_supported(get_recipe("mixture_dagger_opd"), RunConfig.from_dict({"dagger_beta_start": 1.5}))
    with pytest.raises(ValueError, match="dagger_sampling_mode"):
        check_supported(get_recipe("mixture_aggrevate_opd"), RunConfig.from_dict({"dagger_sampling_mode": "gamma"}))


def test_engine_kind_resolution():
    from stacx.rollout.service import engine_client, resolve_engine_kind

    assert resolve_engine_kind("auto") == ("sglang" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="rollout_engine 'vllm'"):
        resolve_engine_kind("vllm")
    from stacx.rollout.engines.sglang import SglangEngine

    assert isinstance(engine_client("sglang", "http://127.0.0.1:1"), SglangEngine)
    assert type(engine_client("cpu", "http://127.0.0.1:1")).__name__ == "HttpEngine"


def test_value_head_matches_a_linear_map_of_the_final_hidden_states():
    from stacx.trainer.runtime.value_head import ValueHead

    head = ValueHead(4, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=torch.float64))
        head.bias.fill_(0.25)
    hidden = torch.randn(3, 1, 4, dtype=torch.float64)
    values, bias = head(hidden, weight=torch.ones(9, 4))
    assert bias is None and values.shape == (3, 1, 1)
    expected = hidden[..., 0] - 2 * hidden[..., 1] + 0.5 * hidden[..., 2] + 0.25
    assert torch.allclose(values[..., 0], expected)


def test_a_failed_weight_push_reports_its_own_error_and_resumes_the_engine():
    """The push's error propagates (not a stale-version error from the version check), and the
    engine is resumed without checking a version it never received."""
    from types import SimpleNamespace

    from stacx.rollout.service import RolloutService
    from stacx.trainer.loop import StacxTrainer

    class Engine:
        def __init__(self):
            self.calls = []

        def pause(self):
            self.calls.append("pause")

        def resume(self):
            self.calls.append("resume")

        def flush_cache(self):
            self.calls.append("flush")

        def weight_version(self):
            return 0  # never reached: the version check is skipped after a failed push

    class FailingPolicy:
        def call_all(self, method, *args):
            raise RuntimeError("policy rank 1 died while pushing bucket 3")

    engine = Engine()
    service = RolloutService(engine, engine_kind="http", url="http://engine", tokenizer=None, rollout_section=None)
    trainer = SimpleNamespace(engine_target=("http", ("http://engine",), None), rollout=service,
                              channel=SimpleNamespace(is_driver=True), roles={"actor": FailingPolicy()},
                              training_config=SimpleNamespace(rollout_role=SimpleNamespace(name="actor")))
    with pytest.raises(RuntimeError, match="died while pushing bucket 3"):
        StacxTrainer.push_policy_weights(trainer, version=4)
    assert engine.calls == ["pause", "resume"]


def test_a_rollout_service_that_fails_to_start_stops_the_server_it_started(monkeypatch):
    from types import SimpleNamespace

    from stacx.rollout import service as rollout_service

    stopped = []

    class FakeServer:
        def __init__(self, hf_checkpoint, *, seed, api_key=None):
            self.url = "http://127.0.0.1:1"

        def stop(self):
            stopped.append(self.url)

    monkeypatch.setattr(rollout_service, "CpuServerProcess", FakeServer)
    run_config = RunConfig.from_dict({"rollout_engine": "cpu", "hf_checkpoint": "tiny"})
    distill = SimpleNamespace(name="opd", uses_teacher=True)
    with pytest.raises(ValueError, match="--teacher-url"):
        rollout_service.RolloutService.start(run_config, distill, tokenizer=object())
    assert stopped == ["http://127.0.0.1:1"]


def test_teardown_errors_never_hide_the_runs_error_and_workers_are_always_released():
    from types import SimpleNamespace

    from stacx.trainer.loop import StacxTrainer

    released = []

    class BrokenRollout:
        def close(self):
            raise OSError("engine socket already gone")

    def trainer_with(failing_step):
        trainer = StacxTrainer.__new__(StacxTrainer)
        trainer.run_config = SimpleNamespace(model=SimpleNamespace(load=None, save=None, overwrite=False))
        trainer.channel = SimpleNamespace(is_driver=False)
        trainer.make_metrics_logger, trainer.metrics_logger = None, None
        trainer.engine_target, trainer.rollout = None, BrokenRollout()
        trainer.on_failure = lambda: released.append("killed")
        trainer.on_close = lambda: released.append("shut down")
        trainer.run_config.train = SimpleNamespace(num_steps=1, export_hf=None)
        trainer.train_one_step = failing_step
        return trainer

    def failing(step):
        raise RuntimeError("role 'actor' rank 0 failed")

    with pytest.raises(RuntimeError, match="rank 0 failed"):
        trainer_with(failing).run()
    assert released == ["killed"]
    released.clear()
    trainer = trainer_with(lambda step: {})
    trainer.log, trainer.should_save = (lambda step, metrics: None), (lambda step: False)
    with pytest.raises(OSError, match="socket already gone"):
        trainer.run()
    assert released == ["shut down"]  # the workers went down although the engine's close failed
