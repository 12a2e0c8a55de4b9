"""One GRPO training step: Stacx against TRL's `GRPOTrainer`, alternately in one process.

    python bench/peers/train_step_vs_trl.py [--sizes S M --rounds 3 --threads 2]
    python bench/peers/train_step_vs_trl.py --smoke          # tiny model, one round (the test)
    python bench/peers/train_step_vs_trl.py --lora-rank 8    # LoRA on both: TRL with a PEFT LoraConfig

Needs TRL: `pip install -e .[bench]` (pin torch / transformers / megatron-core with a constraints file).

Workload (the same for both, built here, nothing downloaded):
  weights      one random Qwen2 of the size (S 5M, M 56M params; shapes of bench/generation.py,
               vocab 32,000, tied embeddings), saved as a Hugging Face checkpoint that both load, fp32;
               `--sizes moe-S`: a Qwen3-MoE of S's attention shape, 8 experts of width 256, top-2
               (7.4M params; results in bench/results/peers_moe.json)
  batch        16 trajectories: 64-token prompts, completion lengths uniform in [32, 448],
               random token ids, seed 1234; 4 groups of 4 with group-normalized random rewards
               as advantages; pi_old = the initial weights' log-probs (given to both)
  loss         PPO-clip 0.2 token-mean (Stacx recipe `grpo`; TRL loss_type "dapo": the sum over
               the batch's completion tokens divided by their number), no KL, no entropy bonus
               (both compute entropy as a metric, as their defaults do)
  optimizer    AdamW lr 1e-5, betas (0.9, 0.999), eps 1e-8, no weight decay, grad-norm clip 1.0,
               one optimizer step per training step over all 16 trajectories

A training step is, for TRL: `trainer.training_step` on the prepared batch (generation bypassed:
`_prepare_inputs` returns the batch as given), `clip_grad_norm_`, `optimizer.step`, `zero_grad`
(what `Trainer`'s inner loop runs); TRL's defaults otherwise, but no gradient checkpointing
(Stacx recomputes nothing either; `--trl-gradient-checkpointing` turns it on). For Stacx:
`RoleRuntime.train_step` on the micro-batches the driver plans (packed, 4096-token budget),
which includes the optimizer and scheduler steps.

With `--lora-rank R` both train LoRA adapters (rank R, `--lora-alpha`, on every linear: q, k, v, o, gate, up,
down) and nothing else: TRL's GRPOTrainer is given a PEFT `LoraConfig` (`peft_config`), Stacx `--lora-rank`. The
adapters are the same: TRL's are set to Stacx's initial ones (A from the seed, B zero). Stacx's fused q/k/v (and
gate/up) linear has one A where PEFT has three (two), a design difference: the two agree step by step until those
A's first move (B is zero at the first step, so A's gradient is zero then: the first two steps, warm-up and
round 1, agree; after that only the loss's trend is comparable). Results in bench/results/peers_lora.json.

Rounds alternate the order (TRL first on even rounds). Every step's loss and grad norm of the two
are compared (same weights, same data, same optimizer: they must agree step by step). Tokens/s
counts every real prompt and completion token of the 16 trajectories (no padding). Peak memory is
the peak RSS (VmHWM) of a fresh child process per side that builds the side and runs two
steps. Writes bench/results/peers.json; with --generation it adds the engine-vs-`generate` rows
of bench/generation.py run in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

from generation import SHAPES  # noqa: E402  (bench/generation.py: the S and M shapes)

SMOKE_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=64)
MOE_SHAPES = {
    # Qwen3-MoE of the S attention shape: 8 experts, top-2 routing (renormalized, as Qwen3-30B-A3B), every
    # layer sparse; 2 of 8 experts of 256 give each token the S model's 512-wide MLP compute.
    "moe-S": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
    "moe-smoke": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}
SIZES = dict(SHAPES, smoke=SMOKE_SHAPE, **MOE_SHAPES)
"""Size name -> Hugging Face config fields; a name in MOE_SHAPES is a Qwen3-MoE, the others Qwen2."""
GROUP_SIZE = 4
LOSS_RTOL = 1e-4
"""Step losses and grad norms of the two must agree to this relative tolerance (fp32; the packed and
the padded forward sum in different orders)."""


# ---- workload ---------------------------------------------------------------------------------

def write_checkpoint(directory: str, size: str, vocab_size: int, context_length: int) -> None:
    """A random Qwen2 (Qwen3-MoE for a MoE size) Hugging Face checkpoint of `size` (seed 0) with a character
    tokenizer. The MoE config turns Hugging Face's router auxiliary loss off (coefficient 0): Stacx's
    --moe-aux-loss-coeff is 0 by default, and the two define that loss over different token sets."""
    from stacx.models.testing import build_tiny_hf_model, tiny_hf_config
    from stacx.rollout.tokenizer import build_char_tokenizer

    arch = "qwen3_moe" if size in MOE_SHAPES else "qwen2"
    config = tiny_hf_config(arch, vocab_size=vocab_size, max_position_embeddings=context_length,
                            tie_word_embeddings=True, eos_token_id=1, bos_token_id=None, pad_token_id=0,
                            **SIZES[size], **({"router_aux_loss_coef": 0.0} if size in MOE_SHAPES else {}))
    build_tiny_hf_model(config, seed=0).save_pretrained(directory, safe_serialization=True)
    build_char_tokenizer().save_pretrained(directory)


def make_trajectories(args) -> dict:
    """16 trajectories: prompt ids [P], completion ids [L_i], advantage per trajectory (seeded)."""
    generator = torch.Generator().manual_seed(args.seed)
    n = args.trajectories
    lengths = torch.randint(args.min_completion, args.max_completion + 1, (n,), generator=generator).tolist()
    prompts = [torch.randint(2, args.vocab, (args.prompt_len,), generator=generator) for _ in range(n)]
    completions = [torch.randint(2, args.vocab, (length,), generator=generator) for length in lengths]
    rewards = torch.rand(n, generator=generator, dtype=torch.float64).view(-1, GROUP_SIZE)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    return {"prompts": prompts, "completions": completions, "advantages": advantages.float().tolist()}


def initial_log_probs(checkpoint: str, data: dict) -> list[torch.Tensor]:
    """pi_old: the initial weights' log-prob of every completion token (transformers forward, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    result = []
    with torch.no_grad():
        for prompt, completion in zip(data["prompts"], data["completions"]):
            tokens = torch.cat([prompt, completion]).unsqueeze(0)
            logits = model(tokens).logits[0, len(prompt) - 1: -1].double()
            result.append(torch.log_softmax(logits, -1).gather(1, completion.unsqueeze(1)).squeeze(1).float())
    return result


