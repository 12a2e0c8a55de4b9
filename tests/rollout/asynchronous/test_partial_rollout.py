"""Partial rollout on the CPU engine and `stacx serve`: abort in-flight requests, update the weights,
continue them; every token keeps its behaviour log-prob and the weight version that produced it."""

import threading
import time

import pytest
import requests as http
import torch

from stacx.rollout.continuation import continuation_request, join_outputs
from stacx.rollout.engines.http import HttpEngine
from stacx.serving.cpu_engine import CpuEngine
from stacx.serving.server import EngineHttpServer
from stacx.wire.http_client import RetryPolicy
from stacx.wire.types import GenerateRequest, SamplingParams

TOLERANCE = 1e-5  # fp32 engine vs fp32 trainer forward of the same tokens
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def engine(cpu_engine):
    return cpu_engine


@pytest.fixture(scope="module")
def policies(tiny_checkpoints, single_process_world):
    """The two checkpoints as trainer models (the teacher-forcing reference) and as weight buckets."""
    from stacx.models import build_model, iter_hf_weight_buckets, load_hf_checkpoint

    models, buckets = [], []
    for path in tiny_checkpoints:
        model = build_model(path, single_process_world).eval()
        load_hf_checkpoint(model, path, single_process_world)
        models.append(model)
        buckets.append([list(b) for b in iter_hf_weight_buckets(model, single_process_world, bucket_bytes=40_000)])
    return models, buckets


def load_policy(engine_or_client, policies, which: int) -> int:
    """Push checkpoint `which` as the next weight version; return that version."""
    version = engine_or_client.weight_version() + 1
    engine_or_client.update_weights(iter(policies[1][which]), version=version)
    return version


