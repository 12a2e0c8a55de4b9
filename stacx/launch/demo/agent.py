"""`stacx demo --agent`: a tiny model learns a multi-turn tool task on CPU, SFT warm-up then GRPO.

    summary = run_agent_demo(AgentDemoSettings(), out_dir="outputs/demo_agent")

The task (stacx/tasks/tool_addition.py): "what is 12+34? use add" -> the model calls the `add`
tool in the Qwen-style format, reads the result, answers "46". Reward 1.0 for the exact sum after a
correct call.

1. Data and model: training and held-out number pairs (disjoint), a random 2-layer hidden-64
   Llama-style model (initial weights of std 0.1) over the character tokenizer with the
   Qwen-style tool template whose system header lists the tool in one line ("qwen_compact" in
   stacx.rollout.agents.chat_tokenizers), so the numbers to copy sit close to the reply.
2. SFT: `sft` recipe on correct tool-call transcripts (each episode's two model turns).
3. GRPO: `grpo` recipe on multi-turn episodes of the environment (tool calls run in the roll-in).

Each phase is a real `stacx.trainer.run_training` run, like the main demo's (the phase knobs and
runner of phases.py, the plots of report.py). Before and after each phase the model plays one greedy
episode per held-out pair (episodes.py): success, tool-call rate, parse errors, turns.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from stacx.launch.demo.phases import (
    OnPolicyPhase,
    PhaseResult,
    SftPhase,
    TinyModel,
    phase_outputs,
    run_phase,
    write_summary,
)
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
    model: TinyModel = TinyModel(hidden_size=64, num_layers=2)
    rope_theta: float = 100.0
    """Rotary base; a small one sharpens attention at fixed short offsets (where the numbers to copy sit)."""
    init_std: float = 0.1
    """Standard deviation of the random initial weights (`initializer_range`). With the usual 0.02 the
    SFT loss stays hundreds of steps at the digits' entropy: the numbers are not copied yet."""
    chat_style: str = "qwen_compact"
    """Chat template (stacx.rollout.agents.chat_tokenizers): the Qwen-style one with a one-line tool list,
    so the question sits ~40 tokens before the call instead of ~400."""
    num_train_pairs: int = 2048
    num_eval_pairs: int = 128
    """Held-out number pairs (none of them in training) every before/after number is measured on."""
    sft: SftPhase = SftPhase(steps=250, batch_size=32, lr=3e-3)
    """SFT on correct tool-call transcripts (a batch is model turns)."""
    grpo: OnPolicyPhase = OnPolicyPhase(recipe="grpo", steps=30, prompts_per_step=8, samples_per_prompt=8, lr=5e-4,
                                        kl_coef=0.001)
    """GRPO on multi-turn episodes (samples are episodes), with a small KL to the SFT model."""
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
                            hidden_size=settings.model.hidden_size, intermediate_size=2 * settings.model.hidden_size,
                            num_hidden_layers=settings.model.num_layers,
                            num_attention_heads=settings.model.num_attention_heads,
                            num_key_value_heads=settings.model.num_attention_heads,
                            max_position_embeddings=1024, initializer_range=settings.init_std,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                            rope_parameters={"rope_type": "default", "rope_theta": settings.rope_theta})
    tokenizer.save_pretrained(paths["init"])
    return paths


def run_agent_demo(settings: AgentDemoSettings, out_dir: str, *, log=print) -> dict:
    """SFT then GRPO; returns (and writes to out_dir/summary.json) the held-out scores of every model."""
    from stacx.launch.demo import measure
    from stacx.launch.demo.episodes import TransformersGreedyEngine, play_heldout_episodes
    from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer
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
        log(f"  playing {len(heldout)} held-out episodes with the {name} (greedy)...")
        engine = TransformersGreedyEngine(measure.load_reference_model(checkpoint), eos_token_id=tokenizer.eos_token_id)
        result = asdict(play_heldout_episodes(engine, heldout, tokenizer=tokenizer,
                                              max_new_tokens=settings.max_new_tokens, seed=settings.seed))
        log(f"  held-out, {name}: " + ", ".join(f"{title} {result[key]:.3f}" for key, title in SCORE_COLUMNS))
        return result

    log(f"stacx demo --agent: call the `add` tool, then answer (two-digit numbers); vocabulary {len(tokenizer)} "
        f"tokens, {len(heldout)} held-out pairs; outputs in {os.path.abspath(out_dir)}")
    connection = connect_ray(None, log_to_driver=False)
    results: list[PhaseResult] = []

    def train_and_score(phase: str, values: dict, *, metric: str, curve: str, before: dict, phase_start: float) -> dict:
        """Train one phase into values["export_hf"]; records its PhaseResult and returns the trained model's scores."""
        first, last = run_phase(settings, out_dir, phase, values, metric=metric)
        tokenizer.save_pretrained(values["export_hf"])
        after = scores(values["export_hf"], f"after {phase.upper()}")
        results.append(PhaseResult(phase, "held-out success", before["success"], after["success"],
                                   time.monotonic() - phase_start,
                                   {"scores_before": before, "scores_after": after,
                                    f"{curve}_first_steps": first, f"{curve}_last_steps": last}))
        return after

    try:
        log(f"\n[1/2] SFT on tool-call transcripts: {settings.sft.steps} steps x {settings.sft.batch_size} turns, "
            f"{settings.model.describe()} model")
        phase_start = time.monotonic()
        before = scores(paths["init"], "initial model")
        after = train_and_score("sft", {
            **settings.sft.run_values(), "hf_checkpoint": paths["init"], "prompt_data": paths["sft"],
            "export_hf": paths["sft_model"]}, metric="policy/loss", curve="loss", before=before, phase_start=phase_start)

        log(f"\n[2/2] GRPO on multi-turn episodes: {settings.grpo.describe('episodes')}, "
            f"reward 1 for the exact sum after a correct call")
        final = train_and_score("grpo", {
            **settings.grpo.run_values(), "hf_checkpoint": paths["sft_model"], "ref_load": paths["sft_model"],
            "prompt_data": paths["train"], "rollout_max_response_len": settings.max_new_tokens,
            "export_hf": paths["grpo_model"]}, metric="rollout/reward_mean", curve="rollout_reward", before=after,
            phase_start=time.monotonic())
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
            **phase_outputs(out_dir, ("sft", "grpo")),
            "data": {name: paths[name] for name in ("train", "eval", "sft")},
            "checkpoints": {name: paths[name] for name in ("init", "sft_model", "grpo_model")},
            "overview_plot": plot,
        },
        "seconds": time.monotonic() - started,
    }
    return write_summary(out_dir, summary)


def format_agent_table(summary: dict) -> str:
    """Held-out scores of the initial, SFT and GRPO models, one row per model."""
    rows = [("model", *(title for _, title in SCORE_COLUMNS))]
    for name, scores in summary["heldout"].items():
        rows.append((name.replace("_", " "), *(f"{scores[key]:.3f}" for key, _ in SCORE_COLUMNS)))
    return format_rows(rows)
