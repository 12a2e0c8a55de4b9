"""Train/rollout log-prob mismatch of a tiny Qwen3-MoE GRPO run, with and without routing replay (R3).

    .venv/bin/python bench/moe_routing_replay/run.py [--steps 4] [--lr 1e-4] [--json out.json]

Two sources of mismatch, each run twice from the same seed and weights (replay off, then on):
- "bf16 engine": the rollout engine (the CPU engine's KV-cache decoder) holds the policy in bf16 and
  the trainer computes in fp32: a rounding difference in a router logit can flip a top-k choice;
- "stale by one": the engine (fp32) serves the previous step's weights, as an async run with
  --max-staleness 1 does.
Each step: the engine samples G responses per prompt with their routed experts, the trainer (fp32
megatron model) recomputes their log-probs (replaying the engine's routes, or routing itself), takes
one group-relative policy-gradient step (importance ratio clipped at 0.2, reward = share of response
tokens in the lower half of the vocabulary) and the engine receives the new weights. Reported per
step over response tokens: mean and max |logp_train - logp_rollout|, and the share of tokens whose
experts (in any MoE layer) differ between the engine and the trainer's own routing, with the mean
mismatch on those tokens. The ratio
line is replay / no replay for the mean mismatch, measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from types import SimpleNamespace

import torch

PROMPTS = [tuple((5 * p + 3 * j) % 30 + 1 for j in range(6)) for p in range(6)]
GROUP = 4
MAX_NEW_TOKENS = 16
OPTIM = SimpleNamespace(lr=1e-4, min_lr=0.0, lr_warmup_steps=0, lr_decay_style="constant", weight_decay=0.0,
                        adam_beta1=0.9, adam_beta2=0.98, clip_grad=1.0)


def _checkpoint(folder: str) -> str:
    from stacx.models.testing import build_tiny_hf_model, tiny_hf_config

    model = build_tiny_hf_model(tiny_hf_config("qwen3_moe"), 0)
    with torch.no_grad():  # a router sharp enough that tokens use different experts
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _weights(model, groups):
    from stacx.models import iter_hf_weight_buckets

    return [pair for bucket in iter_hf_weight_buckets(model, groups, 1 << 30) for pair in bucket]


def _response_terms(model, batch, groups, replay: bool):
    """(per-token log-probs of the responses [N] with grad, the trainer's own routes [T, L, k] or None)."""
    from stacx.models import forward_packed
    from stacx.models.routing_replay import RoutesRecorder, routes_replayed

    tokens, lengths = batch.model_inputs()
    with RoutesRecorder(model) as recorder:
        if replay:
            with routes_replayed(model, batch.model_routes()):
                logits = forward_packed(model, tokens, lengths, groups)
        else:
            logits = forward_packed(model, tokens, lengths, groups)
    log_probs = torch.log_softmax(logits, -1)
    picked, offset = [], 0
    for length, response in zip(lengths, batch.response_lengths):
        start = offset + length - response
        picked.append(log_probs[start - 1: offset + length - 1].gather(1, tokens[start: offset + length, None])[:, 0])
        offset += length
    return torch.cat(picked), recorder.routes()


def _response_route_rows(batch) -> torch.Tensor:
    """Indices into the packed row of the tokens whose routes decide a response log-prob (prompt's last onward)."""
    rows, offset = [], 0
    for length, response in zip(batch.layout.lengths, batch.response_lengths):
        rows.extend(range(offset + length - response - 1, offset + length - 1))
        offset += length
    return torch.tensor(rows)


def run(source: str, replay: bool, steps: int, path: str, groups) -> list[dict]:
    from stacx.models import build_model, load_hf_checkpoint
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.specializations.batch import MicroBatch
    from stacx.trainer.runtime.optim import build_optimizer, wrap_ddp
    from stacx.wire.types import GenerateRequest, SamplingParams

    torch.manual_seed(0)
    policy = build_model(path, groups, initialize_weights=False)
    load_hf_checkpoint(policy, path, groups)
    ddp = wrap_ddp(policy)
    optimizer, _ = build_optimizer(ddp, OPTIM, total_steps=steps)
    engine_dtype = torch.bfloat16 if source == "bf16 engine" else torch.float32
    engine_model = build_model(path, groups, params_dtype=engine_dtype)
    load_hf_checkpoint(engine_model, path, groups)
    engine = CpuEngine(engine_model, decoding="kv_cache")
    previous = _weights(policy, groups)
    rows = []
    for step in range(steps):
        prompts = [p for p in PROMPTS for _ in range(GROUP)]
        requests = [GenerateRequest(input_ids=p, return_routed_experts=True,
                                    sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS, seed=k + 1000 * step,
                                                            ignore_eos=True)) for k, p in enumerate(prompts)]
        outputs = engine.generate(requests)
        batch = MicroBatch.pack([torch.tensor(list(r.input_ids) + o.output_ids) for r, o in zip(requests, outputs)],
                                [len(o.output_ids) for o in outputs],
                                loss_masks=[torch.ones(len(o.output_ids)) for o in outputs],
                                routed_experts=[o.routed_experts for o in outputs])
        rollout_lp = torch.tensor([lp for o in outputs for lp in o.output_log_probs])
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        train_lp, own_routes = _response_terms(ddp, batch, groups, replay)
        if replay:  # the routes the trainer would have taken: one more forward without replay, for the metric
            with torch.no_grad():
                _, own_routes = _response_terms(ddp, batch, groups, False)
        route_rows = _response_route_rows(batch)
        engine_routes = batch.model_routes()[route_rows]
        differs = (own_routes[route_rows] != engine_routes).any(-1).any(-1).float()
        gap = (train_lp.detach() - rollout_lp).abs()
        rewards = torch.tensor([sum(t < 16 for t in o.output_ids) / len(o.output_ids) for o in outputs])
        grouped = rewards.view(len(PROMPTS), GROUP)
        advantages = (grouped - grouped.mean(1, keepdim=True)).flatten()
        per_token_adv = torch.cat([a.expand(len(o.output_ids)) for a, o in zip(advantages, outputs)])
        ratio = torch.exp(train_lp - rollout_lp)
        loss = -torch.minimum(ratio * per_token_adv, ratio.clamp(0.8, 1.2) * per_token_adv).mean()
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        current = _weights(policy, groups)
        engine.load_weights(previous if source == "stale by one" else current)
        engine.set_weight_version(step + 1)
        previous = current
        flipped = differs.bool()
        flipped_mean = float(gap[flipped].mean()) if bool(flipped.any()) else float("nan")
        rows.append(dict(source=source, replay=replay, step=step, mean_abs=float(gap.mean()), max_abs=float(gap.max()),
                         routes_differ=float(differs.mean()), mean_abs_where_routes_differ=flipped_mean,
                         reward=float(rewards.mean()), tokens=int(gap.numel())))
        print(f"{source:13s} replay={'on ' if replay else 'off'} step {step}: mean |dlogp| {gap.mean():.2e}  "
              f"max {gap.max():.2e}  routes differ {differs.mean():.1%} (there: {flipped_mean:.2e})  "
              f"reward {rewards.mean():.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=OPTIM.lr, help="Adam learning rate of the policy step")
    parser.add_argument("--json", default=None, help="write the per-step rows here")
    args = parser.parse_args()
    OPTIM.lr = args.lr
    torch.set_num_threads(2)
    from stacx.serving.cpu_engine import ensure_single_process_layout

    groups = ensure_single_process_layout()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        path = _checkpoint(folder)
        for source in ("bf16 engine", "stale by one"):
            for replay in (False, True):
                rows += run(source, replay, args.steps, path, groups)
    for source in ("bf16 engine", "stale by one"):
        mean = {replay: sum(r["mean_abs"] for r in rows if r["source"] == source and r["replay"] == replay) / args.steps
                for replay in (False, True)}
        print(f"{source}: mean |dlogp| over steps, replay / no replay = {mean[True] / mean[False]:.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
