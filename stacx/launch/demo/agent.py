"""`stacx demo --agent`: a tiny model learns a multi-turn tool task on CPU, SFT warm-up then GRPO.

    summary = run_agent_demo(AgentDemoSettings(), out_dir="outputs/demo_agent")

The task (stacx/tasks/tool_addition.py): "what is 12+34? use add" -> the model calls the `add`
tool in the Qwen-style format, reads the result, answers "46". Reward 1.0 for the exact sum after a
correct call.

1. Data and model: training and held-out number pairs (disjoint), a random 2-layer hidden-64
   Llama-style model (initial weights of std 0.1) over the character tokenizer with the
   Qwen-style tool template whose system header lists the tool in one line ("qwen_compact" in
   stacx.rollout.chat_tokenizers), so the numbers to copy sit close to the reply.
2. SFT: `sft` recipe on correct tool-call transcripts (each episode's two model turns).
3. GRPO: `grpo` recipe on multi-turn episodes of the environment (tool calls run in the roll-in).

Each phase is a real `stacx.trainer.run_training` run, like the main demo's (pipeline.py, whose
phase runner and plots this reuses). Before and after each phase the model plays one greedy
episode per held-out pair (episodes.py): success, tool-call rate, parse errors, turns.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from stacx.launch.demo.pipeline import PhaseResult, _head_tail_means, _metric_series, _run_config, _train
from stacx.launch.demo.report import format_rows, write_demo_plot

AGENT_PANELS = (
    ("sft", "policy/loss", "SFT on tool transcripts: loss", "nats per token"),
    ("grpo", "rollout/reward_mean", "GRPO: mean episode reward", "mean reward of the episodes"),
    ("grpo", "agent/turns_mean", "GRPO: model turns per episode", "turns"),
    ("grpo", "agent/parse_errors", "GRPO: malformed tool calls", "per step"),
)
SUCCESS_BARS = (
    ("sft", "before", "initial"),
    ("sft", "after", "after SFT"),
    ("grpo", "after", "after GRPO"),
)
SCORE_COLUMNS = (("success", "held-out success"), ("tool_call_rate", "tool-call rate"),
                 ("parse_errors", "parse errors/episode"), ("turns", "turns/episode"))


@dataclass(frozen=True, kw_only=True)
class AgentDemoSettings:
    seed: int = 0
    """Seed of the model initialization, the number pairs, data order and sampling."""
    hidden_size: int = 64
    num_layers: int = 2
    rope_theta: float = 100.0
    """Rotary base; a small one sharpens attention at fixed short offsets (where the numbers to copy sit)."""
    init_std: float = 0.1
    """Standard deviation of the random initial weights (`initializer_range`). With the usual 0.02 the
    SFT loss stays hundreds of steps at the digits' entropy: the numbers are not copied yet."""
    chat_style: str = "qwen_compact"
    """Chat template (stacx.rollout.chat_tokenizers): the Qwen-style one with a one-line tool list,
    so the question sits ~40 tokens before the call instead of ~400."""
    num_train_pairs: int = 2048
    num_eval_pairs: int = 128
    """Held-out number pairs (none of them in training) every before/after number is measured on."""
    sft_steps: int = 250
    sft_batch_size: int = 32
    sft_lr: float = 3e-3
    grpo_steps: int = 30
    grpo_prompts_per_step: int = 8
    grpo_samples_per_prompt: int = 8
    grpo_lr: float = 5e-4
    grpo_kl_coef: float = 0.001
    max_new_tokens: int = 48
    """Tokens per model turn (a tool call is 45 with its end-of-turn token)."""
    progress_bar: bool = True