def num_step_tokens(data: dict) -> int:
    return sum(len(p) + len(c) for p, c in zip(data["prompts"], data["completions"]))


# ---- the two sides ----------------------------------------------------------------------------

class TrlSide:
    """TRL's GRPOTrainer: one training step = training_step + clip + optimizer step (Trainer's inner loop)."""

    name = "trl"

    def __init__(self, checkpoint: str, data: dict, old_log_probs: list[torch.Tensor], args, work_dir: str,
                 adapters: dict | None = None):
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        n = len(data["prompts"])
        config = GRPOConfig(
            output_dir=os.path.join(work_dir, "trl"), report_to="none", use_cpu=True, bf16=False,
            per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=GROUP_SIZE,
            max_completion_length=args.max_completion, loss_type="dapo", epsilon=0.2, beta=0.0,
            learning_rate=args.lr, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
            max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
            gradient_checkpointing=args.trl_gradient_checkpointing, seed=args.seed, logging_steps=1_000_000,
        )
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        dataset = Dataset.from_dict({"prompt": ["0"] * n})
        peft_config = None
        if args.lora_rank:
            from peft import LoraConfig

            peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, bias="none",
                                     target_modules=list(LORA_MODULES), task_type="CAUSAL_LM")
        self.trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                   args=config, train_dataset=dataset, peft_config=peft_config,
                                   processing_class=AutoTokenizer.from_pretrained(checkpoint))
        if args.lora_rank and adapters is not None:  # Stacx's initial adapters: the same starting point
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.trainer.model, adapters)
            if result.unexpected_keys:
                raise RuntimeError(f"PEFT did not take adapters {result.unexpected_keys[:4]}")
        self.trainer.create_optimizer_and_scheduler(num_training_steps=1000)
        self.trainer._prepare_inputs = lambda inputs: inputs  # the batch below is the generation's output
        self.trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which is not run here
        self.optimizer_kind = type(self.trainer.optimizer).__name__ + str(
            {k: v for k, v in self.trainer.optimizer.param_groups[0].items() if k in ("foreach", "fused")})

        longest = max(len(c) for c in data["completions"])
        completion_ids = torch.zeros(n, longest, dtype=torch.long)
        completion_mask = torch.zeros(n, longest, dtype=torch.long)
        old = torch.zeros(n, longest)
        for i, (completion, log_probs) in enumerate(zip(data["completions"], old_log_probs)):
            completion_ids[i, : len(completion)] = completion
            completion_mask[i, : len(completion)] = 1
            old[i, : len(completion)] = log_probs
        prompt_ids = torch.stack(data["prompts"])
        self.num_items = int(completion_mask.sum())
        self.inputs = {
            "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": torch.tensor(data["advantages"]), "old_per_token_logps": old,
            "num_items_in_batch": torch.tensor(self.num_items),
        }

    def step(self) -> dict:
        trainer = self.trainer
        model = trainer.model
        loss = trainer.training_step(model, dict(self.inputs), torch.tensor(self.num_items))
        trainable = [p for p in model.parameters() if p.requires_grad]
        grad_norm = trainer.accelerator.clip_grad_norm_(trainable, trainer.args.max_grad_norm)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model.zero_grad(set_to_none=True)
        return {"loss": float(loss), "grad_norm": float(grad_norm)}


