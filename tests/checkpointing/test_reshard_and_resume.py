"""Training checkpoints in torch_dist: saved at tp=2 x dp=2 (4 gloo ranks), loaded at tp=1 and at
tp=2 x cp=2 with the same model outputs to fp32 rounding and the optimizer state resharded; resumed
at the same layout, 4 steps equal 2 + save + 2 bitwise."""

from __future__ import annotations

import pytest
import torch

from stacx.models.testing import save_tiny_hf_checkpoint
from stacx.testing.distributed import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

LENGTHS = [8, 12]  # two packed sequences; multiples of 2 * cp for cp = 2, so no position is padding
VOCAB = 101  # the tiny config's odd vocab: padded to 102 at tp=2, not at tp=1
ROLE = "policy"


class _Optim:
    lr, min_lr, weight_decay, adam_beta1, adam_beta2, clip_grad = 1e-2, 0.0, 0.01, 0.9, 0.99, 1.0
    lr_warmup_steps, lr_decay_style = 1, "linear"


def _build(groups, hf_dir):
    from stacx.checkpointing.folders import load_model_weights
    from stacx.models import build_model
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp

    model = build_model(hf_dir, groups, initialize_weights=False)
    load_model_weights(model, hf_dir, groups, flag="--hf-checkpoint")
    ddp = wrap_ddp(model)
    optimizer, scheduler = build_optimizer(ddp, _Optim, total_steps=4)
    return model, ddp, optimizer, scheduler


def _local_logits(model, groups):
    """(global positions, tp rank, TP-local logits [T_local, V_pad/tp]) of this rank's slice of a fixed row."""
    from stacx.models.forward import forward_packed
    from stacx.parallel.cp_layout import cp_padded_lengths, local_positions, pad_packed

    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(7))
    padded = cp_padded_lengths(LENGTHS, groups.cp_size)
    positions = local_positions(padded, groups.cp_rank, groups.cp_size)
    with torch.no_grad():
        logits = forward_packed(model, pad_packed(tokens, LENGTHS, padded)[positions], padded, groups)
    return positions, groups.tp_rank, logits


def _loss(model, groups) -> torch.Tensor:
    from stacx.models.forward import forward_packed
    from stacx.parallel.cp_layout import cp_padded_lengths, local_positions, pad_packed

    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(3))
    padded = cp_padded_lengths(LENGTHS, groups.cp_size)
    positions = local_positions(padded, groups.cp_rank, groups.cp_size)
    logits = forward_packed(model, pad_packed(tokens, LENGTHS, padded)[positions], padded, groups)
    real = logits > torch.finfo(torch.float32).min / 2  # vocab padding columns hold float32 min
    return (logits.where(real, 0.0) ** 2).mean()


