"""GRPO with several optimizer steps per rollout, twice: Stacx's loop, and a plain-PyTorch reference.

Both start from the same tiny Hugging Face checkpoint and train on the same fixed rollouts (no
engine: the loop's `collect_batch` hands it each rollout), split by the same seeded mini-batch
schedule (`mini_batch_indices`). The reference is written from the algorithm, not from Stacx:

    per rollout:   A_i = (r_i - mean_g r) / (std_g r + eps)         (unbiased std over the prompt group)
                   log pi_old = the current model's log-probs       (once, before the first update)
    per mini-batch B (an optimizer step; lr linear from lr to min_lr over all optimizer steps):
                   rho_t = exp(log pi_t - log pi_old_t)
                   L = sum_{i in B} sum_t max(-A_i rho_t, -A_i clip(rho_t, 1 - eps_lo, 1 + eps_hi)) / N_B
                   N_B = response tokens of B;  clip the grad norm to 1; AdamW step

Used by tests/trainer/test_loop_mini_batches.py (Stacx on 2 gloo ranks against the reference) and
bench/peers/mini_batches_vs_reference.py (prints the agreement).
"""

from __future__ import annotations

import os

import torch

GROUP_SIZE = 4
NUM_PROMPTS = 4
SETTINGS = dict(lr=3e-3, min_lr=1.5e-3, clip_ratio=0.05, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.98, lr_decay_style="linear",
                seed=1234)
"""The run's settings the reference mirrors (the Stacx run passes them as flags)."""
ADAM_EPS = 1e-8
"""megatron's OptimizerConfig.adam_eps default."""
ADV_EPS = 1e-6


