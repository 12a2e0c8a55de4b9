"""Generation tokens/s of the CPU engine (KV-cache decoder) against Hugging Face `generate` and vLLM.

    python bench/generation.py [--shapes S M --new-tokens 128 512 --prompts 16 --prompt-len 64
                                --rounds 3 --threads 2 --include-packed]
    python bench/generation.py --shapes 256x4 512x8 --new-tokens 128 --rounds 3 \
        --vllm-python VENV/bin/python [--no-hf-generate]

For each model shape, one random Qwen2-shaped megatron model is built (seed 0) and its Hugging
Face-named weights are loaded into a `transformers` Qwen2ForCausalLM, so both sides run the same
weights. For each number of new tokens and each mode (greedy; sampled at T = 1 with no top-k /
top-p), in the same process and alternating round by round:
  stacx        CpuEngine.generate(requests) (decoding="kv_cache"), ignore_eos, per-token log-probs; with
               --vllm-python its torch threads are bound to cores 0..threads-1 as vLLM's are (`bind_cores`,
               --stacx-cpu-bind; "none" leaves them to the scheduler, the default without vLLM)
  hf_generate  model.generate(prompts, max_new_tokens=N, min_new_tokens=N), its KV cache, fp32
  vllm         (--vllm-python) vLLM's offline `LLM.generate` on the same weights (saved as a Hugging Face
               checkpoint) and prompt ids, fp32, in a worker process of vLLM's own Python environment
               (bench/vllm_generation_worker.py; vLLM cannot share Stacx's environment). Its OpenMP threads
               are bound to cores 0..threads-1 (VLLM_CPU_OMP_THREADS_BIND, --vllm-cpu-bind), its KV cache
               gets VLLM_CPU_KVCACHE_SPACE=1 GiB. Without the flag its column reads "not run".
  packed       (--include-packed) CpuEngine(decoding="packed"), the decoder without a cache
Every run produces prompts x N tokens. Prints the best (max) and median tokens/s of each, the
ratios stacx / hf_generate and stacx / vllm (by wall time; by process CPU time for HF, which runs
in this process), the load average, how many greedy rows' first 8 tokens agree with vLLM's, and the
max abs difference between the engine's log-probs and the trainer's packed forward of the same
tokens (fp32). Writes bench/results/generation.json.

Shapes (Qwen2: q/k/v bias, tied embeddings, head dim 64; vocab 32,000 unless given):
  S      hidden 128, 4 layers, 4 heads (2 kv), ffn 512                   ~5.2M params
  M      hidden 512, 13 layers, 8 heads (2 kv), ffn 1536                 ~56M params
  256x4  hidden 256, 4 layers, 4 heads (2 kv), ffn 768, vocab 4,096      ~4.2M params
  512x8  hidden 512, 8 layers, 8 heads (2 kv), ffn 1536                  ~40.5M params
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = {
    "S": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=512),
    "M": dict(hidden_size=512, num_hidden_layers=13, num_attention_heads=8, num_key_value_heads=2,
              intermediate_size=1536),
    "256x4": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=768, vocab_size=4096),
    "512x8": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=1536),
}
DEFAULT_VOCAB = 32000
AGREEMENT_TOKENS = 8
"""Greedy rows count as agreeing with vLLM when their first this-many tokens are identical (fp32 kernels
differ in rounding, so long greedy continuations may part at a near-tie)."""
PROCESS_CORES = os.sched_getaffinity(0)
"""The cores this process may run on when it starts (children get them back, whatever the bench bound)."""
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_generation_worker.py")


class VllmWorker:
    """bench/vllm_generation_worker.py running under `python` (vLLM's environment) on checkpoint `model_dir`."""

    def __init__(self, python: str, model_dir: str, *, max_model_len: int, max_num_seqs: int, cpu_bind: str,
                 log_path: str):
        sys.path.insert(0, os.path.dirname(WORKER))
        from vllm_generation_worker import REPLY_PREFIX

        self._prefix = REPLY_PREFIX
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu_bind, VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_ENABLE_V1_MULTIPROCESSING=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"))
        env.pop("PYTHONPATH", None)  # Stacx's environment must not leak into vLLM's
        self._log = open(log_path, "w")
        # The bench's own thread may be bound to one core by now (--stacx-cpu-bind); vLLM binds its own.
        self._process = subprocess.Popen(
            [python, WORKER, "--model", model_dir, "--max-model-len", str(max_model_len),
             "--max-num-seqs", str(max_num_seqs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
            preexec_fn=lambda: os.sched_setaffinity(0, PROCESS_CORES))
        self._log_path = log_path
        self._read()  # {"ready": true} once the model is loaded (and compiled)

    def _read(self) -> dict:
        for line in self._process.stdout:
            if line.startswith(self._prefix):
                return json.loads(line[len(self._prefix):])
            self._log.write(line)  # vLLM's own log lines
            self._log.flush()
        raise RuntimeError(f"the vLLM worker exited (code {self._process.wait()}); its log: {self._log_path}")

    def generate(self, prompts, new_tokens: int, temperature: float) -> dict:
        """{"seconds": wall time of vLLM's generate call, "output_ids": per prompt}."""
        self._process.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens,
                                              "temperature": temperature}) + "\n")
        self._process.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self._process.stdin.write("\n")
            self._process.stdin.close()
            self._process.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
        self._log.close()


