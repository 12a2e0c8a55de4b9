"""Reward functions run under a per-call timeout: a hanging one is cut off with its name and sample,
and it never keeps the process alive (Ctrl-C / exit are not blocked by its thread)."""

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from stacx.rollout.rewards import (RewardTimeoutError, batched_reward, compute_rewards, resolve_reward_fn,
                                   reward_needs_label, reward_timeout)


def sleeps_forever(response, label, metadata):
    if response == "hang":
        threading.Event().wait()
    return 1.0


def test_a_hanging_reward_is_cut_off_naming_the_function_and_the_sample():
    started = time.monotonic()
    with pytest.raises(RewardTimeoutError) as caught:
        compute_rewards(sleeps_forever, ["ok", "hang", "ok"], ["a", "b", "c"], timeout_s=0.5)
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert "sleeps_forever" in message and "sample 1" in message and "'hang'" in message


def test_the_decorator_sets_the_timeout_and_batched_functions_are_covered():
    @reward_timeout(0.3)
    @batched_reward
    def slow_batch(responses, labels, metadatas):
        threading.Event().wait()

    with pytest.raises(RewardTimeoutError, match="slow_batch.*batch of 2 samples"):
        compute_rewards(slow_batch, ["x", "y"], [None, None])
    with pytest.raises(ValueError, match="seconds must be > 0"):
        reward_timeout(0)


def test_fast_rewards_and_contained_errors_are_unchanged():
    def flaky(response, label, metadata):
        if response == "boom":
            raise KeyError("x")
        return float(response == label)

    results = compute_rewards(flaky, ["1", "boom", "2"], ["1", "1", "1"], max_workers=2, timeout_s=5)
    assert [r.reward for r in results] == [1.0, 0.0, 0.0]
    assert results[1].error.startswith("KeyError") and results[0].error is None


def test_builtin_label_rewards_declare_it():
    assert reward_needs_label(resolve_reward_fn("exact_match")) and reward_needs_label(resolve_reward_fn("math"))
    assert not reward_needs_label(resolve_reward_fn("format"))


@pytest.mark.slow
def test_a_process_with_a_hanging_reward_still_exits():
    # Before: the pool's non-daemon thread was joined at exit, so the process never ended.
    script = textwrap.dedent("""
        import threading
        from stacx.rollout.rewards import compute_rewards, RewardTimeoutError
        def hang(response, label, metadata):
            threading.Event().wait()
        try:
            compute_rewards(hang, ["a", "b"], [1, 2], timeout_s=0.2)
        except RewardTimeoutError as err:
            print("timed out:", err)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "timed out: reward function" in done.stdout


def test_the_run_configs_reward_timeout_reaches_the_manager():
    from types import SimpleNamespace

    from stacx.rollout.manager import RolloutManager
    from stacx.trainer.config.run import ConfigError, RunConfig

    manager = RolloutManager(engine=None, reward_fn=sleeps_forever, reward_timeout_s=0.3)
    hanging = SimpleNamespace(response_text="hang", label=None, metadata={})
    with pytest.raises(RewardTimeoutError, match=r"within 0.3 s on sample 0"):
        manager.score_rewards([hanging])
    assert RunConfig.from_dict({"reward_timeout_s": 5}).rollout.reward_timeout_s == 5.0
    with pytest.raises(ConfigError, match="--reward-timeout-s"):
        RunConfig.from_dict({"reward_timeout_s": 0})

    from stacx.rollout.service import RolloutService

    service = RolloutService(None, engine_kind="http", url="http://engine", tokenizer=None,
                             rollout_section=RunConfig.from_dict({"reward_timeout_s": 7, "reward_fn": "format"}).rollout)
    assert service.manager(0).reward_timeout_s == 7.0
