"""An expert-parallel training step equals the plain one, router losses included.

Two gloo ranks (dp=2) each run two micro-batches of different lengths (and the ranks' token counts differ,
so the all-gather dispatcher pads) through a Qwen3-MoE model with
--moe-aux-loss-coeff and --moe-z-loss-coeff set, with megatron's DDP and optimizer (Stacx's
`wrap_ddp` / `build_optimizer`), the main loss reduced by the `Reducer` and the router losses scaled
by `Reducer.router_loss_scale`. The step at ep=2 (each rank holds 2 of the 4 experts; the all-gather
dispatcher sends tokens across ranks) must give the same updated weights, as Hugging Face tensors,
as the step at ep=1 to fp32 rounding: the same loss to 1e-6 relative, the same reduced gradients to
1e-5 of each tensor's largest entry, and weights within 1e-3 * lr (the first Adam step moves a weight
by about lr * g / (|g| + eps), which amplifies rounding where g is tiny; a dropped or doubled expert
gradient moves it by ~lr). Guards: the step moves the
weights, and without router losses the router weights move differently (so the losses are in the
gradient). The expert-load metrics of both layouts are equal and count every routed token slot.
Routing replay rides on the same ranks: the ep=2 `RoleRuntime` step with the micro-batches carrying
the model's own routes (--use-routing-replay) gives pi_old bitwise and the gradients to 1e-6 of the plain
step, and other experts change pi_old (the guard that the runtime replays).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stacx.testing.distributed import run_distributed
from tests.models.test_moe import save_moe_checkpoint

# [rank][micro-batch] sequence lengths: the two ranks' micro-batches differ in token count, which megatron's
# all-gather dispatcher cannot gather; Stacx's (stacx.parallel.moe_dispatch) pads them to the longest.
MICRO_BATCH_LENGTHS = [[[9, 5], [12]], [[7, 5], [10]]]
TOP_K = 2
COEFFS = dict(aux_loss_coeff=0.05, z_loss_coeff=0.01)
OPTIM = SimpleNamespace(lr=1e-2, min_lr=0.0, lr_warmup_steps=0, lr_decay_style="constant", weight_decay=0.0,
                        adam_beta1=0.9, adam_beta2=0.98, clip_grad=0.0)


def _one_step(path, tokens_by_rank, ep, router_losses, tp=1):
    from stacx.models import build_model, forward_packed, iter_hf_weight_buckets, load_hf_checkpoint
    from stacx.models.builder import RouterLosses
    from stacx.models.moe import ExpertLoadRecorder, expert_load_metrics, set_router_loss_scale
    from stacx.parallel.groups import initialize_parallel_layout
    from stacx.parallel.reduction import Reducer, StepCounts
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from stacx.parallel.cp_fields import next_token_targets
    from stacx.parallel.vocab_parallel import vocab_parallel_log_probs

    groups = initialize_parallel_layout(tp, 1, expert_model_parallel_size=ep,
                                        expert_tensor_parallel_size=1 if tp > 1 else None)
    torch.manual_seed(0)
    model = build_model(path, groups, initialize_weights=False, router_losses=RouterLosses(**router_losses),
                        sequence_parallel=tp > 1)
    load_hf_checkpoint(model, path, groups)
    ddp = wrap_ddp(model)
    optimizer, _ = build_optimizer(ddp, OPTIM, total_steps=1)
    world = len(tokens_by_rank)
    routed = sum(sum(lengths) for rank in MICRO_BATCH_LENGTHS for lengths in rank)
    targets = sum(sum(n - 1 for n in lengths) for rank in MICRO_BATCH_LENGTHS for lengths in rank)
    num_sequences = sum(len(lengths) for rank in MICRO_BATCH_LENGTHS for lengths in rank)
    counts = StepCounts(num_tokens=targets, num_sequences=num_sequences, num_routed_tokens=routed)
    reducer = Reducer.for_step(mode="token-mean", counts=counts, groups=groups)
    ddp.zero_grad_buffer()
    step_loss = 0.0
    # Each DP rank takes the micro-batches of the data ranks r = dp_rank (mod dp): at tp=2 one rank takes all.
    micro_batches = [(lengths, tokens) for r in range(groups.dp_rank, world, groups.dp_size)
                     for lengths, tokens in zip(MICRO_BATCH_LENGTHS[r], tokens_by_rank[r])]
    with ExpertLoadRecorder(model) as load:
        for lengths, tokens in micro_batches:
            set_router_loss_scale(reducer.router_loss_scale(sum(lengths)))
            logits = forward_packed(ddp, tokens, lengths, groups)  # [T, V_pad/tp]
            targets = next_token_targets(tokens, lengths)
            log_probs = vocab_parallel_log_probs(logits, targets, tp_group=groups.tp)  # [T]
            losses, masks = [], []
            for seq_log_probs in log_probs.split(lengths):
                losses.append(-seq_log_probs[:-1])
                masks.append(torch.ones_like(losses[-1]))
            loss = reducer(losses, masks)
            loss.backward()
            step_loss += reducer.loss_value(loss)
    finalize_model_grads([ddp])  # DP x CP sync; under sequence parallelism also the norms' and routers' TP sum
    grads = _reduced_grads_by_hf_name(model, groups)
    optimizer.step()
    weights = {n: t for bucket in iter_hf_weight_buckets(model, groups, 1 << 30) for n, t in bucket}
    # No capacity factor: every token's top-k slots are routed, none dropped (no `moe/dropped_tokens` key).
    metrics = expert_load_metrics(load.tokens_per_expert(groups), load.layers, load.dropped_token_slots(groups))
    assert "moe/dropped_tokens" not in metrics and float(load.dropped_token_slots(groups).sum()) == 0.0
    return weights, metrics, step_loss, grads


@torch.no_grad()
def _reduced_grads_by_hf_name(model, groups):
    """DDP's reduced gradients as full Hugging Face tensors (streamed as the weights would be)."""
    from stacx.models import iter_hf_weight_buckets

    params = list(model.parameters())
    weights = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.to(p.dtype)
    try:
        return {n: t.clone() for bucket in iter_hf_weight_buckets(model, groups, 1 << 30) for n, t in bucket}
    finally:
        for p, weight in zip(params, weights):
            p.data = weight


