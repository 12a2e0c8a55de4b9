"""`stacx demo [--out DIR]`: the embedded default on CPU (what `make demo` runs).

SFT warm-up of a tiny model on the built-in sorting task, GRPO that raises its accuracy, then
on-policy distillation of a smaller student from it served by `stacx serve`. Every phase is a
real training run; the table at the end (also DIR/summary.json) gives each phase's metric
before and after on held-out prompts. See stacx/launch/demo/pipeline.py.

`stacx demo --agent`: a tiny model learns to call a tool in multi-turn episodes (SFT on tool-call
transcripts, then GRPO on episodes); stacx/launch/demo/agent.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

HELP = ("run the embedded default on CPU: SFT -> GRPO -> on-policy distillation of a tiny model, with plots "
        "(--agent: a tool-calling agent demo)")


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="outputs/demo", help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of models, data order and sampling")
    parser.add_argument("--no-progress-bar", action="store_true", help="plain log lines instead of progress bars")
    parser.add_argument("--agent", action="store_true",
                        help="the agent demo instead: SFT on tool-call transcripts then GRPO on multi-turn episodes, a "
                             "tiny model learns to call an `add` tool and answer (stacx/launch/demo/agent.py; default "
                             "--out outputs/demo_agent)")
    parser.add_argument("--diffusion", action="store_true",
                        help="the experimental diffusion demo instead: flow-matching SFT then Flow-GRPO of a tiny "
                             "MMDiT on coloured shapes (stacx/launch/demo/diffusion.py; default --out outputs/demo_diffusion)")


def next_steps_hint() -> str:
    """What to type next: `make demo` ran inside .venv, the user's shell is not in it yet."""
    in_venv = sys.prefix != sys.base_prefix
    activate = os.path.join(os.path.relpath(sys.prefix), "bin", "activate") if in_venv else None
    lines = ["Next: `stacx recipes`, `stacx train --help`, docs/launching.md."]
    if activate and not os.environ.get("VIRTUAL_ENV"):
        lines.insert(0, f"`stacx` lives in the virtual environment: run `source {activate}` first "
                        "(or call it as .venv/bin/stacx).")
    return "\n".join(lines)


def require_diffusers() -> None:
    """The diffusion demo needs diffusers, an extra `make demo` does not install."""
    if importlib.util.find_spec("diffusers") is None:
        raise SystemExit("stacx demo --diffusion needs diffusers, which this environment lacks: "
                         "pip install -e '.[diffusion]' (or .venv/bin/pip install diffusers), then run it again.")


def run(args) -> int:
    from stacx.launch.demo import DemoSettings, format_table, run_demo

    started = time.monotonic()
    if args.agent and args.diffusion:
        raise SystemExit("stacx demo: --agent and --diffusion are two different demos; pass one of them")
    if args.agent:
        return run_agent(args, started)
    if args.diffusion:
        require_diffusers()
        from stacx.launch.demo.diffusion import DiffusionDemoSettings, format_summary, run_diffusion_demo

        out = args.out if args.out != "outputs/demo" else "outputs/demo_diffusion"
        summary = run_diffusion_demo(DiffusionDemoSettings(seed=args.seed), out)
        print("\n" + format_summary(summary))
        print(f"outputs: {os.path.abspath(os.path.join(out, 'summary.json'))}, samples.png, reward_curve.png")
        print("\n" + next_steps_hint())
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    summary = run_demo(DemoSettings(seed=args.seed, progress_bar=not args.no_progress_bar), args.out)
    out = os.path.abspath(args.out)
    print("\n" + format_table(summary))
    opd = summary["phases"][-1]["extra"]
    print(f"\nstudent accuracy {opd['student_accuracy_before']:.3f} -> {opd['student_accuracy_after']:.3f} "
          f"(teacher {opd['teacher_accuracy']:.3f})")
    print(f"\nfinished in {time.monotonic() - started:.0f} s. Outputs:")
    print(f"  summary        {os.path.join(out, 'summary.json')}")
    print(f"  overview plot  {summary['outputs']['overview_plot'] and os.path.abspath(summary['outputs']['overview_plot'])}")
    for phase in ("sft", "grpo", "opd"):
        print(f"  {phase:<5} metrics {os.path.join(out, phase, 'metrics.jsonl')}, plots {os.path.join(out, phase, 'plots')}, "
              f"TensorBoard {os.path.join(out, phase, 'tensorboard')}")
    print(f"  checkpoints    {os.path.join(out, 'checkpoints')}")
    print("\n" + next_steps_hint())
    return 0


def run_agent(args, started: float) -> int:
    from stacx.launch.demo.agent import AgentDemoSettings, format_agent_table, run_agent_demo

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = args.out if args.out != "outputs/demo" else "outputs/demo_agent"
    summary = run_agent_demo(AgentDemoSettings(seed=args.seed, progress_bar=not args.no_progress_bar), out)
    out = os.path.abspath(out)
    print("\n" + format_agent_table(summary))
    print(f"\nfinished in {time.monotonic() - started:.0f} s. Outputs:")
    print(f"  summary        {os.path.join(out, 'summary.json')}")
    print(f"  overview plot  {os.path.abspath(summary['outputs']['overview_plot'])}")
    for phase in ("sft", "grpo"):
        print(f"  {phase:<5} metrics {os.path.join(out, phase, 'metrics.jsonl')}, plots {os.path.join(out, phase, 'plots')}, "
              f"TensorBoard {os.path.join(out, phase, 'tensorboard')}")
    print(f"  episodes       {os.path.join(out, 'data')} (training and held-out rows, SFT transcripts)")
    print("\n" + next_steps_hint())
    return 0
