"""bench/async_rollout runs at a tiny size with no sleeps: every mode finishes and reports what docs/performance.md quotes."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "async_rollout"


def load(name: str):
    """The bench's module `name`, imported as run.py imports its siblings (by plain name from its folder)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name == "run":  # a name too plain to claim in sys.modules
        spec = importlib.util.spec_from_file_location("bench_async_rollout_run", BENCH / "run.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(name)


def test_every_mode_runs_and_k0_trains_the_sync_batches(tmp_path):
    output = tmp_path / "async_rollout.json"
    assert load("run").main(["--time-scale", "0", "--steps", "4", "--warmup", "1", "--groups", "2", "--samples", "2",
                             "--train-step-s", "0.5", "--out", str(output)]) == 0
    (result,) = json.loads(output.read_text())["regimes"]
    modes = [row["mode"] for row in result["rows"]]
    assert modes == ["sync", "async K=0 drain", "async K=1 drain", "async K=1 partial", "async K=2 drain",
                     "async K=2 partial"]
    assert result["checks"]["k0_trains_sync_batches"] is True
    for row in result["rows"]:
        k = 0 if row["mode"] == "sync" else int(row["mode"].split("K=")[1][0])
        assert max(int(s) for s in row["staleness_histogram"]) <= k
        assert sum(row["staleness_histogram"].values()) == 4 * 2
        assert row["samples_per_s"] > 0 and math.isfinite(row["ratio_samples_per_s_vs_sync"])
        assert 0 <= row["trainer_idle_frac"] <= 1 and 0 <= row["engine_idle_frac"] <= 1


def test_the_workload_is_log_normal_with_a_tenfold_p99_and_the_same_in_every_mode():
    workload = load("engine_model").Workload(median_response_len=30, p99_over_median=10.0, max_response_len=10_000)
    lengths = sorted(workload.response_len(p, 0) for p in range(4000))
    median, p99 = lengths[2000], lengths[int(0.99 * 3999)]
    assert 27 <= median <= 33 and 8 <= p99 / median <= 12.5
    assert workload.response_len(7, 1) == workload.response_len(7, 1)


def wait_until(condition, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "the engine made no progress"
        time.sleep(0.0001)


def test_an_aborted_request_continues_with_its_tokens_and_their_versions():
    engine_model = load("engine_model")
    done = []
    engine = engine_model.CostModelEngine(engine_model.CostModel(time_scale=0), done.append)
    try:
        request = engine_model.Request(0, 0, 0, prompt_len=4, target_len=10_000)
        engine.submit(request)
        wait_until(lambda: len(request.versions) >= 3)
        (aborted,) = engine.abort_all()
        assert aborted is request and engine.num_unfinished() == 0
        carried = len(request.versions)
        engine.update_weights(1)
        request.target_len = carried + 2
        engine.submit(request)
        wait_until(lambda: done)
        assert request.versions == [0] * carried + [1, 1]
        assert engine.resumed_prefill_tokens == carried
    finally:
        engine.close()
