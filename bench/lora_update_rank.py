"""How much of full fine-tuning's held-out gain a rank-r update of the linears can hold (a diagnostic for LoRA).

    python bench/lora_update_rank.py WORK_FOLDER --seeds 0 1 2 [--out bench/results/lora_update_rank.json]

WORK_FOLDER is a `bench/lora_learning.py` work folder that ran the full arm (its `checkpoints/sft` and
`checkpoints/grpo_full_seed<N>` or `grpo_arm0_seed<N>` exports). For each seed, the full run's update dW = W_full -
W_sft is applied in parts to the SFT model and the held-out greedy accuracy measured as the demo does: dW on the
decoder's linears only (q/k/v/o, gate/up/down: what `--lora-target-modules all-linear` adapts), its best rank-r
approximation (SVD) there, and dW on everything but the linears (embeddings, output layer, norms).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 4, 2])
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "lora_update_rank.json"))
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    from stacx.launch.demo import measure
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.tasks import get_task

    torch.set_num_threads(1)
    task = get_task("sorting")
    tokenizer = build_char_tokenizer(task.alphabet)
    eval_file = sorted(glob.glob(os.path.join(args.work, "builtin", "**", "*eval*"), recursive=True))[0]
    with open(eval_file) as handle:
        rows = [json.loads(line) for line in handle][:128]
    sft = load_file(os.path.join(args.work, "checkpoints", "sft", "model.safetensors"))
    model = measure.load_reference_model(os.path.join(args.work, "checkpoints", "sft"))

    def accuracy(state) -> float:
        model.load_state_dict(state, strict=False)
        return measure.greedy_accuracy(model, tokenizer, rows, max_new_tokens=task.max_answer_chars + 1)

    def low_rank(delta, rank):
        u, s, vt = torch.linalg.svd(delta, full_matrices=False)
        return (u[:, :rank] * s[:rank]) @ vt[:rank]

    def is_linear(name):
        return any(part in name for part in LINEARS)

    result = {"sft_accuracy": accuracy(sft), "seeds": {}}
    for seed in args.seeds:
        folder = next(path for pattern in (f"grpo_full_seed{seed}", f"grpo_arm0_seed{seed}")
                      for path in [os.path.join(args.work, "checkpoints", pattern)] if os.path.isdir(path))
        full = load_file(os.path.join(folder, "model.safetensors"))
        row = {"full": accuracy(full),
               "linears_only": accuracy({k: full[k] if is_linear(k) else sft[k] for k in sft}),
               "all_but_linears": accuracy({k: sft[k] if is_linear(k) else full[k] for k in sft})}
        for rank in args.ranks:
            row[f"linears_rank{rank}_only"] = accuracy(
                {k: sft[k] + low_rank(full[k] - sft[k], rank) if is_linear(k) else sft[k] for k in sft})
        result["seeds"][seed] = row
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