def build_pair(shape: str, vocab_size: int, context_length: int, groups):
    """(megatron model, transformers model) of `shape` holding the same random fp32 weights."""
    from transformers import AutoModelForCausalLM

    from stacx.models import build_model, iter_hf_weight_buckets
    from stacx.models.testing import tiny_hf_config

    fields = dict(SHAPES[shape])
    vocab_size = vocab_size or fields.pop("vocab_size", DEFAULT_VOCAB)
    fields.pop("vocab_size", None)
    config = tiny_hf_config("qwen2", vocab_size=vocab_size, max_position_embeddings=context_length,
                            tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                            **fields)
    torch.manual_seed(0)
    model = build_model(config, groups).eval()
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    named = dict(tensor for bucket in iter_hf_weight_buckets(model, groups, bucket_bytes=1 << 62) for tensor in bucket)
    missing, _ = hf_model.load_state_dict(named, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding
    return model, hf_model


def max_log_prob_error(model, groups, prompts, outputs) -> float:
    """Max |engine log-prob - trainer packed-forward log-prob| over every generated token (T = 1)."""
    from stacx.models import forward_packed, hf_config_of

    vocab_size = hf_config_of(model).vocab_size
    worst = 0.0
    with torch.no_grad():
        for prompt, output in zip(prompts, outputs):
            sequence = list(prompt) + output.output_ids
            logits = forward_packed(model, torch.tensor(sequence), [len(sequence)], groups)[:, :vocab_size]
            ref = torch.log_softmax(logits.double(), -1)[len(prompt) - 1: -1]
            got = torch.tensor(output.output_log_probs, dtype=torch.float64)
            worst = max(worst, (ref.gather(1, torch.tensor(output.output_ids).unsqueeze(1)).squeeze(1) - got).abs().max().item())
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["S"], choices=list(SHAPES))
    parser.add_argument("--new-tokens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=None,
                        help=f"vocabulary of every shape (default: the shape's own, else {DEFAULT_VOCAB})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--include-packed", action="store_true",
                        help="also time the engine's decoder without a cache (slow: one round)")
    parser.add_argument("--vllm-python", default=None,
                        help="the python of an environment with vllm (e.g. a venv's bin/python): adds the vLLM column")
    parser.add_argument("--vllm-cpu-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND for vLLM's worker (default: cores 0..threads-1)")
    parser.add_argument("--stacx-cpu-bind", default=None,
                        help="cores for the Stacx engine's threads, e.g. 0-1, or 'none' to leave them to the scheduler "
                             "(default with --vllm-python: cores 0..threads-1, as vLLM's; else none)")
    parser.add_argument("--no-hf-generate", action="store_true", help="skip the Hugging Face generate column")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "generation.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.wire.types import GenerateRequest, SamplingParams

    groups = ensure_single_process_layout()
    load_before = os.getloadavg()
    rows = []
    for shape in args.shapes:
        model, hf_model = build_pair(shape, args.vocab, args.prompt_len + max(args.new_tokens), groups)
        vocab_size = hf_model.config.vocab_size
        num_params = sum(p.numel() for p in hf_model.parameters())
        engine = CpuEngine(model, seed=0, bind_cores=stacx_cores(args))
        packed = CpuEngine(model, decoding="packed") if args.include_packed else None
        prompts = torch.randint(1, vocab_size, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(1))
        prompt_lists = [tuple(p) for p in prompts.tolist()]
        if not args.no_hf_generate:
            with torch.no_grad():  # warm-up
                hf_model.generate(prompts[:2], attention_mask=torch.ones_like(prompts[:2]), max_new_tokens=4, pad_token_id=0)
        vllm, checkpoint_dir = None, None
        if args.vllm_python:
            checkpoint_dir = tempfile.mkdtemp(prefix=f"generation_bench_{shape}_")
            hf_model.save_pretrained(checkpoint_dir, safe_serialization=True)
            start = time.perf_counter()
            vllm = VllmWorker(args.vllm_python, checkpoint_dir, max_model_len=args.prompt_len + max(args.new_tokens),
                              max_num_seqs=args.prompts, cpu_bind=args.vllm_cpu_bind or f"0-{args.threads - 1}",
                              log_path=os.path.join(checkpoint_dir, "vllm.log"))
            print(f"{shape}: vLLM ready in {time.perf_counter() - start:.0f} s", flush=True)
            vllm.generate([list(p) for p in prompt_lists[:2]], 4, 0.0)  # warm-up
        try:
            rows += run_shape(args, shape, num_params, model, hf_model, groups, engine, packed, vllm, prompts,
                              prompt_lists, GenerateRequest, SamplingParams)
        finally:
            if vllm is not None:
                vllm.close()
        if checkpoint_dir is not None:  # kept (with vLLM's log) when the run failed
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
    result = {
        "benchmark": "generation", "rows": rows, "threads": args.threads, "rounds": args.rounds,
        "stacx_cpu_bind": stacx_cpu_bind(args),
        "load_average_1_5_15_before": load_before, "load_average_1_5_15_after": os.getloadavg(),
        "torch": torch.__version__, "python": sys.version.split()[0], "machine": platform.machine(),
        "rerun": "python bench/generation.py " + " ".join(rerun_arguments(argv if argv is not None else sys.argv[1:])),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"load average before {load_before}, after {os.getloadavg()}; wrote {args.out}")
    return 0