def _prepare(settings: AgentDemoSettings, out_dir: str, tokenizer) -> dict:
    """Prompt rows (train, held-out), SFT transcripts, and the random initial checkpoint with its tokenizer."""
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.tasks import tool_addition

    data = os.path.join(out_dir, "data")
    os.makedirs(data, exist_ok=True)
    eval_pairs = tool_addition.addition_pairs(seed=settings.seed + 1_000, count=settings.num_eval_pairs)
    train_pairs = tool_addition.addition_pairs(seed=settings.seed, count=settings.num_train_pairs, exclude=eval_pairs)
    paths = {"train": os.path.join(data, "train_episodes.jsonl"), "eval": os.path.join(data, "heldout_episodes.jsonl"),
             "sft": os.path.join(data, "sft_transcripts.jsonl"),
             **{name: os.path.join(out_dir, "checkpoints", name) for name in ("init", "sft_model", "grpo_model")}}
    for path, rows in ((paths["train"], tool_addition.episode_rows(train_pairs)),
                       (paths["eval"], tool_addition.episode_rows(eval_pairs)),
                       (paths["sft"], tool_addition.transcript_rows(train_pairs, tokenizer))):
        with open(path, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    save_tiny_hf_checkpoint(paths["init"], "llama", seed=settings.seed, vocab_size=len(tokenizer),
                            hidden_size=settings.hidden_size, intermediate_size=2 * settings.hidden_size,
                            num_hidden_layers=settings.num_layers, num_attention_heads=settings.hidden_size // 16,
                            num_key_value_heads=settings.hidden_size // 16,
                            max_position_embeddings=1024, initializer_range=settings.init_std,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                            rope_parameters={"rope_type": "default", "rope_theta": settings.rope_theta})
    tokenizer.save_pretrained(paths["init"])
    return paths


def run_agent_demo(settings: AgentDemoSettings, out_dir: str, *, log=print) -> dict:
    """SFT then GRPO; returns (and writes to out_dir/summary.json) the held-out scores of every model."""
    from stacx.launch.demo import measure
    from stacx.launch.demo.episodes import TransformersGreedyEngine, play_heldout_episodes
    from stacx.rollout.chat_tokenizers import build_tool_chat_tokenizer
    from stacx.rollout.data import DataConfig, load_examples
    from stacx.trainer.cluster.ray.connect import connect_ray
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    started = time.monotonic()
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tool_chat_tokenizer(settings.chat_style)
    paths = _prepare(settings, out_dir, tokenizer)
    heldout = load_examples(DataConfig(path=paths["eval"], kind="prompt", apply_chat_template=False), tokenizer)

    def scores(checkpoint: str, name: str) -> dict:
        engine = TransformersGreedyEngine(measure.load_reference_model(checkpoint), eos_token_id=tokenizer.eos_token_id)
        result = asdict(play_heldout_episodes(engine, heldout, tokenizer=tokenizer,
                                              max_new_tokens=settings.max_new_tokens, seed=settings.seed))
        log(f"  held-out, {name}: " + ", ".join(f"{title} {result[key]:.3f}" for key, title in SCORE_COLUMNS))
        return result

    log(f"stacx demo --agent: call the `add` tool, then answer (two-digit numbers); vocabulary {len(tokenizer)} "
        f"tokens, {len(heldout)} held-out pairs; outputs in {os.path.abspath(out_dir)}")
    connection = connect_ray(None, log_to_driver=False)
    results: list[PhaseResult] = []
    try:
        log(f"\n[1/2] SFT on tool-call transcripts: {settings.sft_steps} steps x {settings.sft_batch_size} turns, "
            f"{settings.num_layers}-layer hidden-{settings.hidden_size} model")
        phase_start = time.monotonic()
        before = scores(paths["init"], "initial model")
        _train(_run_config(settings, out_dir, "sft", {
            "train": {"algorithm": "sft"}, "hf_checkpoint": paths["init"], "prompt_data": paths["sft"],
            "rollout_batch_size": settings.sft_batch_size, "lr": settings.sft_lr, "num_steps": settings.sft_steps,
            "export_hf": paths["sft_model"]}))
        tokenizer.save_pretrained(paths["sft_model"])
        after = scores(paths["sft_model"], "after SFT")
        loss_first, loss_last = _head_tail_means(_metric_series(os.path.join(out_dir, "sft", "metrics.jsonl"), "policy/loss"))
        results.append(PhaseResult("sft", "held-out success", before["success"], after["success"],
                                   time.monotonic() - phase_start,
                                   {"scores_before": before, "scores_after": after,
                                    "loss_first_steps": loss_first, "loss_last_steps": loss_last}))

        log(f"\n[2/2] GRPO on multi-turn episodes: {settings.grpo_steps} steps x {settings.grpo_prompts_per_step} "
            f"prompts x {settings.grpo_samples_per_prompt} episodes, reward 1 for the exact sum after a correct call")
        phase_start = time.monotonic()
        _train(_run_config(settings, out_dir, "grpo", {
            "train": {"algorithm": "grpo"}, "algorithm": {"use_kl_loss": True, "kl_loss_coef": settings.grpo_kl_coef},
            "hf_checkpoint": paths["sft_model"], "ref_load": paths["sft_model"], "prompt_data": paths["train"],
            "rollout_batch_size": settings.grpo_prompts_per_step,
            "n_samples_per_prompt": settings.grpo_samples_per_prompt,
            "rollout_max_response_len": settings.max_new_tokens, "lr": settings.grpo_lr,
            "num_steps": settings.grpo_steps, "export_hf": paths["grpo_model"]}))
        tokenizer.save_pretrained(paths["grpo_model"])
        final = scores(paths["grpo_model"], "after GRPO")
        reward_first, reward_last = _head_tail_means(
            _metric_series(os.path.join(out_dir, "grpo", "metrics.jsonl"), "rollout/reward_mean"))
        results.append(PhaseResult("grpo", "held-out success", after["success"], final["success"],
                                   time.monotonic() - phase_start,
                                   {"scores_before": after, "scores_after": final,
                                    "rollout_reward_first_steps": reward_first, "rollout_reward_last_steps": reward_last}))
    finally:
        connection.shutdown()

    phases = [asdict(result) for result in results]
    plot = write_demo_plot(out_dir, ["sft", "grpo"], phases, task="tool_addition", panels=AGENT_PANELS,
                           bars_spec=SUCCESS_BARS, bars_title="Held-out success (exact sum after a correct call)")
    summary = {
        "task": "tool_addition",
        "settings": asdict(settings),
        "phases": phases,
        "heldout": {"initial": before, "after_sft": after, "after_grpo": final},
        "outputs": {
            **{phase: {"metrics": os.path.join(out_dir, phase, "metrics.jsonl"),
                       "tensorboard": os.path.join(out_dir, phase, "tensorboard"),
                       "plots": os.path.join(out_dir, phase, "plots")} for phase in ("sft", "grpo")},
            "data": {name: paths[name] for name in ("train", "eval", "sft")},
            "checkpoints": {name: paths[name] for name in ("init", "sft_model", "grpo_model")},
            "overview_plot": plot,
        },
        "seconds": time.monotonic() - started,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    return summary


def format_agent_table(summary: dict) -> str:
    """Held-out scores of the initial, SFT and GRPO models, one row per model."""
    rows = [("model", *(title for _, title in SCORE_COLUMNS))]
    for name, scores in summary["heldout"].items():
        rows.append((name.replace("_", " "), *(f"{scores[key]:.3f}" for key, _ in SCORE_COLUMNS)))
    return format_rows(rows)
