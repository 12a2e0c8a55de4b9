"""vLLM's side of `bench/generation.py`: runs in vLLM's own Python environment, not Stacx's.

    <vllm-python> bench/vllm_generation_worker.py --model FOLDER --max-model-len N --max-num-seqs B

Loads FOLDER (a Hugging Face checkpoint; no tokenizer needed: prompts are token ids) into vLLM's offline
`LLM` in fp32, then answers one JSON request per stdin line with one JSON line on stdout prefixed
`REPLY_PREFIX` (vLLM logs to the same streams):

    {"prompts": [[ids], ...], "new_tokens": N, "temperature": T}
    -> {"seconds": wall time of the generate call, "output_ids": [[ids], ...]}

Every request generates exactly N tokens (eos ignored, min_tokens = N); T = 0 is greedy, T = 1 samples
from the full distribution (no top-k / top-p; vLLM's engine seed, no per-request seed). An empty line
ends the worker. It imports nothing from Stacx, so vLLM's environment needs only vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

REPLY_PREFIX = "VLLM_BENCH_REPLY "


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams  # imported here: only in vLLM's environment
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="float32", skip_tokenizer_init=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, seed=0)
    print(REPLY_PREFIX + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        params = SamplingParams(max_tokens=request["new_tokens"], min_tokens=request["new_tokens"], ignore_eos=True,
                                temperature=request["temperature"], top_p=1.0, top_k=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        reply = {"seconds": seconds, "output_ids": [list(out.outputs[0].token_ids) for out in outputs]}
        print(REPLY_PREFIX + json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard keeps it from re-running main
    sys.exit(main())
