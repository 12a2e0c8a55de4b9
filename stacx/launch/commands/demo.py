"""`stacx demo`: the embedded default run on CPU.

Today this is the smallest end-to-end path that exists: a tiny megatron-core GPT, tensor
parallel over 2 gloo ranks, trained with megatron's DDP and optimizer to continue a built-in
counting task ("3 4 5 6 ..."). It prints the real loss and accuracy per step and writes them
to DIR/metrics.jsonl. The full demo (SFT -> GRPO -> distillation) replaces it.
"""

from __future__ import annotations

import json
import os
import time

HELP = "run the embedded default on CPU (tiny model, built-in task) and report what it learned"


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="outputs/demo", help="folder for metrics (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)


def _counting_batch(generator, batch_size: int, length: int, vocab_size: int):
    import torch

    starts = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
    return (starts + torch.arange(length + 1)[None]) % vocab_size


def train_counting_task(groups, steps: int, seed: int):
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.transformer_config import TransformerConfig

    from stacx.models.packed_attention import PackedCoreAttention

    vocab_size, length = 32, 16
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        use_cpu_initialization=True, tensor_model_parallel_size=groups.tp_size, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=length, position_embedding_type="rope")
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), [model])
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        batch = _counting_batch(generator, 16, length, vocab_size)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        logits = model(inputs, torch.arange(length)[None].expand_as(inputs), None)  # [b, s, v/tp]
        full_logits = gather_from_tensor_model_parallel_region(logits)
        loss = F.cross_entropy(full_logits.reshape(-1, vocab_size), targets.reshape(-1))
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        accuracy = (full_logits.argmax(-1) == targets).float().mean().item()
        history.append({"step": step, "loss": loss.item(), "next_token_accuracy": accuracy})
    return history


def run(args) -> int:
    from stacx.testing.distributed import run_distributed

    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    print("stacx demo: tiny megatron-core GPT, TP=2 over 2 gloo ranks, built-in counting task")
    history = run_distributed(train_counting_task, 2, tensor_parallel_size=2, args=(args.steps, args.seed),
                              timeout_s=900)[0]
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    with open(metrics_path, "w") as f:
        for row in history:
            f.write(json.dumps(row) + "\n")
    for row in history[:: max(1, len(history) // 8)] + [history[-1]]:
        print(f"  step {row['step']:3d}  loss {row['loss']:.4f}  next-token accuracy {row['next_token_accuracy']:.3f}")
    first, last = history[0], history[-1]
    print(f"accuracy before {first['next_token_accuracy']:.3f} -> after {last['next_token_accuracy']:.3f} "
          f"in {time.monotonic() - start:.0f}s")
    print(f"metrics: {os.path.abspath(metrics_path)}")
    return 0