class StacxSide:
    """Stacx's policy RoleRuntime (recipe grpo): one training step = RoleRuntime.train_step."""

    name = "stacx"

    def __init__(self, checkpoint: str, data: dict, old_log_probs: list[torch.Tensor], args, work_dir: str,
                 adapters: dict | None = None):
        from stacx.parallel.reduction import compute_step_counts
        from stacx.serving.cpu_engine import ensure_single_process_layout
        from stacx.trainer.batch import StepBatch, plan_micro_batches
        from stacx.trainer.config.run import RunConfig
        from stacx.trainer.factory import resolve_recipe
        from stacx.trainer.runtime.role_runtime import RoleRuntime

        groups = ensure_single_process_layout()
        run_config = RunConfig.from_dict({
            "hf_checkpoint": checkpoint, "algorithm": "grpo", "lr": args.lr, "adam_beta1": 0.9, "adam_beta2": 0.999,
            "weight_decay": 0.0, "clip_grad": 1.0, "num_steps": 1000, "seed": args.seed,
            "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch,
            "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
            **({"lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha} if args.lora_rank else {}),
        }, source="bench")
        training_config, algorithm = resolve_recipe(run_config)
        policy = next(role for role in training_config.roles if role.trainable)
        self.runtime = RoleRuntime(policy, algorithm, groups, model=run_config.model, optim=run_config.optim,
                                   train=run_config.train)
        self.optimizer_kind = optimizer_kind_of(self.runtime.optimizer)
        batch = StepBatch(tokens=[], response_lengths=[], loss_masks=[], advantages=[], log_probs=[],
                          rollout_log_probs=[])
        for prompt, completion, advantage, log_probs in zip(data["prompts"], data["completions"],
                                                            data["advantages"], old_log_probs):
            batch.tokens.append(torch.cat([prompt, completion]))
            batch.response_lengths.append(len(completion))
            batch.loss_masks.append(torch.ones(len(completion)))
            batch.advantages.append(torch.full((len(completion),), advantage))
            batch.log_probs.append(log_probs)
            batch.rollout_log_probs.append(log_probs)
        plan = plan_micro_batches(batch, dp_size=1, cp_size=1,
                                  max_tokens_per_micro_batch=args.max_tokens_per_micro_batch)
        self.micro_batches = [batch.select(indices) for indices in plan[0]]
        self.counts = compute_step_counts(batch.loss_masks, groups.dp)

    def peft_adapters(self) -> dict:
        """The policy's adapters under PEFT's names (the shared A of a fused linear repeated), for TRL's side."""
        from stacx.models import iter_hf_weight_buckets
        from stacx.models.lora import peft_named_tensors

        named = [pair for bucket in iter_hf_weight_buckets(self.runtime.model, self.runtime.groups, 1 << 30,
                                                            adapters=True) for pair in bucket]
        return {name: tensor.clone() for name, tensor in peft_named_tensors(named).items()}

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.runtime.model.parameters() if p.requires_grad)

    def step(self) -> dict:
        metrics = self.runtime.train_step(self.micro_batches, self.counts)
        return {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}


def optimizer_kind_of(megatron_optimizer) -> str:
    """The torch optimizer class inside megatron's wrapper, with its foreach / fused settings."""
    inner = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])[0].optimizer
    return type(inner).__name__ + str({k: v for k, v in inner.param_groups[0].items() if k in ("foreach", "fused")})