SYNC_BUCKET_BYTES = 20_000  # several buckets, each with experts of both EP ranks


class RecordingEngine:
    """An engine client (registered as kind "recording" in the spawned ranks) that keeps every bucket it is sent."""

    received: list = []

    def __init__(self, url, api_key=None):
        self.url = url

    def update_weights(self, buckets, *, version):
        RecordingEngine.received += [(version, [(name, tensor.clone()) for name, tensor in bucket])
                                     for bucket in buckets]


def _pushed_weights(runtime):
    """(tensors sent, buckets received) of `RoleRuntime.push_weights_to_engine`: the path from the trainer's
    ranks to a rollout engine after each step, on Ray and under torchrun."""
    from stacx.rollout.engines.registry import register_engine

    register_engine("recording")(RecordingEngine)
    sent = runtime.push_weights_to_engine("recording", "http://engine", version=1, bucket_bytes=SYNC_BUCKET_BYTES)
    return sent, RecordingEngine.received


def _own_routes(runtime, micro_batches):
    """Each sample's routes [L_i - 1, layers, k] as the model routes its micro-batch (what replay gets)."""
    from stacx.models import forward_packed
    from stacx.models.routing_replay import RoutesRecorder

    for micro_batch in micro_batches:
        packed = runtime.pack(micro_batch)
        with torch.no_grad(), RoutesRecorder(runtime.model) as recorder:
            forward_packed(runtime.model, *packed.model_inputs(), runtime.groups)
        micro_batch.routed_experts = [r[:-1] for r in recorder.routes().split(packed.layout.lengths)]


