"""A mixture-of-experts run saved at ep=2 resumes at ep=1, its Adam state included, as if never interrupted.

Two gloo ranks (dp=2) train a tiny Qwen3-MoE model with megatron's DDP and optimizer (Stacx's `wrap_ddp` /
`build_optimizer`: the routed experts in an optimizer of their own at every ep). One run takes 3 steps at
ep=2; another takes 2 steps at ep=2, saves weights and optimizer state as torch_dist, and loads them at ep=1
(each rank then holds all 4 experts) for step 3. Step 3's loss must equal the uninterrupted run's to 1e-6
relative, and every weight after it to 1e-3 * lr: ep=1 and ep=2 sum the same gradients in another order,
and Adam divides by sqrt(v), which amplifies that rounding where a gradient is tiny (the bound of
tests/models/test_moe_training.py). Guard: step 3 from the same weights with a fresh optimizer (no moments,
Adam step 1) lands more than 0.1 * lr away, so the comparison does see the loaded state.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stacx.testing.distributed import run_distributed
from tests.models.test_moe import save_moe_checkpoint

LENGTHS_BY_RANK = [[9, 5], [7, 5]]  # sequence lengths of each rank's one micro-batch per step
NUM_STEPS = 3
OPTIM = SimpleNamespace(lr=1e-2, min_lr=0.0, lr_warmup_steps=0, lr_decay_style="constant", weight_decay=0.0,
                        adam_beta1=0.9, adam_beta2=0.98, clip_grad=0.0)


def _trainer(path, ep):
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.parallel.groups import initialize_parallel_layout
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp

    groups = initialize_parallel_layout(1, 1, expert_model_parallel_size=ep)
    model = build_model(path, groups, initialize_weights=False)
    load_hf_checkpoint(model, path, groups)
    ddp = wrap_ddp(model)
    optimizer, _ = build_optimizer(ddp, OPTIM, total_steps=NUM_STEPS)
    return groups, model, ddp, optimizer


def _step(groups, ddp, optimizer, tokens_by_rank) -> float:
    """One token-mean NLL step on this rank's micro-batch; returns the step's loss (global mean)."""
    from stacx.models import forward_packed
    from stacx.parallel.reduction import Reducer, StepCounts

    lengths = LENGTHS_BY_RANK[groups.dp_rank]
    counts = StepCounts(num_tokens=sum(n - 1 for rank in LENGTHS_BY_RANK for n in rank), num_sequences=4,
                        num_routed_tokens=sum(map(sum, LENGTHS_BY_RANK)))
    reducer = Reducer.for_step(mode="token-mean", counts=counts, groups=groups)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()  # as RoleRuntime.train_step: else the last step's grads (views of the buffer) add in again
    tokens = tokens_by_rank[groups.dp_rank]
    log_probs = forward_packed(ddp, tokens, lengths, groups).log_softmax(-1)  # [T, V_pad]
    losses = [-lp[:-1].gather(1, seq[1:, None])[:, 0] for lp, seq in zip(log_probs.split(lengths), tokens.split(lengths))]
    loss = reducer(losses, [torch.ones_like(x) for x in losses])
    loss.backward()
    ddp.finish_grad_sync()
    optimizer.step()
    return reducer.loss_value(loss)


def _hf_weights(model, groups):
    from stacx.models import iter_hf_weight_buckets

    return {name: tensor for bucket in iter_hf_weight_buckets(model, groups, 1 << 30) for name, tensor in bucket}


def resume_across_expert_layouts(_groups, path, tokens_by_step, folder):
    from stacx.checkpointing.torch_dist import load_torch_dist, save_torch_dist

    groups, model, ddp, optimizer = _trainer(path, 2)
    straight = [_step(groups, ddp, optimizer, tokens) for tokens in tokens_by_step]
    results = {"straight": (straight, _hf_weights(model, groups))}

    groups, model, ddp, optimizer = _trainer(path, 2)
    for tokens in tokens_by_step[:2]:
        _step(groups, ddp, optimizer, tokens)
    save_torch_dist(folder, model, optimizer, groups=groups)

    groups, model, ddp, optimizer = _trainer(path, 1)
    loaded = load_torch_dist(folder, model, optimizer)
    links = len(optimizer.chained_optimizers)
    loss = _step(groups, ddp, optimizer, tokens_by_step[2])
    results["resumed"] = (loaded, links, loss, _hf_weights(model, groups))

    groups, model, ddp, optimizer = _trainer(path, 1)
    load_torch_dist(folder, model)  # the weights only: Adam starts again
    _step(groups, ddp, optimizer, tokens_by_step[2])
    results["fresh_optimizer"] = _hf_weights(model, groups)
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_saved_at_ep2_resumes_at_ep1_with_its_optimizer_state(tmp_path):
    config, _ = save_moe_checkpoint("qwen3_moe", str(tmp_path / "hf"))
    generator = torch.Generator().manual_seed(5)
    tokens_by_step = [[torch.randint(0, config.vocab_size, (sum(lengths),), generator=generator)
                       for lengths in LENGTHS_BY_RANK] for _ in range(NUM_STEPS)]
    results = run_distributed(resume_across_expert_layouts, 2, timeout_s=600,
                              args=(str(tmp_path / "hf"), tokens_by_step, str(tmp_path / "ep2")))
    for rank_results in results:
        straight_losses, straight = rank_results["straight"]
        loaded, links, loss, resumed = rank_results["resumed"]
        assert loaded and links == 2  # dense and expert optimizers at ep=1 too, the state read into both
        assert loss == pytest.approx(straight_losses[2], rel=1e-6)
        assert set(resumed) == set(straight)
        for name, tensor in resumed.items():
            error = (tensor - straight[name]).abs().max().item()
            assert error <= 1e-3 * OPTIM.lr, f"{name}: |diff| {error:.2e} > 1e-3 * lr"
        fresh = rank_results["fresh_optimizer"]
        experts = [name for name in straight if ".mlp.experts." in name]
        assert max((fresh[n] - straight[n]).abs().max().item() for n in experts) > 0.1 * OPTIM.lr
    assert len(set(results[0]["straight"][0])) == NUM_STEPS  # the steps changed the loss
