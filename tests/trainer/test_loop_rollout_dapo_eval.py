"""The rollout side of the loop on a local Ray cluster, in one DAPO run over two `stacx serve` rollout
engines (attached with rollout_urls): dynamic sampling and the overlong penalty, evaluation every N steps,
rollout dumps, and the requests spread over both engines.

- half the prompts get the same reward for every response (their groups must be dropped and refilled);
  every trained sample's reward is the reward function's plus the overlong penalty, recomputed here from
  the dumped responses; eval/* metrics equal a greedy evaluation of the exported final policy, run here
  in-process;
- both servers receive requests (each counted once), both serve the final weight version, and both answer
  greedily like each other and unlike the initial weights.
(One run since session 9: the two-server check was a GRPO run of its own, docs/testing.md.)
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from tests.trainer.training_fixtures import (
    read_metrics,
    read_rollout_dumps,
    run_config,
    varied_reward,
    write_tiny_run_files,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

HALF_UNIFORM_REWARD = "tests.trainer.test_loop_rollout_dapo_eval:half_uniform_reward"


def half_uniform_reward(response: str, label, metadata: dict) -> float:
    """1.0 for every response to a prompt marked uniform (a zero-variance group), else varied."""
    return 1.0 if (metadata or {}).get("uniform") else varied_reward(response, label, metadata)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dapo_files"))
    paths = write_tiny_run_files(root)
    rows = {
        "dapo_prompts": [{"prompt": f"{a}+{b}=", "label": str(a + b), "metadata": {"uniform": a % 2 == 0}}
                         for a, b in ((1, 2), (2, 4), (3, 3), (4, 1))],
        "eval_prompts": [{"prompt": f"{a}*{b}=", "label": str(a * b)} for a, b in ((2, 3), (4, 4), (1, 5))],
    }
    for name, items in rows.items():
        paths[name] = os.path.join(root, f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
    return paths


def _overlong_penalty_reference(length: int, max_length: int, buffer: int, factor: float) -> float:
    if length <= max_length - buffer:
        return 0.0
    return -factor * min(length - (max_length - buffer), buffer) / buffer


@pytest.fixture
def two_servers(files, attached_server_key, warm_engine_servers):
    """Two `stacx serve` processes of the initial policy (seeds 0 and 1), started side by side (warm); their URLs."""
    from stacx.rollout.engines.launchers import CpuServerProcess

    servers: list = [None, None]

    def start(index):
        servers[index] = CpuServerProcess(files["policy"], seed=index, api_key=attached_server_key)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(s is not None for s in servers), "a stacx serve process did not start"
        yield [s.url for s in servers]
    finally:
        for s in servers:
            if s is not None:
                s.stop()


def test_dapo_dynamic_sampling_overlong_penalty_and_eval_over_two_servers(ray_address, files, single_process_world,
                                                                          tmp_path, two_servers):
    from stacx.rollout.data import DataConfig, load_examples
    from stacx.rollout.engines.http import HttpEngine
    from stacx.rollout.manager import RolloutManager
    from stacx.rollout.service import load_tokenizer
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.trainer.factory import create_trainer
    from stacx.wire.types import SamplingParams

    prompt = [5, 7, 9, 11]
    before = _greedy(CpuEngine.from_hf_checkpoint(files["policy"]), prompt)
    cfg = run_config(str(tmp_path), train={"algorithm": "dapo"}, algorithm={"overlong_buffer_length": 2, "overlong_penalty_factor": 0.5},
                     hf_checkpoint=files["policy"], prompt_data=files["dapo_prompts"], rollout_engine="http",
                     rollout_urls=two_servers, reward_fn=HALF_UNIFORM_REWARD, save_rollouts_per_step=100,
                     eval_data=files["eval_prompts"], eval_interval=1, eval_n_samples=2, eval_temperature=0.0,
                     export_hf=str(tmp_path / "export"))
    trainer = create_trainer(cfg)
    assert trainer.step_rollout.dynamic  # the dapo recipe's filter_zero_variance_groups
    assert trainer.rollout.urls == tuple(two_servers)
    trainer.run()
    rows, dumps = read_metrics(str(tmp_path / "out")), read_rollout_dumps(str(tmp_path / "out"))
    assert [row["step"] for row in rows] == [0, 1, 2]  # two steps' rows, then the final model's eval row
    # Dynamic sampling: each step trains on rollout_batch_size groups that all have differing rewards.
    for step, row in enumerate(rows[:2]):
        assert row["rollout/dynamic_groups_kept"] == 2
        assert row["rollout/dynamic_groups_drawn"] == (row["rollout/dynamic_groups_kept"] + row["rollout/dynamic_groups_dropped"]
                                                       + row["rollout/dynamic_groups_surplus"])
        groups: dict[int, list[float]] = {}
        for sample in dumps[step]:
            groups.setdefault(sample["group_index"], []).append(sample["reward"])
            assert not sample["metadata"]["uniform"]
        assert sorted(groups) == [0, 1] and all(len(set(r)) > 1 for r in groups.values())
        assert row["rollout/num_samples"] == 4
    # Both uniform prompts are drawn within the first epoch (4 prompts over the two steps' first rounds).
    assert sum(row["rollout/dynamic_groups_dropped"] for row in rows[:2]) >= 2
    # Overlong penalty: L = 4, B = 2, factor 0.5, on top of the reward function.
    for step in (0, 1):
        for sample in dumps[step]:
            penalty = _overlong_penalty_reference(len(sample["response_ids"]), 4, 2, 0.5)
            expected = half_uniform_reward(sample["response_text"], sample["label"], sample["metadata"]) + penalty
            assert sample["reward"] == pytest.approx(expected, abs=1e-12)
            assert sample["metadata"]["overlong_penalty"] == pytest.approx(penalty)
    assert any(s["metadata"]["overlong_penalty"] < 0 for s in dumps[0] + dumps[1])
    # Evaluation of the starting model (row 0) and after every step (row k: k steps done), beside the
    # training metrics; the last one, the final model's own row, equals a greedy evaluation of the
    # exported final weights.
    assert set(rows[2]) == {"step", "rollout_step", "time_s", "eval/mean_reward", "eval/pass@1", "eval/pass@2",
                            "eval/reward_errors"}
    for row in rows:
        for name in ("eval/mean_reward", "eval/pass@1", "eval/pass@2", "eval/reward_errors"):
            assert name in row
    tokenizer = load_tokenizer(files["policy"])
    examples = load_examples(DataConfig(path=files["eval_prompts"], kind="prompt", apply_chat_template=False), tokenizer)
    final = RolloutManager(CpuEngine.from_hf_checkpoint(str(tmp_path / "export")), tokenizer=tokenizer,
                           reward_fn=half_uniform_reward)
    samples = final.generate([e.prompt_ids for e in examples],
                             SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,)),
                             labels=[e.label for e in examples], metadatas=[e.metadata for e in examples])
    rewards = [s.reward for s in samples]
    assert rows[-1]["eval/mean_reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-9)
    solved = sum(r > 0.5 for r in rewards) / len(rewards)
    assert rows[-1]["eval/pass@1"] == pytest.approx(solved) and rows[-1]["eval/pass@2"] == pytest.approx(solved)
    # Two servers: both received requests, each counted once (by the last training row: the drawn groups' 2
    # samples each, and the evaluations before steps 0 and 1, 3 prompts x 2 samples each).
    last = rows[1]
    assert last["rollout/engine0_requests"] > 0 and last["rollout/engine1_requests"] > 0
    drawn = sum(row["rollout/dynamic_groups_drawn"] for row in rows[:2])
    assert last["rollout/engine0_requests"] + last["rollout/engine1_requests"] == 2 * drawn + 2 * 3 * 2, rows[:2]
    assert rows[1]["rollout/weight_version"] == 1.0
    # Both serve the final weights (version 2) and answer greedily alike, unlike the initial weights.
    clients = [HttpEngine(url) for url in two_servers]
    assert [c.weight_version() for c in clients] == [2, 2]
    served = [_greedy(c, prompt) for c in clients]
    assert served[0][0] == served[1][0]
    assert served[0][1] == pytest.approx(served[1][1], abs=1e-6)
    assert served[0][1] != pytest.approx(before[1], abs=1e-5)
    for c in clients:
        c.shutdown()


def _greedy(engine, prompt):
    from stacx.wire.types import GenerateRequest, SamplingParams

    request = GenerateRequest(input_ids=tuple(prompt), sampling=SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                               ignore_eos=True))
    out = engine.generate([request])[0]
    return out.output_ids, out.output_log_probs
