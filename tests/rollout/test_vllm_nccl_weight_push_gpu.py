"""GPU tier: two trainer ranks at TP=2 push their weights into a running vLLM server through vLLM's own NCCL
weight-transfer engine (`--vllm-weight-transfer nccl`), by the path a run takes, and the server then serves
the trainer's weights: every tensor's digest equals the sent one, and its prompt log-probs equal the trainer's.

The path: `RoleRuntime.push_weights_to_engine(..., weight_transfer="nccl")` (both TP ranks take part in the
gathers, TP rank 0 alone sends), `engine_client("vllm", url, weight_transfer="nccl")`, whose first push asks
`/get_world_size`, mints an NCCL unique id and joins the server's worker as rank 0 of 2 while it posts
`/init_weight_transfer_engine` (`nccl_unique_id_b64`, vLLM's torch-free rendezvous; the warm-up all-reduce),
then `/start_weight_update`, one `/update_weights` per bucket while it broadcasts, `/finish_weight_update`,
`/update_weight_version`, and the Stacx worker extension's `stacx_transfer_finished`; the post-sync check reads
every tensor back. The server runs on GPU 1 (NCCL takes one rank per GPU: the sender holds GPU 0).

Needs 2 CUDA GPUs and a vLLM GPU environment (STACX_VLLM_PYTHON: its python; vLLM 0.32). Run with:
    STACX_VLLM_PYTHON=ENV/bin/python python -m pytest -m gpu tests/rollout/test_vllm_nccl_weight_push_gpu.py
The CPU tests of its parts: tests/rollout/test_vllm_weight_transfer.py (the calls, their order and bodies
against vLLM 0.32's schema, a gloo group in place of NCCL, the unique-id payload, which rank sends) and
tests/vllm/test_vllm_weight_transfer.py (the same API into a real vLLM CPU server over gloo).
"""

from __future__ import annotations

import functools
import os
import types

import pytest
import torch

#: fp32 weights on both sides, different kernels (megatron-core vs vLLM's, TF32 allowed on either): per-token
#: log-probs agree to within this many nats at most, and on average within the mean bound.
FP32_MAX_ABS_LOG_PROB_ERROR = 0.02
FP32_MEAN_ABS_LOG_PROB_ERROR = 0.005
#: The server starts from other random weights: before the push its log-probs must be this many times the mean
#: tolerance away from the trainer's, or the comparison after it would prove nothing.
BEFORE_PUSH_MIN_SEPARATION = 10.0

NUM_GPUS = 2
SERVER_GPU = "1"
PROMPT = (3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 5, 8, 13, 4, 6, 9)

needs_two_gpus_and_vllm = pytest.mark.skipif(
    torch.cuda.device_count() < NUM_GPUS or not os.environ.get("STACX_VLLM_PYTHON"),
    reason="needs 2 CUDA GPUs and a vLLM GPU environment (STACX_VLLM_PYTHON); marked gpu, run with: "
           "STACX_VLLM_PYTHON=ENV/bin/python pytest -m gpu tests/rollout/test_vllm_nccl_weight_push_gpu.py")


def _trainer_rank(rank: int, port: int, checkpoint: str, url: str, queue) -> None:
    """One of the two trainer ranks: the policy at TP=2 in fp32, its prompt log-probs, then the checked push."""
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
        model = build_model(checkpoint, groups, params_dtype=torch.float32, initialize_weights=False)
        load_hf_checkpoint(model, checkpoint, groups)
        model.eval()
        tokens = torch.tensor(PROMPT)
        with torch.no_grad():
            logits = forward_packed(model, tokens, [len(PROMPT)], groups)
            log_probs = vocab_parallel_log_probs(logits[:-1], tokens[1:].to(logits.device), tp_group=groups.tp)
        # The rank's runtime as far as the push reads it; the push itself is RoleRuntime's own code.
        runtime = types.SimpleNamespace(model=model, groups=groups, _engine_clients={}, lora=None)
        runtime.weight_buckets = functools.partial(RoleRuntime.weight_buckets, runtime)
        sent = RoleRuntime.push_weights_to_engine(runtime, "vllm", url, 1, WEIGHT_BUCKET_BYTES, check_weights=True,
                                                  weight_transfer="nccl")
        queue.put((rank, sent, log_probs.cpu()))
        for client in runtime._engine_clients.values():
            client.shutdown()
    except BaseException as err:
        queue.put((rank, None, repr(err)))
        raise
    finally:
        destroy_parallel_layout()
        dist.destroy_process_group()


def _server_log_probs(url: str) -> torch.Tensor:
    """The server's log p(token_t | tokens before t) for t = 1.. of PROMPT (position 0 has none)."""
    from stacx.rollout.engines.vllm import VllmEngine
    from stacx.wire.types import GenerateRequest, SamplingParams

    engine = VllmEngine(url)
    try:
        request = GenerateRequest(input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=0), logprob_start_len=0)
        (output,) = engine.generate([request])
    finally:
        engine.shutdown()
    return torch.tensor(output.input_log_probs[1:], dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.distributed
@needs_two_gpus_and_vllm
def test_tp2_trainer_push_over_vllms_nccl_engine_is_checked_and_gives_the_trainers_log_probs(tmp_path, monkeypatch):
    import requests
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from stacx.rollout.engines.vllm import VllmServerProcess, vllm_python
    from stacx.tasks import write_tiny_checkpoint
    from stacx.testing.distributed import find_free_port

    # A tiny fp32 Llama with its tokenizer (which vLLM loads), from two seeds: two heads of 64, a size every vLLM
    # attention backend serves.
    trainer_checkpoint, server_checkpoint = (
        write_tiny_checkpoint(str(tmp_path / name / "sorting"), "sorting", seed=seed, hidden_size=128,
                              num_attention_heads=2, max_position_embeddings=256)
        for name, seed in (("trainer", 1), ("server", 2)))
    with monkeypatch.context() as server_env:  # the server alone sees GPU 1; the trainer ranks see both
        server_env.setenv("CUDA_VISIBLE_DEVICES", SERVER_GPU)
        server = VllmServerProcess(server_checkpoint, python=vllm_python(None), timeout_s=900, weight_transfer="nccl",
                                   extra_args=("--gpu-memory-utilization", "0.3"))
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
            assert sent is not None, f"trainer rank {rank}: {value}\nserver log:\n{server.log_tail()}"
            results[rank] = (sent, value)
        for process in ranks:
            process.join(timeout=60)
        after = _server_log_probs(server.url)
        served_version = requests.get(server.url + "/weight_info", timeout=30).json()
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
        server.stop()

    (sent_0, trainer), (sent_1, trainer_1) = results[0], results[1]
    # Every tensor of the checkpoint, each once, from TP rank 0 only (TP rank 1 only takes part in the gathers);
    # the push passed its post-sync check (a mismatch raises on the sender).
    assert sent_0 == len(load_file(os.path.join(trainer_checkpoint, "model.safetensors"))) and sent_1 == 0
    assert served_version == {"weight_version": "1"}
    assert torch.equal(trainer, trainer_1)
    assert after.shape == trainer.shape == (len(PROMPT) - 1,)
    separation = (before - trainer).abs().mean().item()
    assert separation > BEFORE_PUSH_MIN_SEPARATION * FP32_MEAN_ABS_LOG_PROB_ERROR, separation
    error = (after - trainer).abs()
    assert error.max().item() <= FP32_MAX_ABS_LOG_PROB_ERROR, error
    assert error.mean().item() <= FP32_MEAN_ABS_LOG_PROB_ERROR, error
