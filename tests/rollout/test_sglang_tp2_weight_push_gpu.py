"""GPU tier: two trainer ranks at TP=2 push their weights to an SGLang server started with --tp 2,
through the path a run takes, and the server's prompt log-probs then equal the trainer's.

The path: `RoleRuntime.push_weights_to_engine` (every TP rank takes part in the gathers, TP rank 0
receives the full Hugging Face tensors and sends them), `engine_client("sglang", url)` (the client a
run builds: `/update_weights_from_tensor` with one serialized entry per server TP rank, the server's
`tp_size` read from `/get_server_info`, the last bucket flushing the prefix cache). The trainer and
the server share the two GPUs, as in a colocated run.

Needs 2 CUDA GPUs and SGLang (pip install 'stacx[sglang]'). Run with:
    python -m pytest -m gpu tests/rollout/test_sglang_tp2_weight_push_gpu.py
The CPU tests of its parts: the buckets of a TP=2 push (tests/models/test_checkpoint.py,
`test_tp2_export_is_byte_identical_and_buckets_stream_every_tensor`), the request bodies
(tests/rollout/test_sglang_engine.py).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import types

import pytest
import torch

#: bf16 weights on both sides, different kernels (megatron-core's TE layers vs SGLang's): per-token
#: log-probs agree to within this many nats at most, and on average to within the mean bound. For
#: scale, this model in bf16 differs from itself in fp32 by 0.08 nats at most, 0.04 on average
#: (`transformers` on CPU); two bf16 implementations may each be that far off, in opposite directions.
BF16_MAX_ABS_LOG_PROB_ERROR = 0.25
BF16_MEAN_ABS_LOG_PROB_ERROR = 0.1
#: The server starts from other random weights (2.5 nats apart on average, fp32): before the push its
#: log-probs must be this many times the mean tolerance away from the trainer's, or the comparison after
#: it would prove nothing.
BEFORE_PUSH_MIN_SEPARATION = 10.0

NUM_GPUS = 2
#: head_dim 64 (hidden 128 / 2 heads): a size every SGLang attention backend serves. A large
#: initializer range gives peaked next-token distributions, so two random models differ clearly.
MODEL = dict(arch="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, initializer_range=0.2, vocab_size=101)
PROMPT = (5, 17, 42, 8, 99, 3, 64, 21, 7, 88, 13, 50, 2, 77, 31, 9)

needs_two_gpus_and_sglang = pytest.mark.skipif(
    torch.cuda.device_count() < NUM_GPUS or importlib.util.find_spec("sglang") is None,
    reason="needs 2 CUDA GPUs and SGLang installed (pip install 'stacx[sglang]'); marked gpu, run with: "
           "pytest -m gpu tests/rollout/test_sglang_tp2_weight_push_gpu.py")


def _trainer_rank(rank: int, port: int, checkpoint: str, url: str, queue) -> None:
    """One of the two trainer ranks: the policy at TP=2 in bf16, its prompt log-probs, then the push."""
    import torch.distributed as dist

    from stacx.models import build_model, forward_packed, load_hf_checkpoint
    from stacx.parallel.groups import destroy_parallel_layout, initialize_parallel_layout
    from stacx.parallel.vocab_parallel import vocab_parallel_log_probs
    from stacx.trainer.loop import WEIGHT_BUCKET_BYTES
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=NUM_GPUS)
    try:
        groups = initialize_parallel_layout(NUM_GPUS, 1)
        model = build_model(checkpoint, groups, params_dtype=torch.bfloat16, initialize_weights=False)
        load_hf_checkpoint(model, checkpoint, groups)
        model.eval()
        tokens = torch.tensor(PROMPT)
        with torch.no_grad():
            logits = forward_packed(model, tokens, [len(PROMPT)], groups)  # [T, V_pad / 2], fp32
            log_probs = vocab_parallel_log_probs(logits[:-1], tokens[1:].to(logits.device), tp_group=groups.tp)
        # The rank's runtime as far as the push reads it; the push itself is RoleRuntime's own code.
        runtime = types.SimpleNamespace(model=model, groups=groups, _engine_clients={}, lora=None)
        runtime.weight_buckets = functools.partial(RoleRuntime.weight_buckets, runtime)
        sent = RoleRuntime.push_weights_to_engine(runtime, "sglang", url, 1, WEIGHT_BUCKET_BYTES)
        queue.put((rank, sent, log_probs.cpu()))
    except BaseException as err:
        queue.put((rank, None, repr(err)))
        raise
    finally:
        destroy_parallel_layout()
        dist.destroy_process_group()


def _server_log_probs(url: str) -> torch.Tensor:
    """The server's log p(token_t | tokens before t) for t = 1.. of PROMPT (position 0 has none)."""
    from stacx.rollout.engines.registry import engine_client
    from stacx.wire.types import GenerateRequest, SamplingParams

    request = GenerateRequest(input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=0), logprob_start_len=0)
    (output,) = engine_client("sglang", url).generate([request])
    return torch.tensor(output.input_log_probs[1:], dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.distributed
@needs_two_gpus_and_sglang
def test_tp2_trainer_push_to_a_tp2_sglang_server_gives_the_trainers_log_probs(tmp_path):
    import torch.multiprocessing as mp

    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.rollout.engines.sglang import SglangServerProcess, SglangServerSpec
    from stacx.testing.distributed import find_free_port

    model = dict(MODEL)
    arch = model.pop("arch")
    trainer_checkpoint, server_checkpoint = str(tmp_path / "trainer"), str(tmp_path / "server")
    save_tiny_hf_checkpoint(trainer_checkpoint, arch, seed=1, **model)
    save_tiny_hf_checkpoint(server_checkpoint, arch, seed=2, **model)
    # No tokenizer in the folders: the server takes token ids only.
    server = SglangServerProcess(SglangServerSpec(
        model_path=server_checkpoint, port=find_free_port(), host="127.0.0.1", tensor_model_parallel_size=NUM_GPUS,
        mem_fraction_static=0.3,
        extra_args=("--skip-tokenizer-init", "--dtype", "bfloat16", "--disable-cuda-graph")), startup_timeout_s=600)
    ranks = []
    try:
        before = _server_log_probs(server.url)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = find_free_port()
        ranks = [ctx.Process(target=_trainer_rank, args=(rank, port, trainer_checkpoint, server.url, queue))
                 for rank in range(NUM_GPUS)]
        for process in ranks:
            process.start()
        results = {}
        for _ in ranks:
            rank, sent, value = queue.get(timeout=600)
            assert sent is not None, f"trainer rank {rank}: {value}"
            results[rank] = (sent, value)
        for process in ranks:
            process.join(timeout=60)
        after = _server_log_probs(server.url)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
        server.stop()

    (sent_0, trainer), (sent_1, trainer_1) = results[0], results[1]
    from safetensors.torch import load_file

    # Every tensor of the checkpoint, each once, from TP rank 0 only (TP rank 1 only takes part in the gathers).
    assert sent_0 == len(load_file(os.path.join(trainer_checkpoint, "model.safetensors"))) and sent_1 == 0
    assert torch.equal(trainer, trainer_1)  # the vocab-parallel log-probs are the same on both TP ranks
    assert after.shape == trainer.shape == (len(PROMPT) - 1,)
    separation = (before - trainer).abs().mean().item()
    assert separation > BEFORE_PUSH_MIN_SEPARATION * BF16_MEAN_ABS_LOG_PROB_ERROR, separation
    error = (after - trainer).abs()
    assert error.max().item() <= BF16_MAX_ABS_LOG_PROB_ERROR, error
    assert error.mean().item() <= BF16_MEAN_ABS_LOG_PROB_ERROR, error
