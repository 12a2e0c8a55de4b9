"""Training-state memory of a GRPO step with LoRA against full fine-tuning: measured on CPU, modeled, extrapolated.

    python bench/lora_memory.py                          # tiny dense, tiny MoE, M: measure and model; 30B-A3B table
    python bench/lora_memory.py --shapes M --rank 8 --out bench/results/lora_memory.json

Measured (one spawned gloo rank, `RoleRuntime` with the run settings' path, one GRPO `train_step` of 16 samples):
the bytes the step's state holds, walked on the real objects after the step: the parameters, DDP's gradient
buffers and the optimizer state (Adam's moments; fp32 master weights on a bf16 model), and the process's peak
resident set (VmHWM) for scale (it includes the interpreter, torch and megatron-core, and the activations).

Modeled (`state_bytes`), from the Hugging Face config alone: parameter counts per module kind (`param_counts`,
checked equal to the built model's), adapter counts (r * (in + out) per adapted linear, per expert for routed
experts), and bytes per parameter: weights in the parameter dtype; for each trainable parameter an fp32 gradient
(megatron's grad_reduce_in_fp32 buffer), Adam's two fp32 moments and, when the weights are bf16, an fp32 master
copy. The model is checked against the CPU measurement (within 10%) and then evaluated for Qwen3-30B-A3B at
TP x EP on 8 GPUs (bf16 weights; DP replicates what TP and EP do not split; no distributed optimizer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
for path in (BENCH_DIR, REPO):
    if path not in sys.path:
        sys.path.insert(0, path)

from generation import SHAPES  # noqa: E402  (bench/generation.py: the S and M shapes)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96)
TINY_MOE = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
CPU_SHAPES = {"tiny": ("qwen3", TINY), "tiny-moe": ("qwen3_moe", TINY_MOE), "M": ("qwen2", SHAPES["M"])}
QWEN3_30B_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     vocab_size=151936, tie_word_embeddings=False)
"""Qwen3-30B-A3B's config.json fields that set its parameter count."""
VOCAB = 101
ADAM_FP32_BYTES = 8
GRAD_FP32_BYTES = 4
MASTER_FP32_BYTES = 4


# ---- the model --------------------------------------------------------------------------------

def param_counts(cfg: dict) -> dict[str, int]:
    """Parameters per kind of a Qwen2/Qwen3(-MoE) decoder: `dense` (embeddings, head, norms, attention, dense MLPs,
    router) and `experts` (routed experts). Biases of Qwen2's qkv are counted in attention."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    vocab = cfg.get("vocab_size", VOCAB)
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if cfg.get("qkv_bias") else 0)
    if cfg.get("qk_norm"):
        attention += 2 * d
    norms = 2 * h
    experts = 0
    if cfg.get("num_experts"):
        mlp = cfg["num_experts"] * h  # router
        experts = cfg["num_experts"] * 3 * h * cfg["moe_intermediate_size"]
    else:
        mlp = 3 * h * cfg["intermediate_size"]
    dense = layers * (attention + norms + mlp) + h + vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return {"dense": dense, "experts": layers * experts}


def adapter_counts(cfg: dict, rank: int, targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                                  "experts")) -> dict[str, int]:
    """Adapter parameters per kind: r * (in + out) per adapted linear (one A for the fused qkv and gate/up)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    dense = 0
    if "linear_qkv" in targets:
        dense += rank * (h + q + 2 * kv)
    if "linear_proj" in targets:
        dense += rank * (q + h)
    experts = 0
    if cfg.get("num_experts"):
        f = cfg["moe_intermediate_size"]
        if "experts" in targets:
            experts = cfg["num_experts"] * rank * ((h + 2 * f) + (f + h))
    else:
        f = cfg["intermediate_size"]
        dense += rank * (h + 2 * f) * ("linear_fc1" in targets) + rank * (f + h) * ("linear_fc2" in targets)
    return {"dense": layers * dense, "experts": layers * experts}


