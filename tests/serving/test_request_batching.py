"""Concurrent generate calls share one engine batch (stacx.serving.request_batching)."""

from __future__ import annotations

import threading
import time

import pytest

from stacx.serving.request_batching import GenerateBatcher
from stacx.wire.engine import GenerationCancelled


class RecordingEngine:
    """Answers each request with its own input ids; the first call blocks until released."""

    def __init__(self):
        self.calls: list[list] = []
        self.release_first = threading.Event()
        self.first_started = threading.Event()

    def check_requests(self, requests):
        if any(r == "bad" for r in requests):
            raise ValueError("request 'bad' is invalid")

    def generate(self, requests, should_stop=None):
        self.calls.append(list(requests))
        if len(self.calls) == 1:
            self.first_started.set()
            deadline = time.monotonic() + 30
            while not self.release_first.wait(0.01):
                if should_stop is not None and should_stop():
                    raise GenerationCancelled("every caller left")
                assert time.monotonic() < deadline
        if "boom" in requests:
            raise RuntimeError("engine failed")
        return [f"out-{r}" for r in requests]


def call_in_thread(batcher, requests, results, key, should_stop=None):
    def run():
        try:
            results[key] = batcher.generate(requests, should_stop=should_stop)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            results[key] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_until(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_callers_queued_behind_a_running_batch_run_as_one_engine_call():
    engine = RecordingEngine()
    batcher = GenerateBatcher(engine)
    results = {}
    first = call_in_thread(batcher, ["a"], results, "first")
    assert engine.first_started.wait(30)
    waiting = [call_in_thread(batcher, [f"b{i}", f"c{i}"], results, i) for i in range(3)]
    wait_until(lambda: len(batcher._queue) == 3)
    engine.release_first.set()
    for thread in [first, *waiting]:
        thread.join(30)
    assert results["first"] == ["out-a"]
    assert [results[i] for i in range(3)] == [[f"out-b{i}", f"out-c{i}"] for i in range(3)]
    assert len(engine.calls) == 2 and sorted(engine.calls[1]) == sorted(["b0", "c0", "b1", "c1", "b2", "c2"])
    assert batcher.num_engine_calls == 2


def test_batches_respect_the_request_cap_without_splitting_a_submission():
    engine = RecordingEngine()
    batcher = GenerateBatcher(engine, max_batch_requests=3)
    results = {}
    first = call_in_thread(batcher, ["a"], results, "first")
    assert engine.first_started.wait(30)
    waiting = []
    for i in range(3):  # queued in this order: 2 + 2 + 2 requests
        waiting.append(call_in_thread(batcher, [f"x{i}", f"y{i}"], results, i))
        wait_until(lambda: len(batcher._queue) == i + 1)
    engine.release_first.set()
    for thread in [first, *waiting]:
        thread.join(30)
    assert [len(call) for call in engine.calls] == [1, 2, 2, 2]
    assert [results[i] for i in range(3)] == [[f"out-x{i}", f"out-y{i}"] for i in range(3)]


def test_a_bad_request_fails_only_its_caller_and_an_engine_error_fails_its_batch():
    engine = RecordingEngine()
    engine.release_first.set()
    batcher = GenerateBatcher(engine)
    with pytest.raises(ValueError, match="'bad' is invalid"):
        batcher.generate(["ok", "bad"])
    assert engine.calls == []
    assert batcher.generate(["ok"]) == ["out-ok"]
    with pytest.raises(RuntimeError, match="engine failed"):
        batcher.generate(["boom"])
    assert batcher.generate(["again"]) == ["out-again"]  # the batcher is not left running


def test_a_queued_caller_that_leaves_is_cancelled_and_the_others_are_served():
    engine = RecordingEngine()
    batcher = GenerateBatcher(engine)
    results = {}
    first = call_in_thread(batcher, ["a"], results, "first")
    assert engine.first_started.wait(30)
    gone = threading.Event()
    leaver = call_in_thread(batcher, ["l"], results, "leaver", should_stop=gone.is_set)
    stayer = call_in_thread(batcher, ["s"], results, "stayer")
    wait_until(lambda: len(batcher._queue) == 2)
    gone.set()
    leaver.join(30)
    assert isinstance(results["leaver"], GenerationCancelled)
    engine.release_first.set()
    for thread in (first, stayer):
        thread.join(30)
    assert results["stayer"] == ["out-s"] and engine.calls[1] == ["s"]


def test_a_batch_stops_only_when_every_caller_in_it_has_left():
    engine = RecordingEngine()
    batcher = GenerateBatcher(engine)
    results = {}
    gone = threading.Event()
    only = call_in_thread(batcher, ["a"], results, "only", should_stop=gone.is_set)
    assert engine.first_started.wait(30)
    gone.set()
    only.join(30)
    assert isinstance(results["only"], GenerationCancelled)


def test_cpu_engine_answers_batched_callers_as_it_answers_them_one_by_one(tiny_checkpoints, single_process_world):
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.wire.types import GenerateRequest, SamplingParams

    engine = CpuEngine.from_hf_checkpoint(tiny_checkpoints[0])
    requests = [
        GenerateRequest(input_ids=(4, 10, 11, 12), top_logprobs_num=2,
                        sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)),
        GenerateRequest(input_ids=(4, 20), sampling=SamplingParams(max_new_tokens=5, temperature=0.9, seed=5,
                                                                   ignore_eos=True)),
        GenerateRequest(input_ids=(5, 6, 7, 8, 9, 10), sampling=SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                               ignore_eos=True)),
    ]
    alone = [engine.generate([request])[0] for request in requests]

    class GatedEngine:  # holds the first (warm-up) call so the three callers queue behind it
        def __init__(self):
            self.release = threading.Event()
            self.calls = 0

        def check_requests(self, batch):
            engine.check_requests(batch)

        def generate(self, batch, should_stop=None):
            self.calls += 1
            if self.calls == 1:
                assert self.release.wait(30)
            return engine.generate(batch, should_stop=should_stop)

    gated = GatedEngine()
    batcher = GenerateBatcher(gated)
    results = {}
    warm_up = call_in_thread(batcher, [requests[0]], results, "warm-up")
    wait_until(lambda: gated.calls == 1)
    threads = [call_in_thread(batcher, [request], results, i) for i, request in enumerate(requests)]
    wait_until(lambda: len(batcher._queue) == 3)
    gated.release.set()
    for thread in [warm_up, *threads]:
        thread.join(60)
    assert gated.calls == 2  # the three callers shared one engine call
    for i, expected in enumerate(alone):
        (got,) = results[i]
        assert got.output_ids == expected.output_ids
        assert got.output_log_probs == pytest.approx(expected.output_log_probs, abs=1e-5)