SIDES = {"trl": TrlSide, "stacx": StacxSide}
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""PEFT's target modules of `--lora-rank` (Stacx: --lora-target-modules all-linear)."""
LORA_AGREEING_STEPS = 2
"""With LoRA, the steps TRL and Stacx must agree on (module doc: the fused linears' one A moves from step 3)."""


def build_sides(checkpoint: str, data: dict, old: list, args, work_dir: str) -> dict:
    """Both sides; with LoRA, Stacx first, and TRL's adapters set to Stacx's initial ones."""
    stacx = StacxSide(checkpoint, data, old, args, work_dir)
    adapters = stacx.peft_adapters() if args.lora_rank else None
    return {"trl": TrlSide(checkpoint, data, old, args, work_dir, adapters=adapters), "stacx": stacx}


# ---- one size ---------------------------------------------------------------------------------

def child_peak_rss(side: str, size: str, args) -> int:
    """Peak RSS (bytes) of a fresh process that builds `side` for `size` and runs two steps."""
    command = [sys.executable, os.path.abspath(__file__), "--child", side, "--sizes", size,
               "--threads", str(args.threads), "--vocab", str(args.vocab), "--trajectories", str(args.trajectories),
               "--prompt-len", str(args.prompt_len), "--min-completion", str(args.min_completion),
               "--max-completion", str(args.max_completion), "--seed", str(args.seed), "--lr", str(args.lr),
               "--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha)]
    if args.trl_gradient_checkpointing:
        command.append("--trl-gradient-checkpointing")
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory child for {side} {size} failed:\n{out.stderr[-3000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_bytes"])


def run_child(args) -> int:
    size = args.sizes[0]
    with tempfile.TemporaryDirectory() as work_dir:
        checkpoint = os.path.join(work_dir, "ckpt")
        write_checkpoint(checkpoint, size, args.vocab, args.prompt_len + args.max_completion)
        data = make_trajectories(args)
        old = initial_log_probs(checkpoint, data)
        side = SIDES[args.child](checkpoint, data, old, args, work_dir)
        for _ in range(2):
            side.step()
    print(json.dumps({"peak_rss_bytes": peak_rss_bytes()}))
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that over from the
    parent across fork and exec, so a child of a big benchmark process would report the parent's."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no procfs: an upper bound


def add_memory(row: dict, args) -> None:
    row["trl_peak_rss_bytes"] = child_peak_rss("trl", row["size"], args)
    row["stacx_peak_rss_bytes"] = child_peak_rss("stacx", row["size"], args)
    row["ratio_peak_rss_stacx_over_trl"] = row["stacx_peak_rss_bytes"] / row["trl_peak_rss_bytes"]


def remeasure_memory(args) -> int:
    with open(args.out) as f:
        result = json.load(f)
    for row in result["rows"]:
        if row["size"] in args.sizes:
            add_memory(row, args)
            print_row(row)
    result["memory_load_average"] = os.getloadavg()
    result["memory_rerun"] = "python bench/peers/train_step_vs_trl.py --memory-only --sizes " + " ".join(args.sizes)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"updated {args.out}")
    return 0


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def bench_size(size: str, args) -> dict:
    with tempfile.TemporaryDirectory() as work_dir:
        checkpoint = os.path.join(work_dir, "ckpt")
        write_checkpoint(checkpoint, size, args.vocab, args.prompt_len + args.max_completion)
        data = make_trajectories(args)
        old = initial_log_probs(checkpoint, data)
        sides = build_sides(checkpoint, data, old, args, work_dir)
        trainable = {"trl": sum(p.numel() for p in sides["trl"].trainer.model.parameters() if p.requires_grad),
                     "stacx": sides["stacx"].trainable_parameters()}
        num_tokens = num_step_tokens(data)
        steps = {name: [] for name in sides}
        times = {name: [] for name in sides}
        for name, side in sides.items():  # warm-up step (also compared)
            steps[name].append(side.step())
        for round_index in range(args.rounds):
            order = ["trl", "stacx"] if round_index % 2 == 0 else ["stacx", "trl"]
            for name in order:
                start = time.perf_counter()
                steps[name].append(sides[name].step())
                times[name].append(time.perf_counter() - start)
        optimizer_kinds = {name: side.optimizer_kind for name, side in sides.items()}
        del sides
    compared = list(zip(steps["trl"], steps["stacx"]))[: LORA_AGREEING_STEPS if args.lora_rank else None]
    loss_diffs = [relative_difference(t["loss"], s["loss"]) for t, s in compared]
    norm_diffs = [relative_difference(t["grad_norm"], s["grad_norm"]) for t, s in compared]
    row = {
        "size": size, "tokens_per_step": num_tokens,
        "completion_tokens": sum(len(c) for c in data["completions"]),
        "padded_completion_slots": len(data["completions"]) * max(len(c) for c in data["completions"]),
        "trl_step_s": statistics.median(times["trl"]), "stacx_step_s": statistics.median(times["stacx"]),
        "trl_rounds_s": times["trl"], "stacx_rounds_s": times["stacx"],
        "trl_steps": steps["trl"], "stacx_steps": steps["stacx"],
        "max_loss_rel_diff": max(loss_diffs), "max_grad_norm_rel_diff": max(norm_diffs),
        "optimizers": optimizer_kinds, "trainable_parameters": trainable,
        "lora": {"rank": args.lora_rank, "alpha": args.lora_alpha, "compared_steps": len(compared)} if args.lora_rank else None,
    }
    row["trl_tokens_per_s"] = num_tokens / row["trl_step_s"]
    row["stacx_tokens_per_s"] = num_tokens / row["stacx_step_s"]
    row["ratio_tokens_per_s_stacx_over_trl"] = row["trl_step_s"] / row["stacx_step_s"]
    row["round_ratios"] = [t / s for t, s in zip(times["trl"], times["stacx"])]
    row["trl_padding_fraction"] = 1 - row["completion_tokens"] / row["padded_completion_slots"]
    if not args.skip_memory:
        add_memory(row, args)
    if row["max_loss_rel_diff"] > LOSS_RTOL or row["max_grad_norm_rel_diff"] > LOSS_RTOL:
        raise AssertionError(f"{size}: TRL and Stacx disagree (loss rel diff {row['max_loss_rel_diff']:.2e}, grad-norm "
                             f"rel diff {row['max_grad_norm_rel_diff']:.2e} > {LOSS_RTOL}): {steps}")
    return row


def print_row(row: dict) -> None:
    memory = (f", peak RSS TRL {row['trl_peak_rss_bytes'] / 2**30:.2f} GiB / Stacx "
              f"{row['stacx_peak_rss_bytes'] / 2**30:.2f} GiB ({row['ratio_peak_rss_stacx_over_trl']:.2f}x)"
              if "trl_peak_rss_bytes" in row else "")
    print(f"{row['size']}: TRL {row['trl_tokens_per_s']:.0f} tok/s, Stacx {row['stacx_tokens_per_s']:.0f} tok/s, "
          f"ratio {row['ratio_tokens_per_s_stacx_over_trl']:.2f}x (rounds {', '.join(f'{r:.2f}' for r in row['round_ratios'])})"
          f"{memory}; loss rel diff {row['max_loss_rel_diff']:.1e}, grad-norm rel diff {row['max_grad_norm_rel_diff']:.1e}",
          flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["S", "M"], choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--min-completion", type=int, default=32)
    parser.add_argument("--max-completion", type=int, default=448)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=4096)
    parser.add_argument("--trl-gradient-checkpointing", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on both sides (0: full)")
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--skip-memory", action="store_true", help="no peak-RSS child processes")
    parser.add_argument("--generation", action="store_true",
                        help="add the generation rows (bench/generation.py: engine vs HF generate)")
    parser.add_argument("--generation-new-tokens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--generation-sizes", nargs="+", choices=sorted(SHAPES),
                        help="sizes of the generation rows (default: --sizes)")
    parser.add_argument("--generation-rounds", type=int, help="rounds of the generation rows (default: --rounds)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, 8 short trajectories, one round, generation 4x8 (a test runs it)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only (re)measure the peak-RSS children and update the rows of --out in place")
    parser.add_argument("--child", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="results JSON (default bench/results/peers.json, peers_moe.json for MoE sizes)")
    args = parser.parse_args(argv)
    if args.out is None:
        moe = any(size in MOE_SHAPES for size in args.sizes)
        name = "peers_lora" if args.lora_rank else "peers_moe" if moe else "peers"
        args.out = os.path.join(BENCH_DIR, "results", f"{name}.json")
    if args.smoke:
        args.sizes = sorted({"moe-smoke" if size in MOE_SHAPES else "smoke" for size in args.sizes})
        args.rounds, args.trajectories, args.vocab = 1, 8, 512
        args.prompt_len, args.min_completion, args.max_completion = 8, 4, 24
        args.generation_new_tokens = [8]
    if args.lora_rank and any(size in MOE_SHAPES for size in args.sizes):
        parser.error("--lora-rank: the LoRA comparison covers the dense sizes (PEFT and Stacx adapt routed experts "
                     "differently)")
    if args.trajectories % GROUP_SIZE:
        parser.error(f"--trajectories must be a multiple of the group size {GROUP_SIZE}")
    torch.set_num_threads(args.threads)
    if args.child:
        return run_child(args)
    if args.memory_only:
        return remeasure_memory(args)

    rows = []
    for size in args.sizes:
        row = bench_size(size, args)
        print_row(row)
        rows.append(row)
    result = {
        "benchmark": "train_step_vs_trl", "rows": rows, "rounds": args.rounds, "threads": args.threads,
        "workload": {k: getattr(args, k) for k in ("trajectories", "prompt_len", "min_completion", "max_completion",
                                                    "vocab", "seed", "lr", "max_tokens_per_micro_batch",
                                                    "trl_gradient_checkpointing", "lora_rank", "lora_alpha")},
        "load_average": os.getloadavg(), "torch": torch.__version__, "python": sys.version.split()[0],
        "machine": platform.machine(), "versions": package_versions(),
        "rerun": "python bench/peers/train_step_vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.generation:
        import generation

        gen_out = os.path.join(tempfile.mkdtemp(), "generation.json")
        gen_sizes = ["S"] if args.smoke else (args.generation_sizes or [s for s in args.sizes if s in SHAPES])
        gen_rounds = args.generation_rounds or args.rounds
        gen_args = ["--shapes", *gen_sizes, "--new-tokens", *map(str, args.generation_new_tokens),
                    "--rounds", str(gen_rounds), "--threads", str(args.threads), "--out", gen_out]
        if args.smoke:
            gen_args += ["--prompts", "4", "--prompt-len", "8", "--vocab", "512"]
        generation.main(gen_args)
        with open(gen_out) as f:
            result["generation"] = json.load(f)["rows"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def package_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("trl", "transformers", "accelerate", "megatron-core"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


if __name__ == "__main__":
    sys.exit(main())