def make_rollouts(num_rollouts: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """Fixed rollouts: NUM_PROMPTS prompts x GROUP_SIZE samples of random tokens, varied rewards."""
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for _ in range(num_rollouts):
        tokens, lengths, rewards, prompt_ids = [], [], [], []
        for prompt in range(NUM_PROMPTS):
            prompt_ids_ = torch.randint(1, vocab_size, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen)
            for _ in range(GROUP_SIZE):
                length = int(torch.randint(3, 9, (1,), generator=gen))
                response = torch.randint(1, vocab_size, (length,), generator=gen)
                tokens.append(torch.cat([prompt_ids_, response]).tolist())
                lengths.append(length)
                rewards.append(float(torch.randint(0, 4, (1,), generator=gen)))
                prompt_ids.append(prompt)
        rollouts.append(dict(tokens=tokens, response_lengths=lengths, rewards=rewards, prompt_id=prompt_ids))
    return rollouts


def step_batch(rollout: dict):
    """The rollout as the loop's `StepBatch` (what `collect_batch` returns)."""
    from stacx.trainer.batch import StepBatch

    return StepBatch(tokens=[torch.tensor(t, dtype=torch.long) for t in rollout["tokens"]],
                     response_lengths=list(rollout["response_lengths"]),
                     loss_masks=[torch.ones(n) for n in rollout["response_lengths"]],
                     rewards=list(rollout["rewards"]), prompt_id=list(rollout["prompt_id"]))


# ---- Stacx: the real loop over RoleRuntime ranks (LocalRoleGroup), in a spawned gloo world ------------

def train_stacx(groups, root: str, checkpoint: str, rollouts: list[dict], values: dict) -> dict:
    """Run StacxTrainer (recipe grpo) on this rank over `rollouts`; returns the metrics rows (rank 0), the
    `compute_fields` calls and the final metrics."""
    import torch.distributed as dist

    from stacx.trainer.cluster.local import LocalRoleGroup, TorchrunChannel
    from stacx.trainer.config.mini_batches import num_optimizer_steps, with_resolved_mini_batches
    from stacx.trainer.config.resolve import resolve_algorithm_config
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.loop import StacxTrainer
    from stacx.trainer.metrics import MetricsLogger
    from stacx.trainer.recipes import get_recipe
    from stacx.trainer.runtime.role_runtime import RoleRuntime

    out = os.path.join(root, "out")
    base = dict(SETTINGS, train={"algorithm": "grpo"}, hf_checkpoint=checkpoint, num_steps=len(rollouts),
                rollout_batch_size=NUM_PROMPTS, n_samples_per_prompt=GROUP_SIZE, out=out, progress_bar=False,
                tensorboard=False, collective_timeout_s=120.0)
    training_config = get_recipe("grpo")
    run_config = with_resolved_mini_batches(RunConfig.from_dict({**base, **values}, source="test"), "rollout")
    algorithm = resolve_algorithm_config(training_config, run_config, environ={})
    role = training_config.roles[0]
    group = LocalRoleGroup(RoleRuntime(role, algorithm, groups, model=run_config.model, optim=run_config.optim,
                                       train=run_config.train, rank=dist.get_rank()), role.name)
    calls = []
    compute_fields = group.compute_fields

    def recording(shards, names):
        calls.append(list(names))
        return compute_fields(shards, names)

    group.compute_fields = recording
    trainer = StacxTrainer(
        run_config=run_config, training_config=training_config, algorithm=algorithm, roles={role.name: group},
        channel=TorchrunChannel(), data=None,
        make_metrics_logger=lambda start: MetricsLogger(out, total_steps=num_optimizer_steps(run_config.train),
                                                        start_step=start, tensorboard=False, progress_bar=False,
                                                        plots=False))
    trainer.collect_batch = lambda step: (step_batch(rollouts[step]), {"rollout/reward_mean": 0.0})
    last = trainer.run()
    rows = None
    if dist.get_rank() == 0:
        import json

        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return {"rows": rows, "calls": calls, "last": last,
            "recompute_old_log_probs": bool(algorithm.recompute_old_log_probs)}


# ---- the plain-PyTorch reference ----------------------------------------------------------------------

def response_log_probs(model, tokens: list[int], response_length: int) -> torch.Tensor:
    """log pi of the last `response_length` tokens of one sequence [R]."""
    ids = torch.tensor([tokens])
    logits = model(input_ids=ids).logits[0].float()                    # [T, V]
    log_probs = torch.log_softmax(logits[-response_length - 1:-1], dim=-1)
    return log_probs.gather(-1, ids[0, -response_length:, None])[:, 0]


def group_advantages(rewards: list[float], prompt_ids: list[int]) -> list[float]:
    r = torch.tensor(rewards, dtype=torch.float64)
    advantages = torch.zeros_like(r)
    for prompt in set(prompt_ids):
        members = torch.tensor([i for i, p in enumerate(prompt_ids) if p == prompt])
        group = r[members]
        advantages[members] = (group - group.mean()) / (group.std(unbiased=True) + ADV_EPS)
    return advantages.tolist()


def reference_run(checkpoint: str, rollouts: list[dict], *, num_steps_per_rollout: int,
                  num_epochs: int = 1) -> list[dict]:
    """One row per optimizer step: loss, pg_clipfrac, ppo_kl, grad_norm (before clipping), lr used."""
    from transformers import AutoModelForCausalLM

    from stacx.trainer.config.mini_batches import mini_batch_indices, sample_groups

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=SETTINGS["lr"], betas=(SETTINGS["adam_beta1"], SETTINGS["adam_beta2"]),
                                  eps=ADAM_EPS, weight_decay=0.0)
    low = high = SETTINGS["clip_ratio"]
    total_steps = len(rollouts) * num_steps_per_rollout * num_epochs
    rows, done = [], 0
    for step, rollout in enumerate(rollouts):
        tokens, lengths = rollout["tokens"], rollout["response_lengths"]
        advantages = group_advantages(rollout["rewards"], rollout["prompt_id"])
        with torch.no_grad():
            old = [response_log_probs(model, t, n) for t, n in zip(tokens, lengths)]
        groups, _ = sample_groups(rollout["prompt_id"], None, len(tokens))
        for indices in mini_batch_indices(groups, num_steps_per_rollout=num_steps_per_rollout, num_epochs=num_epochs,
                                          seed=SETTINGS["seed"], rollout_step=step):
            lr = SETTINGS["lr"] - (SETTINGS["lr"] - SETTINGS["min_lr"]) * done / total_steps
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            optimizer.zero_grad()
            num_tokens = sum(lengths[i] for i in indices)
            loss, clipped, kl = 0.0, 0.0, 0.0
            for i in indices:
                new = response_log_probs(model, tokens[i], lengths[i])
                ratio = torch.exp(new - old[i])
                unclipped_term = -advantages[i] * ratio
                clipped_term = -advantages[i] * ratio.clamp(1 - low, 1 + high)
                loss = loss + torch.maximum(unclipped_term, clipped_term).sum() / num_tokens
                clipped += float((clipped_term > unclipped_term).sum()) / num_tokens
                kl += float((old[i] - new.detach()).sum()) / num_tokens
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, SETTINGS["clip_grad"]))
            optimizer.step()
            done += 1
            rows.append(dict(rollout_step=step, loss=float(loss), pg_clipfrac=clipped, ppo_kl=kl, grad_norm=grad_norm,
                             lr=lr))
    return rows


def max_relative_differences(stacx_rows: list[dict], reference_rows: list[dict], role: str = "policy") -> dict:
    """max over optimizer steps of |stacx - reference| / max(|reference|, floor) for each compared metric."""
    floor = 1e-12
    out = {}
    for name in ("loss", "pg_clipfrac", "grad_norm"):
        out[name] = max(abs(s[f"{role}/{name}"] - r[name]) / max(abs(r[name]), floor)
                        for s, r in zip(stacx_rows, reference_rows))
    return out