def _runtime_step(path, ep, replay_own_routes=False, pp=1, tp=1):
    """One GRPO `RoleRuntime.train_step` (two micro-batches) at ep x pp (pp > 1: tests/parallel/test_pipeline.py):
    the run settings' path into the model.
    At ep=2 (without replay) the weights are first pushed to an engine as after a step: (metrics, grads, pushed).
    replay_own_routes: the micro-batches carry the model's own routes (--use-routing-replay), which the
    pi_old and loss forwards replay: (metrics, grads, pi_old with and without the routes).
    tp=2: with --sequence-parallel (and etp=1)."""
    from stacx.objectives.algorithm_config import AlgorithmConfig
    from stacx.parallel.groups import initialize_parallel_layout
    from stacx.parallel.reduction import compute_step_counts
    from stacx.trainer.config.recipe import ModelRole
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.runtime.role_runtime import RoleRuntime
    from stacx.specializations.actor import ActorSpecialization
    from tests.trainer.runtime.test_lm_head_mode import step_batch

    groups = initialize_parallel_layout(tp, 1, expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
                                        expert_tensor_parallel_size=1 if tp > 1 else None)
    run_config = RunConfig.from_dict({"hf_checkpoint": path, "clip_grad": 0.0, "expert_model_parallel_size": ep,
                                      "pipeline_model_parallel_size": pp,
                                      "tensor_model_parallel_size": tp, "sequence_parallel": tp > 1,
                                      "moe_aux_loss_coeff": COEFFS["aux_loss_coeff"],
                                      "moe_z_loss_coeff": COEFFS["z_loss_coeff"]})
    algorithm = AlgorithmConfig.from_values({"advantage_estimator": "grpo", "rollout_temperature": 0.7})
    runtime = RoleRuntime(ModelRole(name="policy", specialization_cls=ActorSpecialization), algorithm, groups,
                          model=run_config.model, optim=run_config.optim, train=run_config.train,
                          rank=torch.distributed.get_rank())
    pushed = _pushed_weights(runtime) if ep == 2 and tp == 1 and not replay_own_routes else None
    batch = step_batch()
    counts = compute_step_counts(batch.loss_masks, groups.dp)
    # Micro-batches of 16 and 22 tokens: no sequence-parallel padding at tp=2, which would change megatron's
    # z-loss (a mean per TP shard, averaged over TP: equal only for equal shards of real tokens).
    micro_batches = [batch.select([0, 2]), batch.select([1, 3])]
    if replay_own_routes:
        plain_old = runtime.compute_fields(micro_batches, ["log_probs"])
        _own_routes(runtime, micro_batches)
        replayed_old = runtime.compute_fields(micro_batches, ["log_probs"])
        # the guard: other experts (each id + 1 mod 4) change pi_old, so the runtime does replay
        own = [mb.routed_experts for mb in micro_batches]
        for micro_batch in micro_batches:
            micro_batch.routed_experts = [((r + 1) % 4).sort(-1).values for r in micro_batch.routed_experts]
        foreign_old = runtime.compute_fields(micro_batches, ["log_probs"])
        for micro_batch, routes in zip(micro_batches, own):
            micro_batch.routed_experts = routes
    metrics = runtime.train_step(micro_batches, counts)
    grads = _reduced_grads_by_hf_name(runtime.model, groups)
    return (metrics, grads, plain_old, replayed_old, foreign_old) if replay_own_routes else (metrics, grads, pushed)