def state_bytes(cfg: dict, *, rank: int | None, weight_bytes: int, tp: int = 1, ep: int = 1,
                targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts")) -> dict[str, float]:
    """Per-rank bytes of weights, gradients and optimizer state; rank None = full fine-tuning. TP splits the dense
    linears (modeled as all of `dense`, an upper bound of a few norms and the router), EP the routed experts."""
    base = param_counts(cfg)
    local_base = base["dense"] / tp + base["experts"] / ep
    if rank is None:
        trainable = local_base
        weights = local_base * weight_bytes
    else:
        adapters = adapter_counts(cfg, rank, targets)
        trainable = adapters["dense"] / tp + adapters["experts"] / ep
        weights = local_base * weight_bytes + trainable * weight_bytes
    master = trainable * MASTER_FP32_BYTES if weight_bytes < 4 else 0
    grads = trainable * GRAD_FP32_BYTES
    optimizer = trainable * ADAM_FP32_BYTES + master
    return {"trainable_params": trainable, "weights": weights, "grads": grads, "optimizer": optimizer,
            "total": weights + grads + optimizer}


# ---- the measurement ----------------------------------------------------------------------------

def _runtime_state_bytes(runtime) -> dict[str, int]:
    """Bytes held by the parameters, DDP's gradient buffers and the optimizer state, walked on the objects."""
    weights = sum(p.numel() * p.element_size() for p in runtime.model.parameters())
    grads = 0
    for buffer in list(runtime.ddp.buffers) + list(runtime.ddp.expert_parallel_buffers):
        grads += buffer.grad_data.numel() * buffer.grad_data.element_size()
    optimizer = 0
    chain = getattr(runtime.optimizer, "chained_optimizers", [runtime.optimizer])
    for inner in chain:
        for state in inner.optimizer.state.values():
            optimizer += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    trainable = sum(p.numel() for p in runtime.model.parameters() if p.requires_grad)
    return {"trainable_params": trainable, "weights": weights, "grads": grads, "optimizer": optimizer,
            "total": weights + grads + optimizer}


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def measure_rank(groups, path: str, lora_rank: int | None):
    """One GRPO train step of 16 samples at this layout; the state's bytes and the peak RSS."""
    from stacx.objectives.algorithm_config import AlgorithmConfig
    from stacx.parallel.reduction import compute_step_counts
    from stacx.specializations.actor import ActorSpecialization
    from stacx.trainer.batch import StepBatch
    from stacx.trainer.config.recipe import ModelRole
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    lora = {"lora_rank": lora_rank, "lora_alpha": 2.0 * lora_rank} if lora_rank else {}
    run_config = RunConfig.from_dict({"hf_checkpoint": path, **lora})
    algorithm = AlgorithmConfig.from_values({"advantage_estimator": "grpo"})
    runtime = RoleRuntime(ModelRole(name="policy", specialization_cls=ActorSpecialization), algorithm, groups,
                          model=run_config.model, optim=run_config.optim, train=run_config.train, rank=0)
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB, (96,), generator=generator) for _ in range(16)]
    batch = StepBatch(tokens=tokens, response_lengths=[64] * 16, loss_masks=[torch.ones(64)] * 16,
                      advantages=[torch.randn(64, generator=generator) for _ in range(16)])
    runtime.train_step([batch.select(list(range(8))), batch.select(list(range(8, 16)))],
                       compute_step_counts(batch.loss_masks, groups.dp))
    return {**_runtime_state_bytes(runtime), "peak_rss": _peak_rss_bytes()}


def measure(arch: str, fields: dict, lora_rank: int | None) -> dict:
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.testing.distributed import run_distributed

    with tempfile.TemporaryDirectory() as folder:
        save_tiny_hf_checkpoint(folder, arch, seed=0, vocab_size=VOCAB, **fields)
        return run_distributed(measure_rank, 1, args=(folder, lora_rank), timeout_s=1800)[0]


def model_config(arch: str, fields: dict) -> dict:
    cfg = dict(fields, vocab_size=VOCAB, tie_word_embeddings=False)
    cfg["qkv_bias"] = arch == "qwen2"
    cfg["qk_norm"] = arch.startswith("qwen3")
    return cfg


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(CPU_SHAPES), choices=list(CPU_SHAPES))
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default: %(default)s)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    rows = []
    for shape in args.shapes:
        arch, fields = CPU_SHAPES[shape]
        cfg = model_config(arch, fields)
        for mode, lora_rank in (("full", None), (f"lora r={args.rank}", args.rank)):
            measured = measure(arch, fields, lora_rank)
            predicted = state_bytes(cfg, rank=lora_rank, weight_bytes=4)
            error = abs(predicted["total"] - measured["total"]) / measured["total"]
            rows.append({"shape": shape, "mode": mode, "measured": measured, "predicted": predicted,
                         "relative_error": error})
            print(f"{shape:9s} {mode:10s} trainable {measured['trainable_params']:>10,d} (model "
                  f"{predicted['trainable_params']:>12,.0f})  grads {measured['grads'] / 2**20:8.2f} MiB  "
                  f"optimizer {measured['optimizer'] / 2**20:8.2f} MiB  state {measured['total'] / 2**20:8.2f} MiB "
                  f"(model {predicted['total'] / 2**20:8.2f}, error {100 * error:.1f}%)  peak RSS "
                  f"{measured['peak_rss'] / 2**20:7.0f} MiB", flush=True)
    table = []
    for tp, ep in ((1, 8), (2, 4), (4, 2), (8, 1)):
        for rank in (None, 8, 32):
            state = state_bytes(QWEN3_30B_A3B, rank=rank, weight_bytes=2, tp=tp, ep=ep)
            table.append({"tp": tp, "ep": ep, "lora_rank": rank, **{k: v / 2**30 for k, v in state.items()
                                                                   if k != "trainable_params"},
                          "trainable_params": state["trainable_params"]})
            print(f"Qwen3-30B-A3B TP={tp} EP={ep} {'full' if rank is None else f'LoRA r={rank}':9s} per GPU: "
                  f"weights {table[-1]['weights']:6.1f} GiB, grads {table[-1]['grads']:6.2f} GiB, optimizer "
                  f"{table[-1]['optimizer']:6.2f} GiB, total {table[-1]['total']:6.1f} GiB (no activations)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": rows, "qwen3_30b_a3b_8_gpus": table}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