def stacx_cores(args) -> "tuple[int, ...] | None":
    """The engine's `bind_cores` (None: not bound)."""
    from stacx.serving.cpu_threads import parse_core_list

    text = stacx_cpu_bind(args)
    return None if text == "none" else parse_core_list(text)


def stacx_cpu_bind(args) -> str:
    """--stacx-cpu-bind, defaulting to vLLM's cores when vLLM runs beside the engine, else "none"."""
    return args.stacx_cpu_bind or (f"0-{args.threads - 1}" if args.vllm_python else "none")


def rerun_arguments(argv) -> list[str]:
    """The command line to record: --vllm-python's value as VENV/bin/python (a machine's own path), --out left out."""
    kept, skip = [], None
    for argument in argv:
        if skip is not None:
            kept += [] if skip == "--out" else ["VENV/bin/python"]
            skip = None
        elif argument in ("--vllm-python", "--out"):
            skip = argument
            kept += [] if argument == "--out" else [argument]
        elif argument.startswith(("--vllm-python=", "--out=")):
            kept += [] if argument.startswith("--out=") else ["--vllm-python=VENV/bin/python"]
        else:
            kept.append(argument)
    return kept


def run_shape(args, shape, num_params, model, hf_model, groups, engine, packed, vllm, prompts, prompt_lists,
              GenerateRequest, SamplingParams) -> list[dict]:
    """Every (new tokens, mode) row of one shape, the engines alternating round by round."""
    rows = []
    for new_tokens in args.new_tokens:
        for mode in args.modes:
            temperature = 0.0 if mode == "greedy" else 1.0
            requests = [GenerateRequest(input_ids=p, sampling=SamplingParams(
                max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True, seed=1000 + i))
                for i, p in enumerate(prompt_lists)]
            num_tokens = args.prompts * new_tokens

            def run_hf():
                torch.manual_seed(0)
                with torch.no_grad():
                    out = hf_model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                            do_sample=mode == "sampled", temperature=1.0 if mode == "sampled" else None,
                                            top_k=0 if mode == "sampled" else None, top_p=1.0 if mode == "sampled" else None,
                                            pad_token_id=0)
                assert out.shape == (args.prompts, args.prompt_len + new_tokens), out.shape

            engine.generate(requests[:2])  # warm-up: first weight copy into the cache mirror, allocator
            times = {"stacx": [], "hf_generate": [], "vllm": []}
            cpu = {"stacx": [], "hf_generate": []}
            outputs, vllm_ids = None, None
            for _ in range(args.rounds):
                start, start_cpu = time.perf_counter(), time.process_time()
                outputs = engine.generate(requests)
                times["stacx"].append(time.perf_counter() - start)
                cpu["stacx"].append(time.process_time() - start_cpu)
                assert sum(len(o.output_ids) for o in outputs) == num_tokens
                if not args.no_hf_generate:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    run_hf()
                    times["hf_generate"].append(time.perf_counter() - start)
                    cpu["hf_generate"].append(time.process_time() - start_cpu)
                if vllm is not None:
                    reply = vllm.generate([list(p) for p in prompt_lists], new_tokens, temperature)
                    vllm_ids = reply["output_ids"]
                    assert sum(len(ids) for ids in vllm_ids) == num_tokens, "vLLM stopped a row early"
                    times["vllm"].append(reply["seconds"])
            row = {"shape": shape, "params": num_params, "mode": mode, "prompts": args.prompts,
                   "prompt_len": args.prompt_len, "new_tokens": new_tokens, "load_average_1min": os.getloadavg()[0],
                   "max_abs_log_prob_error_vs_trainer": max_log_prob_error(model, groups, prompt_lists, outputs)}
            for name, seconds in times.items():
                if seconds:
                    row[f"{name}_rounds_s"] = seconds
                    row[f"{name}_s"] = statistics.median(seconds)
                    row[f"{name}_tokens_per_s"] = num_tokens / row[f"{name}_s"]
                    row[f"{name}_best_tokens_per_s"] = num_tokens / min(seconds)
            if times["hf_generate"]:
                row["ratio_stacx_over_hf"] = row["hf_generate_s"] / row["stacx_s"]
                # CPU seconds (all threads): steadier than wall time when other processes share the cores
                row["stacx_cpu_s"], row["hf_generate_cpu_s"] = statistics.median(cpu["stacx"]), statistics.median(cpu["hf_generate"])
                row["cpu_time_ratio_stacx_over_hf"] = row["hf_generate_cpu_s"] / row["stacx_cpu_s"]
            if times["vllm"]:
                row["ratio_stacx_over_vllm"] = row["vllm_s"] / row["stacx_s"]
                row["best_ratio_stacx_over_vllm"] = min(times["vllm"]) / min(times["stacx"])
                # per round (each Stacx round and the vLLM round right after it)
                row["round_ratios_stacx_over_vllm"] = [v / s for s, v in zip(times["stacx"], times["vllm"])]
                if mode == "greedy":
                    row[f"greedy_rows_first_{AGREEMENT_TOKENS}_tokens_equal_vllm"] = sum(
                        o.output_ids[:AGREEMENT_TOKENS] == ids[:AGREEMENT_TOKENS] for o, ids in zip(outputs, vllm_ids))
            if packed is not None:
                start = time.perf_counter()
                packed_outputs = packed.generate(requests)
                row["packed_s"] = time.perf_counter() - start
                if "hf_generate_s" in row:
                    row["ratio_packed_over_hf"] = row["hf_generate_s"] / row["packed_s"]
                if mode == "greedy":
                    row["greedy_identical_to_packed"] = all(
                        a.output_ids == b.output_ids for a, b in zip(outputs, packed_outputs))
            rows.append(row)
            print(describe(row), flush=True)
    return rows