def behaviour_log_probs(model, groups, prompt, tokens, temperature):
    """log p(token_j | prompt + tokens[:j]) under `model` at `temperature` (teacher-forced, one forward)."""
    from stacx.models import forward_packed, hf_config_of

    sequence = list(prompt) + list(tokens)
    with torch.no_grad():
        logits = forward_packed(model, torch.tensor(sequence), [len(sequence)], groups)
    log_probs = torch.log_softmax(logits[:, : hf_config_of(model).vocab_size].double() / (temperature or 1.0), -1)
    return [log_probs[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


class Stall:
    """Holds the engine's `at_call`-th model forward (prefill = 1, then one per generated token)
    until `release` is set: the request then has `at_call - 1` tokens."""

    def __init__(self, engine, monkeypatch, at_call: int):
        self.reached, self.release, self.calls = threading.Event(), threading.Event(), 0
        forward = engine._model_call

        def model_call(*args):
            self.calls += 1
            if self.calls == at_call:
                self.reached.set()
                assert self.release.wait(TIMEOUT_S), "the test never released the stalled forward"
            return forward(*args)

        monkeypatch.setattr(engine, "_model_call", model_call)

    def wait(self):
        assert self.reached.wait(TIMEOUT_S), "the engine never reached the stalled forward"


class StallPrompt:
    """Holds the `after_steps`-th decode step of the batch whose prefill held `prompt` (the request then
    has `after_steps` tokens), however the engine batched the concurrent requests."""

    def __init__(self, engine, monkeypatch, prompt, after_steps: int):
        self.reached, self.release = threading.Event(), threading.Event()
        forward, steps = engine._model_call, []

        def model_call(fn, *args):
            if getattr(fn, "__name__", "") == "prefill":
                if tuple(prompt) in [tuple(ids) for ids in args[0]] and not steps:
                    steps.append(0)
            elif steps and not self.reached.is_set():
                steps[0] += 1
                if steps[0] == after_steps:
                    self.reached.set()
                    assert self.release.wait(TIMEOUT_S), "the test never released the stalled forward"
            return forward(fn, *args)

        monkeypatch.setattr(engine, "_model_call", model_call)

    def wait(self):
        assert self.reached.wait(TIMEOUT_S), "the engine never reached the stalled forward"


def greedy(prompt, max_new_tokens=10, rid=None):
    return GenerateRequest(input_ids=tuple(prompt), rid=rid, top_logprobs_num=2,
                           sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))


def test_abort_returns_the_partial_tokens_log_probs_and_versions_and_spares_the_others(
        engine, policies, single_process_world, monkeypatch):
    version = load_policy(engine, policies, 0)
    stall = Stall(engine, monkeypatch, at_call=4)
    first = engine.submit(greedy((4, 10, 11), rid="a"))  # submitted from this (driver) thread, runs on its own
    stall.wait()
    second = engine.submit(greedy((4, 20), rid="b"))  # queued behind the running batch
    engine.abort(["a"])
    stall.release.set()
    partial, untouched = first.result(TIMEOUT_S), second.result(TIMEOUT_S)

    assert partial.finish_reason == "abort" and len(partial.output_ids) == 3
    assert len(partial.output_log_probs) == len(partial.output_top_log_probs) == 3
    assert partial.output_token_versions == [version] * 3 and partial.weight_version == version
    expected = behaviour_log_probs(policies[0][0], single_process_world, (4, 10, 11), partial.output_ids, 0.0)
    assert partial.output_log_probs == pytest.approx(expected, abs=TOLERANCE)
    (whole,) = engine.generate([greedy((4, 10, 11))])
    assert whole.output_ids[:3] == partial.output_ids  # the same tokens, cut short
    assert untouched.finish_reason == "length" and len(untouched.output_ids) == 10
    assert untouched.output_token_versions == [version] * 10
    assert engine.aborts.num_registered() == 0  # nothing left behind for a later abort to hit


def test_continuing_under_new_weights_records_each_segment_with_its_version_and_behaviour_log_probs(
        engine, policies, single_process_world, monkeypatch):
    old = load_policy(engine, policies, 0)
    request = GenerateRequest(input_ids=(4, 12, 13, 14), rid="s", logprob_start_len=1,
                              sampling=SamplingParams(max_new_tokens=9, temperature=0.8, seed=3, ignore_eos=True))
    stall = Stall(engine, monkeypatch, at_call=5)
    future = engine.submit(request)
    stall.wait()
    engine.pause()  # the weight update: pause, abort the in-flight requests, update, resume
    engine.abort()
    stall.release.set()
    new = load_policy(engine, policies, 1)  # waits for the aborted call to leave the model
    engine.resume()
    partial = future.result(TIMEOUT_S)
    assert partial.finish_reason == "abort" and partial.output_token_versions == [old] * 4

    follow_up = continuation_request(request, partial)
    assert follow_up.input_ids == request.input_ids + tuple(partial.output_ids)
    assert follow_up.sampling.max_new_tokens == 5 and follow_up.logprob_start_len == -1 and follow_up.rid == "s"
    (rest,) = engine.generate([follow_up])
    whole = join_outputs(partial, rest)

    assert whole.finish_reason == "length" and len(whole.output_ids) == 9
    assert whole.output_token_versions == [old] * 4 + [new] * 5 and whole.weight_version == old
    assert whole.input_log_probs == partial.input_log_probs and len(whole.input_log_probs) == 3
    # each token's behaviour log-prob is the one the weights that sampled it give, teacher-forced
    models = policies[0]
    head = behaviour_log_probs(models[0], single_process_world, request.input_ids, whole.output_ids[:4], 0.8)
    tail = behaviour_log_probs(models[1], single_process_world, follow_up.input_ids, whole.output_ids[4:], 0.8)
    assert whole.output_log_probs == pytest.approx(head + tail, abs=TOLERANCE)
    wrong = behaviour_log_probs(models[0], single_process_world, follow_up.input_ids, whole.output_ids[4:], 0.8)
    assert max(abs(a - b) for a, b in zip(wrong, tail)) > 1e-2  # the two policies are told apart


@pytest.mark.parametrize("decoding", ["kv_cache", "packed"])
@pytest.mark.parametrize("abort_at_call", [1, 4])
def test_greedy_abort_and_continue_with_unchanged_weights_gives_the_uninterrupted_tokens(
        engine, policies, monkeypatch, decoding, abort_at_call):
    """The engine's guarantee: greedy decoding continued after an abort (unchanged weights) picks
    exactly the uninterrupted tokens, log-probs equal to fp32 rounding (prefilled, not decoded)."""
    load_policy(engine, policies, 0)
    runner = engine if decoding == "kv_cache" else CpuEngine(engine.model, eos_token_id=engine.eos_token_id,
                                                             decoding="packed")
    requests = [greedy((4, 10, 11, 12), 8, rid="x"), greedy((5, 6), 8, rid="y"), greedy((4, 40, 41), 6, rid="z")]
    uninterrupted = runner.generate(requests)
    stall = Stall(runner, monkeypatch, at_call=abort_at_call)
    results = {}
    worker = threading.Thread(target=lambda: results.update(out=runner.generate(requests)))
    worker.start()
    stall.wait()
    runner.abort()
    stall.release.set()
    worker.join(TIMEOUT_S)
    partials = results["out"]
    assert all(p.finish_reason == "abort" for p in partials)
    assert {len(p.output_ids) for p in partials} == {max(abort_at_call - 1, 0)}
    follow_ups = runner.generate([continuation_request(r, p) for r, p in zip(requests, partials)])
    for expected, partial, rest in zip(uninterrupted, partials, follow_ups):
        whole = join_outputs(partial, rest)
        assert whole.output_ids == expected.output_ids and whole.finish_reason == expected.finish_reason
        assert whole.output_log_probs == pytest.approx(expected.output_log_probs, abs=TOLERANCE)
        assert whole.output_token_versions == expected.output_token_versions
        assert [[t for _, t in top] for top in whole.output_top_log_probs] == \
            [[t for _, t in top] for top in expected.output_top_log_probs]


def test_stacx_serve_aborts_over_http_takes_the_weight_update_and_continues_under_it(
        engine, policies, single_process_world, monkeypatch):
    old = load_policy(engine, policies, 0)
    with EngineHttpServer(engine) as server:
        client = HttpEngine(server.url, RetryPolicy(timeout_s=TIMEOUT_S, max_attempts=1), api_key=server.api_key)
        running_request = greedy((4, 15, 16), 10, rid="running")
        stall = Stall(engine, monkeypatch, at_call=4)
        running = client.submit(running_request)
        stall.wait()
        queued = client.submit(greedy((4, 17), 10, rid="queued"))  # waits in the server's batcher
        _wait_until(lambda: server.aborts.num_registered() == 2)
        client.pause()
        client.abort()  # SGLang's {"abort_all": true}
        late = client.submit(greedy((4, 18), 4, rid="late"))  # arrives after the abort: held by the pause
        _wait_until(lambda: server.aborts.num_registered() == 3)
        stall.release.set()
        partial, never_started = running.result(TIMEOUT_S), queued.result(TIMEOUT_S)
        assert partial.finish_reason == "abort" and len(partial.output_ids) == 3
        assert partial.output_token_versions == [old] * 3
        assert never_started.finish_reason == "abort" and never_started.output_ids == []
        assert not late.done()

        new = load_policy(client, policies, 1)  # the update, while paused, after the abort
        client.resume()
        assert late.result(TIMEOUT_S).output_token_versions == [new] * 4  # held, then served by the new weights
        (rest,) = client.generate([continuation_request(running_request, partial)])
        whole = join_outputs(partial, rest)
        assert whole.output_token_versions == [old] * 3 + [new] * 7
        models = policies[0]
        head = behaviour_log_probs(models[0], single_process_world, running_request.input_ids, whole.output_ids[:3], 0)
        tail = behaviour_log_probs(models[1], single_process_world, running_request.input_ids + tuple(partial.output_ids),
                                   whole.output_ids[3:], 0)
        assert whole.output_log_probs == pytest.approx(head + tail, abs=TOLERANCE)

        # abort by rid over HTTP: only that request stops; the answer names the request by its rid
        stall = Stall(engine, monkeypatch, at_call=2)
        target = client.submit(greedy((4, 19), 6, rid="target"))
        stall.wait()
        client.abort(["target", "unknown-rid"])
        stall.release.set()
        assert target.result(TIMEOUT_S).finish_reason == "abort"
        answer = http.post(f"{server.url}/generate", timeout=TIMEOUT_S,
                           json={"input_ids": [4, 19], "rid": "mine", "sampling_params": {"max_new_tokens": 2}}).json()
        assert answer["meta_info"]["id"] == "mine" and answer["meta_info"]["weight_version"] == str(new)
        key = {"Authorization": f"Bearer {server.api_key}"}
        bad = http.post(f"{server.url}/abort_request", json={"rid": 7}, headers=key, timeout=10)
        assert bad.status_code == 400 and "'rid'" in bad.json()["error"] and "abort_all" in bad.json()["error"]
        assert http.post(f"{server.url}/abort_request", json={"abort_all": True}, timeout=10).status_code == 401
        client.shutdown()


def _wait_until(predicate, timeout_s=TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_default_submit_runs_requests_concurrently_and_the_pool_aborts_on_every_engine():
    """The base class's `submit` (HttpEngine, SglangEngine, EnginePool use it) reaches the engine from
    several threads at once; EnginePool forwards abort to each engine; an engine without abort says so."""
    from stacx.rollout.engine_pool import EnginePool
    from stacx.wire.engine import InferenceEngine
    from stacx.wire.types import GenerateOutput

    class Barrier(InferenceEngine):  # each generate waits until two are running at once
        def __init__(self):
            self.barrier, self.aborted = threading.Barrier(2, timeout=TIMEOUT_S), []

        def generate(self, requests):
            self.barrier.wait()
            return [GenerateOutput(output_ids=[len(r.input_ids)]) for r in requests]

        def abort(self, rids=None):
            self.aborted.append(rids)

        update_weights = weight_version = pause = resume = flush_cache = health = lambda *a, **k: None

    engine = Barrier()
    futures = [engine.submit(greedy((4,) * n)) for n in (1, 2)]
    assert [f.result(TIMEOUT_S).output_ids for f in futures] == [[1], [2]]
    engine.shutdown()
    pool = EnginePool([Barrier(), Barrier()], names=["a", "b"])
    pool.abort(["r1"])
    pool.abort()
    assert [e.aborted for e in pool.engines] == [[["r1"], None]] * 2
    pool.shutdown()

    class NoAbort(Barrier):
        abort = InferenceEngine.abort

    with pytest.raises(NotImplementedError, match="NoAbort does not implement abort"):
        NoAbort().abort()


def test_the_async_producer_continues_an_interrupted_group_through_stacx_serve_with_two_versions(
        engine, policies, monkeypatch):
    """`AsyncRollout` (K = 1, one prompt per step) over `stacx serve`: group 0 is trained at the old
    version while group 1 generates; the weight update's `begin_update` aborts group 1 after its first
    tokens, and after the update its continuation runs under the new version, so its response holds
    tokens of both versions, each with its behaviour log-prob. The producer makes one group's engine
    call at a time, so group 1 starts after group 0 ends (the order a busy engine gives, made certain)."""
    from types import SimpleNamespace

    from stacx.rollout.asynchronous.async_rollout import AsyncRollout
    from stacx.rollout.data import Example
    from stacx.rollout.service import RolloutService
    from stacx.trainer.config.run import RunConfig

    config = RunConfig.from_dict({"rollout_batch_size": 1, "n_samples_per_prompt": 1, "rollout_max_response_len": 6,
                                  "rollout_mode": "async", "max_staleness": 1, "partial_rollout": True,
                                  "reward_fn": "tests.trainer.training_fixtures:varied_reward"})
    examples = iter([Example(prompt_ids=[4, 15 + i, 16], source="t") for i in range(8)])
    data = SimpleNamespace(batch_size=1, prompt_index=0, next_examples=lambda count: [next(examples)])
    old = load_policy(engine, policies, 0)
    with EngineHttpServer(engine) as server:
        client = HttpEngine(server.url, RetryPolicy(timeout_s=TIMEOUT_S, max_attempts=1), api_key=server.api_key)
        service = RolloutService(client, engine_kind="http", url=server.url, tokenizer=None,
                                 rollout_section=config.rollout)
        producer = AsyncRollout(service, data, SimpleNamespace(apply_overlong_penalty=lambda samples: None),
                                rollout_section=config.rollout, start_version=old)
        producer.group_call_threads = 1
        try:
            stall = StallPrompt(engine, monkeypatch, (4, 16, 16), after_steps=2)  # group 1's prompt
            producer.start()
            first, _ = producer.take_batch(old)
            assert first[0].metadata["prompt_index"] == 0
            stall.wait()
            producer.begin_update()  # the update window: group 1, in flight, is aborted
            stall.release.set()
            _wait_until(lambda: not producer._in_flight)  # its aborted answer came back, kept
            client.pause()
            new = load_policy(client, policies, 1)
            client.resume()
            producer.publish_version(new)  # the interrupted group continues first
            second, metrics = producer.take_batch(new)
        finally:
            producer.close()
            client.shutdown()
    (sample,) = second
    versions = sample.metadata["token_versions"]
    assert sample.metadata["prompt_index"] == 1
    assert versions == sorted(versions) and set(versions) == {old, new}, versions
    assert len(sample.rollout_log_probs) == len(versions) == len(sample.response_ids)
    assert metrics["async/interrupted_groups"] == 1.0 and metrics["async/staleness_max"] == 1.0
    assert not producer.thread.is_alive()


def wait_until_idle(producer, timeout_s: float = 120.0) -> None:
    """Until the producer can admit no group and none runs (bounded): what it holds then does not depend on
    thread timing."""
    deadline = time.monotonic() + timeout_s
    while producer.scheduler.can_admit() or producer.scheduler.counts()["running"]:
        assert time.monotonic() < deadline, f"the producer did not settle in {timeout_s} s"
        time.sleep(0.001)


def test_async_rollout_over_a_pool_of_two_cpu_engines_uses_both_and_keeps_the_bound(
        tiny_checkpoints, policies, single_process_world):
    """`AsyncRollout` (K = 1, partial rollout, 2 prompts x 2 samples per step) over an `EnginePool` of two
    CPU engines: every group call is cut over the engines, both generate, every weight update aborts
    and updates both, and no group is trained beyond K (step 1 trains groups of version 0)."""
    from types import SimpleNamespace

    from stacx.rollout.asynchronous.async_rollout import AsyncRollout
    from stacx.rollout.data import Example
    from stacx.rollout.engine_pool import EnginePool
    from stacx.rollout.service import RolloutService
    from stacx.trainer.config.run import RunConfig

    config = RunConfig.from_dict({"rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 6,
                                  "rollout_mode": "async", "max_staleness": 1, "partial_rollout": True,
                                  "reward_fn": "tests.trainer.training_fixtures:varied_reward"})
    examples = iter([Example(prompt_ids=[4, 15 + i % 8, 16], source="t") for i in range(64)])
    data = SimpleNamespace(batch_size=2, prompt_index=0, next_examples=lambda count: [next(examples)])
    engines = [CpuEngine.from_hf_checkpoint(tiny_checkpoints[0]) for _ in range(2)]
    pool = EnginePool(engines, names=["engine a", "engine b"])
    service = RolloutService(pool, engine_kind="http", url="pool", tokenizer=None, rollout_section=config.rollout)
    producer = AsyncRollout(service, data, SimpleNamespace(apply_overlong_penalty=lambda samples: None),
                            rollout_section=config.rollout, start_version=0)
    staleness, trained = [], 0
    producer.start()
    try:
        for step in range(4):
            samples, metrics = producer.take_batch(step)
            staleness.append(metrics["async/staleness_max"])
            trained += len(samples)
            for sample in samples:
                assert min(sample.metadata["token_versions"], default=step) >= step - 1
            if step == 0:  # step 1's groups are all generated at version 0 before the first update: staleness 1
                wait_until_idle(producer)  # (later updates abort groups in flight, whatever the thread timing)
            producer.begin_update()
            pool.pause()
            load_policy(pool, policies, (step + 1) % 2)
            pool.resume()
            producer.publish_version(step + 1)
    finally:
        producer.close()
        pool.shutdown()
    assert staleness[1] == 1.0 and max(staleness) <= 1.0
    assert trained == 4 * 2 * 2
    assert min(pool.requests_sent) > 0 and sum(pool.requests_sent) >= trained, pool.requests_sent
    assert [engine.weight_version() for engine in engines] == [4, 4]