def step_at_each_expert_layout(_groups, path, tokens_by_rank):
    return {
        "ep1": _one_step(path, tokens_by_rank, 1, COEFFS),
        "ep2": _one_step(path, tokens_by_rank, 2, COEFFS),
        "ep2_no_router_losses": _one_step(path, tokens_by_rank, 2, {}),
        "tp2_ep2": _one_step(path, tokens_by_rank, 2, COEFFS, tp=2),  # sequence parallel, etp=1
        "runtime_ep1": _runtime_step(path, 1),
        "runtime_ep2": _runtime_step(path, 2),
        "runtime_tp2_ep2": _runtime_step(path, 2, tp=2),  # --sequence-parallel through the run settings
        "runtime_ep2_replay": _runtime_step(path, 2, replay_own_routes=True),
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_step_equals_plain_step_with_router_losses(tmp_path):
    from safetensors.torch import load_file

    from stacx.checkpointing.convert import single_process_world
    from stacx.models import build_model, iter_hf_weight_buckets, load_hf_checkpoint

    config, _ = save_moe_checkpoint("qwen3_moe", str(tmp_path))
    generator = torch.Generator().manual_seed(3)
    tokens_by_rank = [[torch.randint(0, config.vocab_size, (sum(lengths),), generator=generator)
                       for lengths in rank_lengths] for rank_lengths in MICRO_BATCH_LENGTHS]
    results = run_distributed(step_at_each_expert_layout, 2, args=(str(tmp_path), tokens_by_rank), timeout_s=600)

    initial = load_file(str(tmp_path / "model.safetensors"))
    plain, plain_load, _, plain_grads = results[0]["ep1"]
    for rank, rank_results in enumerate(results):
        for layout in ("ep1", "ep2", "tp2_ep2"):
            weights, load, loss, grads = rank_results[layout]
            # dp=2 layouts: each rank's own micro-batches; tp=2 (dp=1): all of them on every rank.
            expected_loss = sum(r["ep1"][2] for r in results) if layout == "tp2_ep2" else results[rank]["ep1"][2]
            assert loss == pytest.approx(expected_loss, rel=1e-6)
            assert set(weights) == set(initial) == set(grads)
            for name, grad in grads.items():
                error = (grad - plain_grads[name]).abs().max().item()
                assert error <= 1e-5 * plain_grads[name].abs().max().item(), f"{layout} grad {name}: |diff| {error:.2e}"
            for name, tensor in weights.items():
                # Where |g| is below 1e-4 of the tensor's largest gradient, the first Adam step's size is set by
                # rounding (lr * g / (|g| + eps)); the gradients there are compared above.
                settled = plain_grads[name].abs() > 1e-4 * plain_grads[name].abs().max()
                error = (tensor - plain[name])[settled].abs().max().item()
                assert error <= 1e-3 * OPTIM.lr, f"{layout} {name}: |diff| {error:.2e} > 1e-3 * lr"
            assert load == pytest.approx(plain_load)
    moved = [n for n in initial if not torch.equal(plain[n], initial[n])]
    assert len(moved) > len(initial) // 2, "the step left most weights unchanged"
    without = results[0]["ep2_no_router_losses"][0]
    router = "model.layers.0.mlp.gate.weight"
    assert (without[router] - plain[router]).abs().max() > 1e-6, "router losses did not reach the router's gradient"
    # The run settings reach the model through RoleRuntime: its ep=2 step equals its ep=1 step.
    metrics_ep1, grads_ep1, _ = results[0]["runtime_ep1"]
    for rank_results in results:
        for layout in ("runtime_ep2", "runtime_tp2_ep2"):
            metrics, grads, _ = rank_results[layout]
            assert metrics["loss"] == pytest.approx(metrics_ep1["loss"], rel=1e-6)
            assert metrics["moe/max_imbalance"] == pytest.approx(metrics_ep1["moe/max_imbalance"])
            for name, grad in grads.items():
                error = (grad - grads_ep1[name]).abs().max().item()
                assert error <= 1e-5 * grads_ep1[name].abs().max().item(), f"{layout} grad {name}: |diff| {error:.2e}"
    # Weight sync at ep=2: rank 0 sends, rank 1 (holding experts 2 and 3) only takes part in the gathers. The
    # engine gets the one-rank stream of the checkpoint: every tensor once, under its Hugging Face name, bitwise,
    # in buckets of at most SYNC_BUCKET_BYTES (or one tensor). (Within a layer the experts come grouped by projection across the
    # EP ranks, gate_proj of experts 0 and 2 before up_proj of expert 0; the engine loads by name.)
    (sent, received), (sent_1, received_1) = (rank_results["runtime_ep2"][2] for rank_results in results)
    with single_process_world() as world:
        model = build_model(str(tmp_path), world, initialize_weights=False)
        load_hf_checkpoint(model, str(tmp_path), world)
        expected = [pair for bucket in iter_hf_weight_buckets(model, world, SYNC_BUCKET_BYTES) for pair in bucket]
    assert (sent, sent_1, received_1) == (len(initial), 0, [])
    assert len(received) > 2 and {version for version, _ in received} == {1}
    assert all(len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= SYNC_BUCKET_BYTES
               for _, bucket in received)  # a tensor over the budget travels alone
    streamed = [pair for _, bucket in received for pair in bucket]
    assert sorted(name for name, _ in streamed) == sorted(name for name, _ in expected) == sorted(initial)
    assert all(torch.equal(tensor, dict(expected)[name]) for name, tensor in streamed)
    # Routing replay at ep=2 through RoleRuntime: replaying the model's own routes leaves pi_old and the
    # step's gradients as they are (to 1e-6 of each tensor's largest entry; bitwise in practice).
    for rank_results in results:
        metrics, grads, _ = rank_results["runtime_ep2"]
        replay_metrics, replay_grads, plain_old, replayed_old, foreign_old = rank_results["runtime_ep2_replay"]
        assert replay_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-6)
        for name, grad in grads.items():
            assert (replay_grads[name] - grad).abs().max() <= 1e-6 * grad.abs().max(), f"replay grad {name}"
        if plain_old is not None:  # the rank that holds the results
            for plain_mb, replayed_mb, foreign_mb in zip(plain_old, replayed_old, foreign_old):
                for a, b, c in zip(plain_mb["log_probs"], replayed_mb["log_probs"], foreign_mb["log_probs"]):
                    assert torch.equal(a, b) and (a - c).abs().max() > 1e-3
    # Every token slot is counted: top-k slots per routed token, over both ranks and micro-batches.
    routed = sum(sum(lengths) for rank in MICRO_BATCH_LENGTHS for lengths in rank)
    for layer in range(config.num_hidden_layers):
        tokens = sum(plain_load[f"moe/layer{layer}/expert{e}_tokens"] for e in range(config.num_experts))
        assert tokens == TOP_K * routed
        assert 1.0 <= plain_load[f"moe/layer{layer}/imbalance"] <= config.num_experts