def describe(row: dict) -> str:
    """One printed line per row."""
    text = (f"{row['shape']} ({row['params'] / 1e6:.1f}M) {row['mode']:7s} {row['prompts']}x{row['new_tokens']}: "
            f"stacx {row['stacx_tokens_per_s']:.0f} tok/s (best {row['stacx_best_tokens_per_s']:.0f})")
    if "hf_generate_s" in row:
        text += (f", hf generate {row['hf_generate_tokens_per_s']:.0f} tok/s, ratio {row['ratio_stacx_over_hf']:.2f}x "
                 f"(cpu-time {row['cpu_time_ratio_stacx_over_hf']:.2f}x)")
    if "vllm_s" in row:
        text += (f", vllm {row['vllm_tokens_per_s']:.0f} tok/s (best {row['vllm_best_tokens_per_s']:.0f}), "
                 f"stacx/vllm {row['ratio_stacx_over_vllm']:.2f}x median, {row['best_ratio_stacx_over_vllm']:.2f}x best")
        key = f"greedy_rows_first_{AGREEMENT_TOKENS}_tokens_equal_vllm"
        if key in row:
            text += f", first {AGREEMENT_TOKENS} tokens equal on {row[key]}/{row['prompts']}"
    else:
        text += ", vllm: not run (set --vllm-python)"
    if "packed_s" in row:
        text += f", packed {row['packed_s']:.2f} s"
    return text + f", log-prob err {row['max_abs_log_prob_error_vs_trainer']:.1e}, load {row['load_average_1min']:.1f}"


if __name__ == "__main__":
    sys.exit(main())
