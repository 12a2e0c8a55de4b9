"""`--rollout-mode async` in the loop, in-process: a real `StacxTrainer`, `RolloutService`, `StepRollout`
and `AsyncRollout` over a scripted engine (seeded tokens that depend on the weight version it serves,
abortable between tokens) and a fake policy whose "loss" and "weights" digest every batch it trains.

- K = 0 trains the same batches as a sync run: equal losses and final weights (digests), bitwise;
- K >= 1: every trained group within its bound, and generation overlaps training (staleness 1 seen);
- partial rollout: interrupted groups are continued, a continued response holds tokens of two versions;
- Ctrl-C (KeyboardInterrupt in a step) and the normal end leave no producer thread;
- the refusals of `check_async_supported`.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest
import torch

from stacx.rollout.asynchronous.async_rollout import AsyncRollout, check_async_supported, prompt_sample_seed
from stacx.rollout.data import Example
from stacx.rollout.manager import RolloutManager
from stacx.rollout.service import RolloutService
from stacx.rollout.tokenizer import build_char_tokenizer
from stacx.trainer.checkpoint import write_rank_state
from stacx.trainer.config.rollout_plan import rollout_plan
from stacx.trainer.config.run import RunConfig
from stacx.trainer.recipes import get_recipe
from stacx.wire.engine import InferenceEngine
from stacx.wire.types import GenerateOutput, SamplingParams
from tests.trainer.fakes import FakeRoleGroup, make_trainer
from tests.trainer.test_loop_mini_batches import RecordingLogger

TOKENIZER = build_char_tokenizer()


class ScriptedEngine(InferenceEngine):
    """Tokens drawn from Random((seed, served version)); `token_s` seconds per token; abortable by rid."""

    def __init__(self, token_s: float = 0.0):
        self.version, self.token_s = 0, token_s
        self.running: dict[str, list[bool]] = {}
        self.lock = threading.Lock()
        self.continued = 0
        # hold_step = s: step s's requests under version 0 stop after their first token until aborted (the update
        # window of step s - 1 aborts them), so a group is in flight at that update whatever the thread timing
        self.hold_step, self.first_seed_of_step = None, lambda step: 0

    def generate(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        version = self.version
        flag = [False]
        if request.rid is not None:
            with self.lock:
                self.running[request.rid] = flag
        rng = random.Random(request.sampling.seed * 7919 + version)
        length = 1 + rng.randrange(request.sampling.max_new_tokens)
        tokens, log_probs, reason = [], [], "length"
        try:
            for _ in range(length):
                if flag[0]:
                    reason = "abort"
                    break
                time.sleep(self.token_s)
                token = rng.randrange(4, 40)
                tokens.append(token)
                log_probs.append(-0.05 * (1 + token % 5) - 0.01 * version)
                while self._held(request, version) and not flag[0]:  # released by the abort of the update window
                    time.sleep(0.001)
        finally:
            with self.lock:
                self.running.pop(request.rid, None)
        return GenerateOutput(output_ids=tokens, output_log_probs=log_probs, finish_reason=reason,
                              output_token_versions=[version] * len(tokens), weight_version=version)

    def abort(self, rids=None):
        with self.lock:
            for rid, flag in self.running.items():
                if rids is None or rid in rids:
                    flag[0] = True

    def _held(self, request, version) -> bool:
        if self.hold_step is None or version != 0:
            return False
        return self.first_seed_of_step(self.hold_step) <= request.sampling.seed < self.first_seed_of_step(self.hold_step + 1)

    def update_weights(self, buckets, *, version):
        self.version = version

    def weight_version(self):
        return self.version

    def pause(self):
        pass

    def resume(self):
        pass

    def flush_cache(self):
        pass

    def health(self):
        return True


class Prompts:
    """Six prompts in a fixed order, `batch_size` per step (the data source's interface)."""

    kind = "prompt"

    def __init__(self, batch_size: int, metadata: dict | None = None):
        self.batch_size, self.index = batch_size, 0
        self.examples = [Example(prompt_ids=[5 + i, 6, 7], source="t", label=None, metadata=dict(metadata or {}))
                         for i in range(6)]

    def next_examples(self, count=None):
        count = self.batch_size if count is None else count
        out = [self.examples[(self.index + k) % len(self.examples)] for k in range(count)]
        self.index += count
        return out

    @property
    def prompt_index(self):
        return self.index

    def state_at(self, index):
        return {"index": index}

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


def wait_until_the_producer_is_idle(trainer) -> None:
    """Until the producer can admit nothing more and no group runs (nothing changes until the trainer acts)."""
    scheduler = trainer.async_rollout.scheduler
    while scheduler.can_admit() or scheduler.counts()["running"]:
        time.sleep(0.001)


class DigestPolicy(FakeRoleGroup):
    """Its loss is a digest of the batch it trains (tokens, advantages, behaviour log-probs); its
    "weights" chain those digests (saved and loaded with checkpoints); pushing them sets the engine's
    version. `settle`: a step waits until the producer can admit nothing more and nothing runs before
    it updates the weights, so which version generates which group does not depend on thread timing."""

    def __init__(self, engine: ScriptedEngine, train_s: float = 0.0, settle: bool = False):
        super().__init__("policy")
        self.engine, self.train_s, self.settle = engine, train_s, settle
        self.weights = b""
        self.old_log_prob_calls = 0
        self.trainer = None

    def compute_fields(self, shards, names):
        self.old_log_prob_calls += 1  # pi_old: the behaviour log-probs plus a constant (a "newer policy")
        return [[{name: [lp + 0.01 for lp in mb.rollout_log_probs] for name in names} for mb in shards[0]]]

    def train_step(self, shards, counts, norm_length):
        time.sleep(self.train_s)
        if self.settle:
            wait_until_the_producer_is_idle(self.trainer)
        digest = hashlib.sha256()
        for mb in shards[0]:
            for tokens, advantages, log_probs in zip(mb.tokens, mb.advantages, mb.rollout_log_probs):
                digest.update(tokens.numpy().tobytes() + advantages.numpy().tobytes() + log_probs.numpy().tobytes())
        self.weights = hashlib.sha256(self.weights + digest.digest()).digest()
        return [{"loss": int.from_bytes(digest.digest()[:6], "little") / 2**48, "grad_norm": 1.0}]

    def push_weights(self, engine_kind, url, version, bucket_bytes, api_key, check_weights=False):
        self.engine.update_weights([], version=version)
        return [0]

    def save(self, staging_dir):
        return [write_rank_state(staging_dir, "policy", 0, {"weights": self.weights.hex()})]

    def load(self, loaded):
        self.weights = bytes.fromhex(loaded.rank_state("policy", 0)["weights"])


def varied_reward(response: str, label, metadata: dict) -> float:
    return float(sum(ord(c) for c in response) % 5)


def train(mode: str, *, max_staleness: int = 0, partial: bool = False, num_steps: int = 4, token_s: float = 0.0,
          train_s: float = 0.0, max_len: int = 6, fail_at: int | None = None, settle: bool = False,
          settings: dict | None = None, metadata: dict | None = None, hold_step: int | None = None):
    config = RunConfig.from_dict({
        "num_steps": num_steps, "rollout_batch_size": 2, "n_samples_per_prompt": 3, "rollout_max_response_len": max_len,
        "save_rollouts_per_step": 0, "rollout_mode": mode, "max_staleness": max_staleness, "partial_rollout": partial,
        "reward_fn": f"{__name__}:varied_reward", **(settings or {})})
    engine = ScriptedEngine(token_s)
    engine.hold_step = hold_step
    engine.first_seed_of_step = lambda step: prompt_sample_seed(config.rollout.rollout_seed, step * 2, 0,
                                                                prompts_per_step=2, samples_per_prompt=3)
    policy = DigestPolicy(engine, train_s, settle)
    service = RolloutService(engine, engine_kind="cpu", url="scripted", tokenizer=TOKENIZER,
                             rollout_section=config.rollout)
    trainer = make_trainer("grpo", roles={"policy": policy}, run_config=config, rollout=service, data=Prompts(2, metadata))
    logger = RecordingLogger()
    trainer.make_metrics_logger = lambda start: logger
    policy.trainer = trainer
    if fail_at is not None:
        step_once = trainer.train_one_step

        def train_one_step(step):
            if step == fail_at:
                raise KeyboardInterrupt
            return step_once(step)

        trainer.train_one_step = train_one_step
    seen = []
    collect = trainer.collect_batch

    def collect_batch(step):
        if settle:  # every group the bound allows is complete: the batch is the B oldest
            wait_until_the_producer_is_idle(trainer)
        batch, metrics = collect(step)
        seen.append(trainer.async_rollout)
        return batch, metrics

    trainer.collect_batch = collect_batch
    trained = []
    summarize = trainer.step_rollout.summarize
    trainer.step_rollout.summarize = lambda step, samples, metrics: (trained.extend(samples),
                                                                     summarize(step, samples, metrics))
    trainer.run()
    trainer.trained_samples = trained
    return trainer, policy, [row for _, row in logger.rows], seen


def _no_producer_threads() -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not any(t.name == "stacx-async-rollout" for t in threading.enumerate()):
            return True
        time.sleep(0.05)
    return False


def test_max_staleness_0_reproduces_the_sync_runs_losses_and_weights_bitwise():
    _, sync_policy, sync_rows, _ = train("sync")
    _, async_policy, async_rows, producers = train("async", max_staleness=0)
    assert producers[0] is not None  # the async run took its batches from the producer
    assert [row["policy/loss"] for row in async_rows] == [row["policy/loss"] for row in sync_rows]
    assert async_policy.weights == sync_policy.weights
    for sync_row, async_row in zip(sync_rows, async_rows):
        assert async_row["async/staleness_max"] == 0.0 and async_row["async/off_policy_token_frac"] == 0.0
        for key in ("rollout/reward_mean", "rollout/weight_version", "rollout/response_length_mean"):
            assert async_row[key] == sync_row[key], key
    # Not trivial: the engine's tokens follow the version it serves, and the rewards vary.
    assert [row["rollout/weight_version"] for row in sync_rows] == [0.0, 1.0, 2.0, 3.0]
    assert len({row["policy/loss"] for row in sync_rows}) == 4
    assert sync_policy.old_log_prob_calls == async_policy.old_log_prob_calls == 0  # K = 0 resolves like sync
    assert _no_producer_threads()


@pytest.mark.parametrize("max_staleness,steps_per_rollout", [(1, 1), (2, 1), (1, 2)])
def test_no_group_is_trained_beyond_its_bound_and_generation_overlaps_training(max_staleness, steps_per_rollout):
    # settle: each step waits, before its weight update, until the producer has generated all the bound allows
    # (generation overlaps the step), so the staleness reached does not depend on thread timing
    trainer, policy, rows, _ = train("async", max_staleness=max_staleness, num_steps=6, token_s=0.002, settle=True,
                                     settings={"num_steps_per_rollout": steps_per_rollout,
                                               "global_batch_size": 6 // steps_per_rollout})
    rows = [row for row in rows if "async/staleness_max" in row]  # each rollout step's last row
    staleness = [row["async/staleness_max"] for row in rows]
    assert max(staleness) <= max_staleness
    assert max(staleness) >= 1  # batches generated while an earlier step trained
    if max_staleness == 1 and steps_per_rollout == 1:
        assert staleness[1:] == [1.0] * 5  # every later batch was generated at the weights one step back
    assert rows[-1]["async/trained_groups"] == 6 * 2
    # The decoupled objective: the behaviour log-probs weigh the tokens by pi_prox / pi_behav ...
    assert trainer.algorithm.off_policy_corrections == "token_tis"
    if steps_per_rollout == 1:  # ... pi_prox is the weights the step's own forward runs with: no extra forward
        assert not trainer.algorithm.recompute_old_log_probs and policy.old_log_prob_calls == 0
        assert "async/iw_mean" not in rows[0]
    else:  # ... pi_prox is recomputed once before the rollout's first optimizer step
        assert trainer.algorithm.recompute_old_log_probs and policy.old_log_prob_calls == 6
        assert rows[0]["async/iw_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.01))), rel=1e-5)
    assert _no_producer_threads()


def test_partial_rollout_continues_interrupted_groups_under_the_new_weights():
    trainer, _, rows, _ = train("async", max_staleness=1, partial=True, num_steps=5, token_s=0.02, max_len=12,
                                hold_step=1)  # step 1's groups are in flight at the first update, whatever the timing
    assert sum(row["async/interrupted_groups"] for row in rows) >= 1
    continued = [s for s in trainer.trained_samples if len(set(s.metadata["token_versions"])) == 2]
    assert continued  # started under version v, continued under v + 1 after the update
    for sample in continued:
        versions = sample.metadata["token_versions"]
        assert versions == sorted(versions) and len(versions) == len(sample.rollout_log_probs)
    assert max(row["async/staleness_max"] for row in rows) <= 1
    assert rows[-1]["async/interrupts_total"] >= 1
    assert _no_producer_threads()


def test_ctrl_c_in_a_step_closes_the_producer_and_leaves_no_thread():
    with pytest.raises(KeyboardInterrupt):
        train("async", max_staleness=1, num_steps=10, token_s=0.01, fail_at=2)
    assert _no_producer_threads()


def test_seeds_are_the_sync_managers_seeds_of_the_same_prompt():
    manager = RolloutManager(ScriptedEngine(), seed=3 * 100_003 + 5)  # rollout_seed 3, step 5
    seeds = [next(manager._seeds) for _ in range(4 * 2)]  # 4 prompts x 2 samples, prompt-major
    assert seeds == [prompt_sample_seed(3, 5 * 4 + p, j, prompts_per_step=4, samples_per_prompt=2)
                     for p in range(4) for j in range(2)]


@pytest.mark.parametrize("values,recipe,torchrun,engine,match", [
    ({"rollout_mode": "async"}, "sft", False, None, "trains on a dataset"),
    ({"rollout_mode": "async"}, "mixture_dagger_opd", False, None, "roll-ins"),
    ({"rollout_mode": "async", "dynamic_sampling": True}, "grpo", False, None, "dynamic sampling"),
    ({"rollout_mode": "async"}, "grpo", True, "sglang", "engine in its own process"),
    ({"partial_rollout": True}, "grpo", False, None, "add --rollout-mode async"),
])
def test_unsupported_async_combinations_are_refused_naming_the_flag(values, recipe, torchrun, engine, match):
    with pytest.raises(ValueError, match=match) as caught:
        config = RunConfig.from_dict(values)
        check_async_supported(config.rollout, rollout_plan(get_recipe(recipe), config), torchrun=torchrun,
                              engine_kind=engine)
    assert "--rollout-mode async" in str(caught.value)
    config = RunConfig.from_dict({"rollout_mode": "async"})
    check_async_supported(config.rollout, rollout_plan(get_recipe("grpo"), config), torchrun=True, engine_kind="cpu")


def test_a_checkpoint_position_is_the_oldest_untrained_prompt_and_resume_skips_the_trained_ones():
    config = RunConfig.from_dict({"rollout_batch_size": 2, "n_samples_per_prompt": 1, "rollout_max_response_len": 3,
                                  "max_staleness": 0, "rollout_mode": "async", "save_rollouts_per_step": 0})
    service = RolloutService(ScriptedEngine(), engine_kind="cpu", url="scripted", tokenizer=TOKENIZER,
                             rollout_section=config.rollout)
    trainer = make_trainer("grpo", run_config=config, rollout=service, data=Prompts(2))
    producer = AsyncRollout(service, Prompts(2), trainer.step_rollout, rollout_section=config.rollout, start_version=0,
                            resume_state={"trained_prompts_ahead": [1, 3]})
    producer.start()
    try:
        samples, _ = producer.take_batch(0)
        # Prompts 1 and 3 were trained before the checkpoint: the first batch is prompts 0 and 2.
        assert sorted(s.metadata["prompt_index"] for s in samples) == [0, 2]
        # The oldest untrained prompt is 4 (3 was trained before): nothing is admitted until version 1.
        data_state, async_state = producer.checkpoint_state()
        assert data_state["index"] == 4
        assert async_state["trained_prompts_ahead"] == [] and async_state["scheduler"]["groups"] == []
    finally:
        producer.close()
        service.close()
    assert not producer.thread.is_alive()


TIMING_METRICS = ("time/step_s", "async/batch_wait_s", "async/running_groups", "async/buffered_groups",
                  "async/interrupted_groups_waiting")  # durations, and the queue when the batch was taken


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_an_async_run_checkpointed_and_resumed_trains_what_the_uninterrupted_run_trains(tmp_path, max_staleness):
    # Both runs settle before each step (see DigestPolicy), so the uninterrupted schedule is fixed: the
    # groups of step s are generated by version max(0, s - K). The checkpoint of step 2 holds the
    # groups generated for steps 2 .. 2 + K - 1 by versions 2 - K .. 1, which the resumed run's engine
    # (serving version 2) could not regenerate; they are saved and trained from the checkpoint instead.
    _, straight_policy, straight_rows, _ = train("async", max_staleness=max_staleness, num_steps=5, settle=True)
    with pytest.raises(KeyboardInterrupt):
        train("async", max_staleness=max_staleness, num_steps=5, settle=True, fail_at=2,
              settings={"save": str(tmp_path), "save_interval": 2})
    resumed, resumed_policy, resumed_rows, _ = train("async", max_staleness=max_staleness, num_steps=5, settle=True,
                                                     settings={"save": str(tmp_path), "load": str(tmp_path)})
    assert resumed_policy.weights == straight_policy.weights  # every step trained the same batch
    assert [row["policy/loss"] for row in resumed_rows] == [row["policy/loss"] for row in straight_rows[2:]]
    for straight, again in zip(straight_rows[2:], resumed_rows):
        assert {k: v for k, v in again.items() if k not in TIMING_METRICS} == \
            {k: v for k, v in straight.items() if k not in TIMING_METRICS}
    # Not trivial: the first resumed step trains groups the previous weights generated.
    assert resumed_rows[0]["async/staleness_max"] == max_staleness == straight_rows[2]["async/staleness_max"]
    assert [s.metadata["prompt_index"] for s in resumed.trained_samples][::3] == list(range(4, 10))
    assert _no_producer_threads()


@pytest.mark.parametrize("partial", [False, True])
def test_multi_turn_episodes_run_in_async_mode_as_one_unit_of_work_per_prompt(partial):
    game = {"environment": "guess_number", "max_turns": 3, "target": 7}
    trainer, policy, rows, _ = train("async", max_staleness=1, partial=partial, num_steps=4, token_s=0.001,
                                     train_s=0.02, metadata=game)
    samples = trainer.trained_samples
    assert len(samples) == 4 * 2 * 3 and max(row["async/staleness_max"] for row in rows) <= 1
    multi_turn = [s for s in samples if len(s.metadata["turn_executors"]) > 1]
    assert multi_turn  # episodes that went on after a wrong guess: their observations are not trained on
    for sample in multi_turn:
        assert 0 in sample.loss_mask and sample.reward in (0.0, 1.0)
    for sample in samples:  # an update waits for an episode: all its actions come from one version
        actions = [v for v, m in zip(sample.metadata["token_versions"], sample.loss_mask) if m]
        assert set(actions) == {sample.weight_version}
    assert {s.reward for s in samples} == {0.0, 1.0}  # the environment's rewards, not the reward function's
    assert _no_producer_threads()


def test_a_resume_with_another_group_size_than_the_saved_groups_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        train("async", max_staleness=1, num_steps=4, settle=True, fail_at=2,
              settings={"save": str(tmp_path), "save_interval": 2})
    with pytest.raises(ValueError, match="groups of \\[3\\] samples per prompt.*--n-samples-per-prompt 2"):
        train("async", max_staleness=1, num_steps=4, settings={"save": str(tmp_path), "load": str(tmp_path),
                                                                "n_samples_per_prompt": 2})
    assert _no_producer_threads()