def test_router_z_loss_gradient_does_not_depend_on_the_micro_batch_split(tmp_path):
    """The z-loss is a mean over each micro-batch's tokens; weighted by `Reducer.router_loss_scale` (the
    micro-batch's share of the step's routed tokens) the step's gradient is that of the mean over all
    tokens, however the sequences are split into micro-batches. The main loss is zero here, so the
    router loss is the whole gradient."""
    from stacx.checkpointing.convert import single_process_world
    from stacx.models import build_model, forward_packed, load_hf_checkpoint
    from stacx.models.builder import RouterLosses
    from stacx.models.moe import set_router_loss_scale
    from stacx.parallel.reduction import Reducer, StepCounts

    config, _ = save_moe_checkpoint("qwen3_moe", str(tmp_path))
    lengths = [9, 5, 12]
    tokens = torch.randint(0, config.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(4))
    grads = {}
    with single_process_world() as groups:
        model = build_model(str(tmp_path), groups, initialize_weights=False,
                            router_losses=RouterLosses(z_loss_coeff=0.1))
        load_hf_checkpoint(model, str(tmp_path), groups)
        counts = StepCounts(num_tokens=1, num_sequences=1, num_routed_tokens=sum(lengths))
        reducer = Reducer.for_step(mode="token-mean", counts=counts, groups=groups)
        for split in ([lengths], [lengths[:2], lengths[2:]], [[n] for n in lengths]):
            model.zero_grad()
            start = 0
            for micro_lengths in split:
                size = sum(micro_lengths)
                set_router_loss_scale(reducer.router_loss_scale(size))
                logits = forward_packed(model, tokens[start:start + size], micro_lengths, groups)
                (logits[:, :config.vocab_size] * 0.0).sum().backward()
                start += size
            grads[len(split)] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        set_router_loss_scale(1.0)
    router = "decoder.layers.0.mlp.router.weight"
    assert grads[1][router].abs().max() > 0, "the z-loss gave the router no gradient"
    for num_micro_batches in (2, 3):
        for name, grad in grads[1].items():
            error = (grads[num_micro_batches][name] - grad).abs().max().item()
            assert error <= 1e-5 * grad.abs().max().item() + 1e-12, f"{num_micro_batches} micro-batches, {name}"
