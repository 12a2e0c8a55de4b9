"""Each CPU patch of stacx.parallel.megatron_cpu_compat, and that none applies with CUDA present."""

import subprocess
import sys

import pytest
import torch

from stacx.testing.distributed import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patches are inactive with CUDA")


def _tiny_gpt(groups, vocab_size=64):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from stacx.models.packed_attention import PackedCoreAttention

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        use_cpu_initialization=True, tensor_model_parallel_size=groups.tp_size,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=64, position_embedding_type="rope")
    return config, model


def train_one_step_with_megatron_ddp_and_optimizer(groups):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    # Patch 1: TP all-gather allocates its output on torch.cuda.current_device().
    assert torch.cuda.current_device() == torch.device("cpu")
    shard = torch.full((2, 3), float(groups.tp_rank))
    gathered = gather_from_tensor_model_parallel_region(shard)

    torch.manual_seed(0)
    config, model = _tiny_gpt(groups)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    # Patches 2 and 3: the optimizer builds, computes the grad norm and clips on CPU.
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1e-3), [ddp])
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    logits = ddp(tokens, torch.arange(16)[None], None)
    logits.float().pow(2).mean().backward()
    ddp.finish_grad_sync()
    updated, grad_norm, _ = optimizer.step()
    grads_after_clip = sum(p.main_grad.double().pow(2).sum() for p in model.parameters()).item()
    changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return gathered, updated, grad_norm, changed, grads_after_clip


@pytest.mark.slow
def test_tp2_model_trains_one_step_with_megatron_optimizer_on_cpu():
    results = run_distributed(train_one_step_with_megatron_ddp_and_optimizer, 2, tensor_model_parallel_size=2)
    for gathered, updated, grad_norm, changed, grads_after_clip in results:
        assert torch.equal(gathered, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], dim=-1))
        assert updated and changed
        assert grad_norm > 1e-3  # so clipping (to 1e-3) really scaled the gradients
        # this rank's gradients are part of the clipped global set: their norm is at most the clip
        assert grads_after_clip <= (1e-3) ** 2 * (1 + 1e-4)
    assert results[0][2] == pytest.approx(results[1][2])  # the TP-reduced norm is global


def test_cpu_clipping_scales_gradients_to_max_norm():
    from stacx.parallel.megatron_cpu_compat import clip_grad_by_total_norm_cpu

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    total = torch.sqrt(sum((p.grad**2).sum() for p in params)).item()
    clip_grad_by_total_norm_cpu(params, max_norm=1.0, total_norm=total)
    clipped = torch.sqrt(sum((p.grad**2).sum() for p in params)).item()
    assert clipped == pytest.approx(1.0, rel=1e-5)


def cp_rope_rows(groups):
    from megatron.core.models.common.embeddings import rope_utils

    table = torch.arange(8.0).view(8, 1, 1, 1)  # 8 positions, cp=2 -> 4 chunks of 2
    return rope_utils.get_pos_emb_on_this_cp_rank(table, 0, groups.cp).flatten().tolist()


def test_cp_rope_slicing_picks_load_balanced_chunks():
    results = run_distributed(cp_rope_rows, 2, context_parallel_size=2)
    # rank 0 holds chunks 0 and 3, rank 1 holds chunks 1 and 2.
    assert results == [[0.0, 1.0, 6.0, 7.0], [2.0, 3.0, 4.0, 5.0]]


def write_a_torch_dist_folder(_groups, folder):
    """On a CPU rank (its world of one made by the harness, the patches applied as every rank applies them):
    whether torch.cuda.synchronize is the patch's no-op, and megatron's torch_dist writer wrote `folder`."""
    from megatron.core.dist_checkpointing import save
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from stacx.checkpointing.torch_dist import _use_in_process_results_queue, is_torch_dist_folder
    from stacx.parallel import megatron_cpu_compat as c

    active = c.apply_if_needed() is True and c.is_applied()
    patched = torch.cuda.synchronize.__module__ != "torch.cuda" and torch.cuda.synchronize() is None
    _use_in_process_results_queue()
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 2), replica_id=0)}, folder)
    return active, patched, is_torch_dist_folder(folder)


@pytest.mark.slow
def test_cuda_synchronize_is_a_no_op_so_megatrons_checkpoint_writer_runs(tmp_path):
    """Without the patch, torch_dist's writer calls torch.cuda.synchronize and a CPU-only torch raises."""
    folder = tmp_path / "dist"
    folder.mkdir()
    assert run_distributed(write_a_torch_dist_folder, 1, args=(str(folder),)) == [(True, True, True)]


