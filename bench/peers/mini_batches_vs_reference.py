"""Several optimizer steps per rollout: Stacx's loop against a plain-PyTorch GRPO reference.

    python bench/peers/mini_batches_vs_reference.py [--rollouts 3 --mini-batches 4 --epochs 1 --worlds 1 2]

Both sides start from one random tiny Llama checkpoint (written here, nothing downloaded) and train
on the same fixed rollouts (4 prompts x 4 samples, random tokens, varied rewards) with the same
seeded mini-batch split: old log-probs once per rollout, PPO-clip token-mean per mini-batch, grad
clip 1.0, AdamW, LR linear from lr to min_lr over all optimizer steps (the reference and the
settings: tests/trainer/mini_batch_reference.py). Stacx runs its real loop (`StacxTrainer` over
`RoleRuntime` ranks, megatron-core) on `--worlds` gloo ranks each (DP = world, several
micro-batches per rank); the reference is Hugging Face `transformers` plus ~40 lines of torch.

Prints, per world size, the largest relative difference over all optimizer steps of the loss, the
clip fraction and the grad norm, the clip fraction of each step, and the wall time of each side
(ratio Stacx / reference, start-up included).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _fresh(root: str, world: int) -> str:
    """A folder of its own for each world's run outputs."""
    path = os.path.join(root, f"world{world}")
    os.makedirs(path, exist_ok=True)
    return path


def main() -> None:
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.testing.distributed import run_distributed
    from tests.trainer import mini_batch_reference as reference
    from tests.trainer.training_fixtures import write_tiny_run_files

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="stacx-bench-mini-batches-")
    checkpoint = write_tiny_run_files(root)["policy"]
    rollouts = reference.make_rollouts(args.rollouts, len(build_char_tokenizer()))
    started = time.monotonic()
    expected = reference.reference_run(checkpoint, rollouts, num_steps_per_rollout=args.mini_batches,
                                       num_epochs=args.epochs)
    reference_s = time.monotonic() - started
    print(f"reference: {len(expected)} optimizer steps in {reference_s:.1f} s; clip fraction per step: "
          + " ".join(f"{row['pg_clipfrac']:.3f}" for row in expected))
    for world in args.worlds:
        started = time.monotonic()
        values = {"num_steps_per_rollout": args.mini_batches, "num_epochs": args.epochs,
                  "max_tokens_per_micro_batch": 40}
        results = run_distributed(reference.train_stacx, world,
                                  args=(_fresh(root, world), checkpoint, rollouts, values))
        stacx_s = time.monotonic() - started
        rows = results[0]["rows"]
        differences = reference.max_relative_differences(rows, expected)
        calls = len(results[0]["calls"])
        print(f"stacx dp={world}: {len(rows)} optimizer steps, old log-probs computed {calls}x, {stacx_s:.1f} s "
              f"({stacx_s / reference_s:.2f}x the reference); max relative difference: "
              + ", ".join(f"{name} {value:.2e}" for name, value in differences.items()))


if __name__ == "__main__":
    main()
