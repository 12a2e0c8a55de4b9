"""LoRA whose A starts in the subspace of full fine-tuning's first update (LoRA-GA's idea), on the demo's GRPO phase.

    python bench/lora_gradient_init.py [--seeds 0 1 2] [--arm 5e-3] [--arm 2.5e-3] [--oracle 5e-3]
        [--out bench/results/lora_learning_gradient_init.json]
    python bench/lora_gradient_init.py --seeds 0 1 2 3 --full-from bench/results/lora_learning.json \
        --full-from bench/results/lora_learning_seed3.json --arm 7.5e-4:probe=3 --arm 5e-4:lora_plus_ratio=2
    python bench/lora_gradient_init.py --subspaces SFT_FOLDER PROBE_FOLDER FULL_FOLDER
    python bench/lora_gradient_init.py --seeds 2 --full-from bench/results/lora_learning.json \
        --full-export WORK/checkpoints/grpo_full_seed{seed} --arm 5e-3 --oracle 5e-3

The demo's SFT model is made once (as in `bench/lora_learning.py`); then for each seed:

1. `full`: the demo's GRPO phase, full fine-tuning (40 steps, lr 5e-4);
2. `probe`: the same run stopped after its first step. Its update dW1 = W1 - W_sft is full fine-tuning's first
   update (Adam's first step, so lr x sign(g) entrywise: the direction full fine-tuning actually takes);
3. for each `--arm LR[:probe=K][:FIELD=VALUE...]`: LoRA rank 8, alpha 16 on every linear at LR, started (`--load`,
   a PEFT folder) with every A set to the top-8 right singular vectors of dW1 (or, with `probe=K`, of dW_K, the
   update of a K-step probe run, full fine-tuning's first K updates summed) of its linear (the fused linears' rows stacked: q, k and v;
   gate and up, which share one A in Stacx), at the random init's row norm (sqrt(1/3)), B zero: the run starts from
   the SFT model, and B's first gradient s G A^T is the part of the gradient in that subspace; FIELD=VALUE adds
   run values as in `bench/lora_learning.py` (`lora_plus_ratio=2`; `lora_alpha=32` also sets the folder's alpha);
4. for each `--oracle LR`: the same with A from the whole 40-step full run's dW (the subspace full fine-tuning ends
   in: what an A-subspace init could give at best).

`--subspaces SFT PROBE FULL` runs nothing: for each adapted linear it prints how much of the full run's update
(FULL - SFT, squared Frobenius norm) lies in the top-8 input directions of the probe's update (PROBE - SFT), of the
SFT weight (`--lora-init principal`'s), of a random 8-dim subspace (`--lora-init random`'s span) and of the full
update itself (the best possible).

`--full-from FILE` (repeatable: the first file with a seed's full run gives it) takes the full runs' gains from
earlier `bench/lora_learning.py` results (the runs are deterministic given the seed; the SFT accuracy must match)
instead of running them, and `--full-export PATTERN`
(`{seed}` in it) names their exported folders, which the oracle arms need.

The gain of each run over the SFT model, and the LoRA arms' mean gain over the full runs', as `bench/lora_learning.py`.
The seed's rollouts at step 1 are the same in every arm (the same start model, the same seed), so dW1 is the first
update of that seed's runs. LoRA-GA proper also sets B (and subtracts s B A from the base); B zero keeps the base and
the exports plain LoRA, like `--lora-init principal`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

RANK, ALPHA = 8, 16.0
FUSED = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
"""Each A of a Stacx adapter (named by its first Hugging Face module) and the modules whose rows it serves."""


def weights(folder: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def subspace_a(update_rows, rank: int):
    """A [rank, in]: the top-`rank` right singular vectors of the stacked update rows, each at sqrt(1/3) (the random
    init's expected row norm), sign fixed (largest entry positive)."""
    import torch

    _, _, vt = torch.linalg.svd(update_rows.double(), full_matrices=False)
    top = vt[:rank]
    signs = torch.sign(top.gather(1, top.abs().argmax(dim=1, keepdim=True)))
    return (top * signs / math.sqrt(3.0)).float()


def write_subspace_adapter(out: str, start: str, moved: str, alpha: float = ALPHA) -> str:
    """A PEFT folder (rank 8, `alpha`, every linear) whose A lie in the subspace of `moved` - `start`, B zero."""
    import torch

    from stacx.models.lora import LoraSettings, peft_adapter_config
    from stacx.models.peft_adapters import write_peft_folder

    before, after = weights(start), weights(moved)
    layers = sorted({int(name.split(".")[2]) for name in before if name.startswith("model.layers.")})
    tensors = {}
    for layer in layers:
        for first, modules in FUSED.items():
            part = "self_attn" if first in ("q_proj", "o_proj") else "mlp"
            names = [f"model.layers.{layer}.{part}.{module}.weight" for module in modules]
            update = torch.cat([after[name] - before[name] for name in names])
            a = subspace_a(update, RANK)
            for module, name in zip(modules, names):
                prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = a.clone()
                tensors[f"{prefix}.lora_B.weight"] = torch.zeros(before[name].shape[0], RANK)
    config = peft_adapter_config(LoraSettings(rank=RANK, alpha=alpha), base_model=None)
    return write_peft_folder(out, tensors, config)


def print_subspaces(sft: str, probe: str, full: str, rank: int = RANK) -> None:
    """The `--subspaces` table (module doc)."""
    import torch

    before, first, whole = weights(sft), weights(probe), weights(full)
    layers = sorted({int(name.split(".")[2]) for name in before if name.startswith("model.layers.")})
    generator = torch.Generator().manual_seed(0)

    def top_inputs(matrix):
        return torch.linalg.svd(matrix, full_matrices=False)[2][:rank]

    print(f"share of the full update's energy in each top-{rank} input subspace")
    print("linear               in  dW1    W  random  dW(full)  |dW1|/|dW|  cos(dW1, dW)")
    for layer in layers:
        for first_module, modules in FUSED.items():
            part = "self_attn" if first_module in ("q_proj", "o_proj") else "mlp"
            names = [f"model.layers.{layer}.{part}.{module}.weight" for module in modules]
            step = torch.cat([first[n] - before[n] for n in names]).double()
            update = torch.cat([whole[n] - before[n] for n in names]).double()
            weight = torch.cat([before[n] for n in names]).double()
            random = torch.linalg.qr(torch.randn(update.shape[1], rank, generator=generator, dtype=torch.float64))[0].T

            def share(rows):
                return float((update @ rows.T @ rows).norm() ** 2 / update.norm() ** 2)

            cosine = float((step * update).sum() / step.norm() / update.norm())
            print(f"L{layer} {first_module:14s} {update.shape[1]:4d} {share(top_inputs(step)):4.2f} "
                  f"{share(top_inputs(weight)):4.2f} {share(random):6.2f} {share(top_inputs(update)):9.2f} "
                  f"{float(step.norm() / update.norm()):11.2f} {cosine:13.2f}")


def lora_values(lr: float, source: str, tag: str, source_pattern: str | None = None, extra: dict | None = None):
    """The run values of a LoRA arm at `lr` whose A start in the update subspace of the seed's `source` arm (or of
    the folder `source_pattern` names for the seed), plus the run values `extra` (`lora_alpha` also sets the start
    folder's)."""
    extra = dict(extra or {})
    alpha = float(extra.pop("lora_alpha", ALPHA))

    def values(seed: int, exports: dict) -> dict:
        moved = source_pattern.format(seed=seed) if source_pattern else exports[source]
        folder = write_subspace_adapter(os.path.join(os.path.dirname(exports["sft"]), f"init_{tag}_seed{seed}"),
                                        exports["sft"], moved, alpha)
        return {"lora_rank": RANK, "lora_alpha": alpha, "lr": lr, "load": folder, **extra}

    return values


def probe_name(steps: int) -> str:
    """The arm name of the probe run of `steps` full fine-tuning steps ("probe" for one, as in earlier results)."""
    return "probe" if steps == 1 else f"probe {steps} steps"


def gradient_arm(spec: str) -> tuple[str, float, int, dict]:
    """`LR[:probe=K][:FIELD=VALUE...]` -> (arm name, LR, the probe's steps K (default 1), run values FIELD=VALUE).
    A from the update of the first K full fine-tuning steps (dW_K); FIELD=VALUE as in bench/lora_learning.py
    (`lora_plus_ratio=2`, `lora_alpha=32`)."""
    from bench.lora_learning import run_value

    try:
        lr, *items = spec.split(":")
        lr = float(lr)
        extra = dict(run_value(item) for item in items)
        steps = int(extra.pop("probe", 1))
    except ValueError:
        raise SystemExit(f"--arm {spec!r}: expected LR[:probe=K][:FIELD=VALUE...], e.g. 1e-3 or "
                         "1e-3:probe=3:lora_plus_ratio=2") from None
    name = f"LoRA r=8 a=16 lr={lr:g} A from dW{steps}" + "".join(f" {item}" for item in items if not
                                                                 item.startswith("probe="))
    return name, lr, steps, extra


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arm", action="append", metavar="LR[:probe=K][:FIELD=VALUE...]",
                        help="a LoRA arm whose A start in the subspace of the first K steps' update (default K=1: "
                             "dW1), with run values FIELD=VALUE (repeatable; default 5e-3)")
    parser.add_argument("--oracle", type=float, action="append", default=[], metavar="LR",
                        help="a LoRA arm whose A start in the 40-step full run's dW subspace (repeatable)")
    parser.add_argument("--subspaces", nargs=3, metavar=("SFT", "PROBE", "FULL"),
                        help="print the subspace table of three exported folders and exit")
    parser.add_argument("--full-from", metavar="FILE", action="append",
                        help="reuse the full runs' gains of this result file (repeatable: the first with a seed wins)")
    parser.add_argument("--full-export", metavar="PATTERN", help="the full runs' exports, {seed} in the path")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "lora_learning_gradient_init.json"))
    args = parser.parse_args(argv)
    if args.subspaces:
        print_subspaces(*args.subspaces)
        return 0

    from bench.demo_grpo_arms import demo_grpo_lr, run_demo_grpo_arms

    if args.oracle and args.full_from and not args.full_export:
        raise SystemExit("--oracle with --full-from needs --full-export (the full runs' exported folders)")
    arms = {} if args.full_from else {"full": {}}
    specs = [gradient_arm(spec) for spec in args.arm or ["5e-3"]]
    for steps in sorted({steps for _, _, steps, _ in specs}):
        arms[probe_name(steps)] = {"num_steps": steps}
    for index, (name, lr, steps, extra) in enumerate(specs):
        arms[name] = lora_values(lr, probe_name(steps), f"arm{index}", extra=extra)
    for lr in args.oracle:
        arms[f"LoRA r=8 a=16 lr={lr:g} A from dW40 (oracle)"] = lora_values(lr, "full", f"dw40_{lr:g}",
                                                                            args.full_export if args.full_from else None)
    start_accuracy, runs = run_demo_grpo_arms(arms, args.seeds, work_prefix="stacx-lora-gradient-init-")
    if args.full_from:
        reused = []
        for path in args.full_from:
            with open(path) as handle:
                earlier = json.load(handle)
            if earlier["sft_accuracy"] != start_accuracy:
                raise SystemExit(f"--full-from {path}: SFT accuracy {earlier['sft_accuracy']}, this run's "
                                 f"{start_accuracy}")
            reused += [{**run, "reused_from": os.path.basename(path)} for run in earlier["runs"]
                       if run["mode"] == "full" and run["seed"] in args.seeds
                       and run["seed"] not in {r["seed"] for r in reused}]
        missing = sorted(set(args.seeds) - {run["seed"] for run in reused})
        if missing:
            raise SystemExit(f"--full-from: no full run of seed(s) {missing} in {args.full_from}")
        runs = reused + runs
        arms = {"full": {}, **arms}
    for run in runs:
        run["gain"] = run["accuracy"] - start_accuracy
    summary = {}
    for mode in arms:
        mine = [run for run in runs if run["mode"] == mode]
        if not mine:
            continue
        summary[mode] = {"gain_mean": statistics.mean(r["gain"] for r in mine), "gains": [r["gain"] for r in mine],
                         "seconds_mean": statistics.mean(r["seconds"] for r in mine)}
    full = summary["full"]["gain_mean"]
    ratios = {mode: row["gain_mean"] / full for mode, row in summary.items() if mode.startswith("LoRA") and full}
    for mode, row in summary.items():
        print(f"{mode}: gain {row['gain_mean']:+.3f} (per seed {', '.join(f'{g:+.3f}' for g in row['gains'])})"
              + (f"; LoRA / full {ratios[mode]:.2f}" if mode in ratios else ""))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"benchmark": "lora_gradient_init", "sft_accuracy": start_accuracy, "full_lr": demo_grpo_lr(),
                   "arms": list(arms), "runs": runs, "summary": summary, "gain_ratios": ratios}, handle, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