def _train(model, ddp, optimizer, scheduler, groups, num_steps: int) -> None:
    for _ in range(num_steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        _loss(ddp, groups).backward()
        ddp.finish_grad_sync()
        optimizer.step()
        scheduler.step(1)


def _torch_optimizer(optimizer):
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    return inner.optimizer


def _exp_avg(model, optimizer, name: str) -> torch.Tensor:
    from stacx.models import unwrap_model

    param = dict(unwrap_model(model).named_parameters())[name]
    return _torch_optimizer(optimizer).state[param]["exp_avg"].clone()


def _save(groups, model, optimizer, scheduler, root: str, step: int) -> None:
    import torch.distributed as dist

    from stacx.trainer.checkpoint import RoleLayout, begin_checkpoint, capture_rng_state, commit_checkpoint, write_rank_state

    staging = [begin_checkpoint(root, step) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(staging, src=0)
    coords = _coords(groups)
    info = write_rank_state(staging[0], ROLE, dist.get_rank(),
                            {"scheduler": scheduler.state_dict(), "rng": capture_rng_state(), "num_steps": step},
                            coords, model=model, optimizer=optimizer, groups=groups)
    infos = [None] * dist.get_world_size()
    dist.all_gather_object(infos, info)
    if dist.get_rank() == 0:
        layout = RoleLayout(tensor_model_parallel_size=groups.tp_size, context_parallel_size=groups.cp_size,
                            data_parallel_size=groups.dp_size)
        commit_checkpoint(staging[0], step=step, recipe="grpo", role_layouts={ROLE: layout}, rank_files=infos,
                          driver_state={"step": step}, resolved_run_config={"train": {"num_steps": 4}})
    dist.barrier()


def _coords(groups):
    from stacx.trainer.checkpoint import RankCoords

    return RankCoords(tp_rank=groups.tp_rank, cp_rank=groups.cp_rank, dp_rank=groups.dp_rank)


def _resume(groups, hf_dir: str, root: str):
    """Fresh model and optimizer, loaded from the latest checkpoint under `root` at this rank's layout."""
    import torch.distributed as dist

    from stacx.checkpointing.torch_dist import load_torch_dist
    from stacx.trainer.checkpoint import RoleLayout, load_checkpoint

    layout = RoleLayout(tensor_model_parallel_size=groups.tp_size, context_parallel_size=groups.cp_size,
                        data_parallel_size=groups.dp_size)
    loaded = load_checkpoint(root, expected_recipe="grpo", expected_layouts={ROLE: layout})
    model, ddp, optimizer, scheduler = _build(groups, hf_dir)
    assert load_torch_dist(loaded.model_folder(ROLE), model, optimizer), "the optimizer state was not loaded"
    scheduler.load_state_dict(loaded.rank_state(ROLE, dist.get_rank(), _coords(groups))["scheduler"])
    return model, ddp, optimizer, scheduler


def save_at_tp2_dp2_and_resume(groups, hf_dir: str, root: str):
    """2 steps, save, 2 steps; then a fresh model resumed from the save, 2 steps: bitwise the same."""
    from stacx.models import unwrap_model

    model, ddp, optimizer, scheduler = _build(groups, hf_dir)
    initial = [p.detach().clone() for p in model.parameters()]
    _train(model, ddp, optimizer, scheduler, groups, 2)
    assert any(not torch.equal(a, b) for a, b in zip(initial, model.parameters())), "training changed nothing"
    _save(groups, model, optimizer, scheduler, root, 2)
    saved_logits = _local_logits(model, groups)
    saved_exp_avg = _exp_avg(model, optimizer, "output_layer.weight")
    _train(model, ddp, optimizer, scheduler, groups, 2)
    straight = {name: p.detach().clone() for name, p in unwrap_model(model).named_parameters()}

    model2, ddp2, optimizer2, scheduler2 = _resume(groups, hf_dir, root)
    assert torch.equal(_local_logits(model2, groups)[2], saved_logits[2])
    _train(model2, ddp2, optimizer2, scheduler2, groups, 2)
    resumed = {name: p.detach() for name, p in unwrap_model(model2).named_parameters()}
    different = [name for name in straight if not torch.equal(straight[name], resumed[name])]
    assert not different, f"resumed weights differ from the straight run's: {different[:3]}"
    return saved_logits, saved_exp_avg


def load_at_another_layout(groups, hf_dir: str, root: str):
    model, _, optimizer, scheduler = _resume(groups, hf_dir, root)
    return _local_logits(model, groups), _exp_avg(model, optimizer, "output_layer.weight"), scheduler.num_steps


def _full_logits(rank_results) -> torch.Tensor:
    """[T, VOCAB] from each rank's (positions, tp rank, TP-local logits); CP slices and TP shards placed."""
    width = rank_results[0][2].shape[-1]
    tp_size = max(tp_rank for _, tp_rank, _ in rank_results) + 1
    full = torch.full((sum(LENGTHS), width * tp_size), float("nan"))
    for positions, tp_rank, logits in rank_results:
        full[positions, tp_rank * width:(tp_rank + 1) * width] = logits
    assert not full[:, :VOCAB].isnan().any()
    return full[:, :VOCAB]


def test_saved_at_tp2_dp2_loads_at_tp1_and_tp2_cp2_and_resumes_bitwise(tmp_path):
    hf_dir, root = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    save_tiny_hf_checkpoint(hf_dir, "llama", seed=0)

    saved = run_distributed(save_at_tp2_dp2_and_resume, 4, tensor_model_parallel_size=2, args=(hf_dir, root), timeout_s=600)
    reference = _full_logits([logits for logits, _ in saved])
    saved_exp_avg = torch.cat([saved[0][1], saved[1][1]])[:VOCAB]  # tp ranks 0 and 1 of dp replica 0
    assert saved_exp_avg.abs().sum() > 0

    (tp1,) = run_distributed(load_at_another_layout, 1, args=(hf_dir, root), timeout_s=600)
    torch.testing.assert_close(_full_logits([tp1[0]]), reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(tp1[1], saved_exp_avg), "the optimizer state was not resharded to tp=1"
    assert tp1[2] == 2  # the LR scheduler resumed at step 2

    tp2_cp2 = run_distributed(load_at_another_layout, 4, tensor_model_parallel_size=2, context_parallel_size=2,
                              args=(hf_dir, root), timeout_s=600)
    torch.testing.assert_close(_full_logits([r[0] for r in tp2_cp2]), reference, rtol=1e-5, atol=1e-5)
