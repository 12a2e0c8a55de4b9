"""GPU path: NCCL ranks and the transformer-engine layer spec match `transformers` in bf16.

Run on a CUDA machine with:  python -m pytest -m gpu tests/models/test_parity_gpu.py
Uses as many ranks as GPUs allow (up to 4) for the layouts (tp, cp) that fit.
"""

from __future__ import annotations

import os

import pytest
import torch

from stacx.parallel.cp_layout import cp_padded_lengths, cu_seqlens
from tests.models.parity_cases import ARCH_CASES, LAYOUTS, PACKED_LENGTHS, packed_tokens, save_case_checkpoint

BF16_RELATIVE_TOLERANCE = 3e-2


def _gpu_rank_main(rank, world_size, port, tp, cp, checkpoints, tokens_by_arch, queue):
    import torch.distributed as dist

    from stacx.models import build_model, forward_packed, load_hf_checkpoint, transformer_engine_available
    from stacx.parallel.cp_layout import local_positions, pad_packed
    from stacx.parallel.groups import destroy_parallel_layout, initialize_parallel_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        groups = initialize_parallel_layout(tp, cp)
        padded = cp_padded_lengths(PACKED_LENGTHS, cp)
        local = local_positions(padded, groups.cp_rank, cp)
        out = {"te": transformer_engine_available()}
        for arch, path in checkpoints.items():
            model = build_model(path, groups, params_dtype=torch.bfloat16, initialize_weights=False)
            load_hf_checkpoint(model, path, groups)
            model.eval()
            with torch.no_grad():
                logits = forward_packed(model, pad_packed(tokens_by_arch[arch], PACKED_LENGTHS, padded)[local], padded, groups)
            out[arch] = (logits.cpu(), local, groups.tp_rank)
        queue.put((rank, out))
    finally:
        destroy_parallel_layout()


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.parametrize("tp, cp", LAYOUTS)
def test_gpu_logits_match_transformers_in_bf16(tmp_path, tp, cp):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from stacx.testing.distributed import find_free_port

    world_size = tp * cp
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    checkpoints, tokens, references = {}, {}, {}
    for arch in ARCH_CASES:
        config, _ = save_case_checkpoint(arch, str(tmp_path / arch))
        checkpoints[arch] = str(tmp_path / arch)
        tokens[arch] = packed_tokens(config.vocab_size)
        hf = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32).eval()
        with torch.no_grad():
            references[arch] = torch.cat([hf(s[None]).logits[0] for s in tokens[arch].split(PACKED_LENGTHS)])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_gpu_rank_main, args=(r, world_size, port, tp, cp, checkpoints, tokens, queue))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert all(r["te"] for r in results.values()), "transformer-engine was not used on GPU"
    padded = cp_padded_lengths(PACKED_LENGTHS, cp)
    starts = cu_seqlens(padded)[:-1].tolist()
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, PACKED_LENGTHS)])
    for arch, ref in references.items():
        width = results[0][arch][0].shape[1]
        full = torch.zeros(sum(padded), width * tp)
        for logits, local, tp_rank in (r[arch] for r in results.values()):
            full[local, tp_rank * width : (tp_rank + 1) * width] = logits
        error = (full[rows, : ref.shape[1]] - ref).abs().max().item()
        assert error <= BF16_RELATIVE_TOLERANCE * ref.abs().max().item(), f"{arch} tp={tp} cp={cp}: {error}"
