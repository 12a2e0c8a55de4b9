"""Tiny checkpoints, data files and run configs shared by the training-loop tests (everything in tmp)."""

from __future__ import annotations

import contextlib
import json
import os

POLICY_SEED, TEACHER_SEED = 0, 1


def write_tiny_run_files(root: str) -> dict[str, str]:
    """Policy and teacher checkpoints (char tokenizer saved alongside), prompt / SFT / DPO JSONL files."""
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    paths = {}
    for name, seed in (("policy", POLICY_SEED), ("teacher", TEACHER_SEED)):
        path = os.path.join(root, name)
        save_tiny_hf_checkpoint(path, "llama", seed=seed, vocab_size=len(tokenizer),
                                eos_token_id=tokenizer.eos_token_id)
        tokenizer.save_pretrained(path)
        paths[name] = path
    rows = {
        "prompts": [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in ((1, 2), (3, 4), (2, 2), (5, 1))],
        "sft": [{"prompt": f"{a}+1=", "response": str(a + 1)} for a in range(8)],
        "dpo": [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(4)],
    }
    for name, items in rows.items():
        path = os.path.join(root, f"{name}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
        paths[name] = path
    return paths


def run_config(root: str, **values):
    """A RunConfig for a tiny run writing under `root`; `values` are flat run-config keys."""
    from stacx.trainer.config.run import RunConfig

    base = {
        "lr": 1e-3, "num_steps": 2, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
        "rollout_max_response_len": 4, "max_tokens_per_micro_batch": 64, "progress_bar": False,
        "tensorboard": False, "plots": False, "out": os.path.join(root, "out"), "collective_timeout_s": 120.0,
    }
    base.update(values)
    return RunConfig.from_dict(base, source="test")


def read_rollout_dumps(out_dir: str) -> dict[int, list[dict]]:
    """rollouts.jsonl's rows by their step."""
    by_step: dict[int, list[dict]] = {}
    with open(os.path.join(out_dir, "rollouts.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            by_step.setdefault(row["step"], []).append(row)
    return by_step


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def varied_reward(response: str, label, metadata: dict) -> float:
    """A reward that differs between samples of a random tiny model (so advantages are non-zero)."""
    return float(sum(ord(c) for c in response) % 7)


VARIED_REWARD = "tests.trainer.training_fixtures:varied_reward"

ATTACHED_SERVER_KEY = "trainer-tests-attached-server-key"
"""The API key of the rollout servers these tests start and attach to (`rollout_engine: http`): a
server that takes weight updates always has one, and the driver reads it from STACX_API_KEY
(the `attached_server_key` fixture)."""


@contextlib.contextmanager
def warm_role_workers(recipe: str, **layout):
    """Running role workers of `recipe`, laid out by `WorkerLayout(**layout)`, that a test module's runs of the
    same roles and layout share (`create_trainer(cfg, graph=graph)`: each run starts as on fresh workers, without
    their process start); shut down at the end. Ray must be connected (the `ray_address` fixture)."""
    from stacx.trainer.cluster.ray.graph import WorkerLayout, create_role_workers
    from stacx.trainer.recipes import get_recipe

    graph = create_role_workers(get_recipe(recipe), WorkerLayout(**layout))
    try:
        yield graph
    finally:
        graph.shutdown()


def run_four_grpo_steps(root: str, policy: str, prompts: str, address: str, load: str | None, mode: str,
                        graph=None):
    """Four GRPO steps (a checkpoint every two) under `root`, resuming from `load` when given, in rollout
    `mode` ('sync' or 'async' with --max-staleness 0): the fresh-driver resume test's run, in this process
    (on `graph`'s running role workers when given)."""
    from stacx.trainer.factory import create_trainer

    cfg = run_config(root, train={"algorithm": "grpo"}, hf_checkpoint=policy, prompt_data=prompts, rollout_engine="cpu",
                     reward_fn="tests.trainer.training_fixtures:varied_reward", num_steps=4, save_interval=2,
                     save=os.path.join(root, "ckpt"), load=load or None, ray_address=address,
                     out=os.path.join(root, "out"), rollout_mode=mode, max_staleness=0)
    return create_trainer(cfg, graph=graph).run()