@pytest.mark.slow
def test_patches_are_not_applied_when_cuda_is_present():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "original = torch.cuda.current_device\n"
        "from stacx.parallel import megatron_cpu_compat as c\n"
        "assert c.apply_if_needed() is False\n"
        "assert torch.cuda.current_device is original\n"
        "assert torch.cuda.synchronize.__module__ == 'torch.cuda'\n"
        "assert not c.is_applied()\n"
        "from megatron.core.optimizer import optimizer\n"
        "assert optimizer.torch is torch\n"
        "print('untouched')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "untouched" in out.stdout


def router_gating_on_cpu(_groups):
    from megatron.core.transformer.moe import moe_utils

    # Patch 7: without transformer-engine the module never defines the name the router reads.
    assert moe_utils.te_general_gemm is None
    inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    weight = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    logits = moe_utils.router_gating_linear(inputs, weight, None, torch.float32)
    logits.sum().backward()
    return logits.detach(), inputs.grad, weight.grad, inputs.detach(), weight.detach()


def test_moe_router_gating_runs_on_cpu_as_a_plain_linear():
    logits, input_grad, weight_grad, inputs, weight = run_distributed(router_gating_on_cpu, 1)[0]
    assert torch.allclose(logits, inputs @ weight.T)
    assert torch.allclose(input_grad, weight.sum(0).expand_as(inputs))
    assert torch.allclose(weight_grad, inputs.sum(0).expand_as(weight))


def test_rng_tracker_fork_of_a_state_never_added_restores_the_cpu_generator():
    """Patch 8: on CPU no tracker state is ever added; fork() still runs its body and puts the CPU
    generator back afterwards, as the original puts back the CUDA one."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from stacx.parallel import megatron_cpu_compat

    megatron_cpu_compat.apply_if_needed()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    assert torch.equal(inside, expected)  # the body ran and drew from the CPU generator
    assert torch.equal(torch.rand(3), expected)  # ... which fork() restored on exit


def exchange_both_directions_then_send_ahead(groups):
    """Patch 9 on the two ranks of a pipeline (each is the other's previous and next stage)."""
    from megatron.core.pipeline_parallel import p2p_communication

    from stacx.parallel.megatron_cpu_compat import finish_pipeline_sends

    rank, other = groups.pp_rank, 1 - groups.pp_rank
    peers = dict(group=groups.pp, prev_pipeline_rank=other, next_pipeline_rank=other)
    # One exchange carrying an activation forward and a gradient backward, as the interleaved schedule's
    # steady state does: each must land in its own buffer.
    activation, gradient = torch.empty(3), torch.empty(5)
    for request in p2p_communication._batched_p2p_ops(
            tensor_send_next=torch.full((3,), 10.0 + rank), tensor_send_prev=torch.full((5,), 20.0 + rank),
            tensor_recv_prev=activation, tensor_recv_next=gradient, **peers):
        request.wait()
    # Rank 0 sends ahead: its exchange returns before rank 1 posts the receive (here, after a barrier that
    # rank 0 reaches only once the exchange has returned); the send completes after the schedule.
    late = torch.empty(2)
    if rank == 0:
        assert p2p_communication._batched_p2p_ops(tensor_send_next=torch.tensor([7.0, 8.0]), tensor_send_prev=None,
                                                  tensor_recv_prev=None, tensor_recv_next=None, **peers) == []
    torch.distributed.barrier(group=groups.pp)
    if rank == 1:
        for request in p2p_communication._batched_p2p_ops(tensor_send_next=None, tensor_send_prev=None,
                                                          tensor_recv_prev=late, tensor_recv_next=None, **peers):
            request.wait()
    finish_pipeline_sends()
    return activation, gradient, late


def test_pipeline_exchanges_keep_directions_apart_and_let_a_send_run_ahead_over_gloo():
    (activation0, gradient0, _), (activation1, gradient1, late) = run_distributed(
        exchange_both_directions_then_send_ahead, 2, pipeline_model_parallel_size=2, timeout_s=60)
    # each rank gets the other's activation (10 + rank) and gradient (20 + rank), not one in the other's place
    assert torch.equal(activation0, torch.full((3,), 11.0)) and torch.equal(gradient0, torch.full((5,), 21.0))
    assert torch.equal(activation1, torch.full((3,), 10.0)) and torch.equal(gradient1, torch.full((5,), 20.0))
    assert torch.equal(late, torch.tensor([7.0, 8.0]))


def test_the_docs_count_the_patches_that_apply_if_needed_applies():
    """docs/architecture.md and the module's numbered list name as many patches as `apply_if_needed` applies."""
    import inspect
    import re
    from pathlib import Path

    from stacx.parallel import megatron_cpu_compat

    applied = re.findall(r"^    _patch_\w+\(\)$", inspect.getsource(megatron_cpu_compat.apply_if_needed), re.M)
    listed = re.findall(r"^(\d+)\. ", megatron_cpu_compat.__doc__, re.M)
    assert [int(n) for n in listed] == list(range(1, len(applied) + 1))
    words = {7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven"}
    architecture = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    assert f"applies {words[len(applied)]} small, tested" in architecture
