"""The embedded default: SFT warm-up -> GRPO -> on-policy distillation, on CPU, in a few minutes.

    summary = run_demo(DemoSettings(), out_dir="outputs/demo")

1. Data and models: the built-in `sorting` task (sort five digits; 17-token character
   vocabulary), a random 2-layer hidden-64 teacher model and a smaller random student.
2. SFT: `sft` recipe on (prompt, sorted digits) rows.                metric: held-out accuracy
3. GRPO: `grpo` recipe from the SFT model, exact-match reward,
   low-variance KL to the SFT model logged (small coefficient).     metric: held-out accuracy
4. OPD: the GRPO model is served as a teacher by `stacx serve` (a separate process); the `opd`
   recipe trains the student on its own samples scored by it
   (top-K reverse KL).                                               metric: reverse KL to teacher

Each phase is a real `stacx.trainer.run_training` run (Ray role workers, the CPU rollout
engine) writing metrics.jsonl, TensorBoard events and plots under `out_dir/<phase>/`. The three
phases train one `policy` role laid out alike, so they share one running role worker (emptied and set
up again before each phase: `create_trainer(..., graph=)`) instead of starting one each. Before
and after numbers are measured on held-out prompts with `transformers` (see measure.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from stacx.launch.demo.phases import (
    OnPolicyPhase,
    PhaseResult,
    SftPhase,
    TinyModel,
    demo_run_config,
    phase_outputs,
    run_phase,
    train,
    write_summary,
)
from stacx.rollout.engines.processes import stop_process


DEMO_TORCH_THREADS = 1
"""torch's threads in the demo's driver (its held-out passes) and teacher server. The models are tiny: a
second thread does not make a pass faster, and its busy-waiting made each pass cost 3x the CPU (0.45 s
against 1.6 s for 256 sampled answers on 2 cores; the numbers are the same bit for bit). The run's role
workers and rollout servers already run one thread each."""


@dataclass(frozen=True, kw_only=True)
class DemoSettings:
    task: str = "sorting"
    """Built-in task (stacx.tasks)."""
    seed: int = 0
    """Seed of model initialization, data order and sampling."""
    teacher: TinyModel = TinyModel(hidden_size=64, num_layers=2)
    """The model SFT and GRPO train (OPD's teacher)."""
    student: TinyModel = TinyModel(hidden_size=32, num_layers=2)
    """The model OPD trains."""
    sft: SftPhase = SftPhase(steps=60, batch_size=32, lr=3e-3)
    """SFT warm-up of the teacher-sized model."""
    grpo: OnPolicyPhase = OnPolicyPhase(recipe="grpo", steps=40, prompts_per_step=16, samples_per_prompt=8, lr=5e-4,
                                        kl_coef=0.001)
    """GRPO from the SFT model, with a small low-variance KL to it."""
    opd: OnPolicyPhase = OnPolicyPhase(recipe="opd", steps=50, prompts_per_step=16, samples_per_prompt=4, lr=1e-2)
    """On-policy distillation of the student from the GRPO model."""
    opd_kl_mode: str = "topk"
    """'topk': reverse KL over the union of student and teacher top-K supports (learns fastest);
    'k3_sample': the single-sample k3 estimate on the sampled token."""
    num_eval_prompts: int = 128
    """Held-out prompts every before/after number is measured on."""
    kl_samples_per_prompt: int = 2
    """Student samples per held-out prompt in the reverse-KL estimate."""
    progress_bar: bool = True


class TeacherServer:
    """`stacx serve` of a checkpoint in a child process; `.url` once it reports ready."""

    def __init__(self, checkpoint: str, log_path: str, seed: int):
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "stacx", "serve", "--hf-checkpoint", checkpoint, "--port", "0", "--seed", str(seed),
             "--no-weight-updates"],  # a frozen teacher: no weight endpoints, no key
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=dict(os.environ, OMP_NUM_THREADS=str(DEMO_TORCH_THREADS)))  # as the run's own rollout server
        self.url = self._wait_ready(timeout_s=180)

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            if "(ready)" in line:
                return line.split(" at ", 1)[1].split(" (ready)")[0].strip()
        self.close()
        raise RuntimeError(f"stacx serve did not become ready (see {self.log.name})")

    def close(self) -> None:
        stop_process(self.process, timeout_s=30)
        self.log.close()


def _prepare(settings: DemoSettings, out_dir: str) -> dict:
    """Data files, the random teacher-sized and student-sized checkpoints (with tokenizers)."""
    from stacx.tasks import resolve_data_path, write_tiny_checkpoint

    paths = {
        "train": resolve_data_path(f"builtin:{settings.task}", out_dir=out_dir),
        "eval": resolve_data_path(f"builtin:{settings.task}/eval", out_dir=out_dir),
        "init": os.path.join(out_dir, "checkpoints", "init"),
        "student_init": os.path.join(out_dir, "checkpoints", "student_init"),
        "sft": os.path.join(out_dir, "checkpoints", "sft"),
        "grpo": os.path.join(out_dir, "checkpoints", "grpo"),
        "grpo_run": os.path.join(out_dir, "grpo", "checkpoints"),
        "student": os.path.join(out_dir, "checkpoints", "student_opd"),
    }
    write_tiny_checkpoint(paths["init"], settings.task, hidden_size=settings.teacher.hidden_size,
                          num_layers=settings.teacher.num_layers,
                          num_attention_heads=settings.teacher.num_attention_heads, seed=settings.seed)
    write_tiny_checkpoint(paths["student_init"], settings.task, hidden_size=settings.student.hidden_size,
                          num_layers=settings.student.num_layers,
                          num_attention_heads=settings.student.num_attention_heads, seed=settings.seed + 1)
    return paths


def _save_tokenizer(task_name: str, folder: str) -> None:
    """Exported checkpoints hold config and weights; the next phase also needs the tokenizer."""
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.tasks import get_task

    build_char_tokenizer(get_task(task_name).alphabet).save_pretrained(folder)


def run_demo(settings: DemoSettings, out_dir: str, *, log=print) -> dict:
    """Run the three phases; returns (and writes to out_dir/summary.json) the before/after table."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(DEMO_TORCH_THREADS)
    try:
        return _run_demo(settings, out_dir, log=log)
    finally:
        torch.set_num_threads(threads)


def _run_demo(settings: DemoSettings, out_dir: str, *, log) -> dict:
    from stacx.launch.demo import measure
    from stacx.launch.demo.report import write_demo_plot
    from stacx.rollout.teacher import TeacherClient
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.tasks import get_task
    from stacx.trainer.cluster.ray.connect import connect_ray
    from stacx.trainer.factory import create_run_workers
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # checkpoint load/save bars would interleave with the demo's own
    started = time.monotonic()
    os.makedirs(out_dir, exist_ok=True)
    task = get_task(settings.task)
    tokenizer = build_char_tokenizer(task.alphabet)
    max_new_tokens = task.max_answer_chars + 1  # the answer and <eos>
    paths = _prepare(settings, out_dir)
    with open(paths["eval"]) as handle:
        eval_rows = [json.loads(line) for line in handle][: settings.num_eval_prompts]

    def accuracy(path: str) -> float:
        log(f"  evaluating {len(eval_rows)} held-out prompts (greedy) with {os.path.basename(path)}...")
        return measure.greedy_accuracy(measure.load_reference_model(path), tokenizer, eval_rows,
                                       max_new_tokens=max_new_tokens)

    log(f"stacx demo: task '{task.name}' ({task.description}), vocabulary {len(tokenizer)} tokens, "
        f"{len(eval_rows)} held-out prompts; outputs in {os.path.abspath(out_dir)}")
    # One local Ray cluster for the three runs (each run attaches to it instead of starting its own).
    connection = connect_ray(None, log_to_driver=False)
    results: list[PhaseResult] = []
    graph = None
    try:
        graph = create_run_workers(demo_run_config(settings, out_dir, "sft", settings.sft.run_values()))
        # ---- 1. SFT warm-up -------------------------------------------------------------------
        log(f"\n[1/3] SFT warm-up: {settings.sft.steps} steps x {settings.sft.batch_size} examples, "
            f"{settings.teacher.describe()} model")
        phase_start = time.monotonic()
        before = accuracy(paths["init"])
        loss_first, loss_last = run_phase(settings, out_dir, "sft", {
            **settings.sft.run_values(), "hf_checkpoint": paths["init"], "prompt_data": paths["train"],
            "export_hf": paths["sft"]}, metric="policy/loss", graph=graph)
        _save_tokenizer(task.name, paths["sft"])
        results.append(PhaseResult("sft", "held-out accuracy", before, accuracy(paths["sft"]),
                                   time.monotonic() - phase_start,
                                   {"loss_first_steps": loss_first, "loss_last_steps": loss_last}))

        # ---- 2. GRPO --------------------------------------------------------------------------
        log(f"\n[2/3] GRPO: {settings.grpo.describe()}, exact-match reward")
        phase_start = time.monotonic()
        reward_first, reward_last = run_phase(settings, out_dir, "grpo", {
            **settings.grpo.run_values(), "hf_checkpoint": paths["sft"], "ref_load": paths["sft"],
            "prompt_data": paths["train"], "rollout_max_response_len": max_new_tokens, "export_hf": paths["grpo"],
            # The run's own checkpoint too: `stacx train --load`, `stacx eval --load` and
            # `stacx convert checkpoint-to-hf` in the docs work on it as written.
            "save": paths["grpo_run"]}, metric="rollout/reward_mean", graph=graph)
        _save_tokenizer(task.name, paths["grpo"])
        results.append(PhaseResult("grpo", "held-out accuracy", results[-1].after, accuracy(paths["grpo"]),
                                   time.monotonic() - phase_start,
                                   {"rollout_reward_first_steps": reward_first, "rollout_reward_last_steps": reward_last}))

        # ---- 3. On-policy distillation from the GRPO model served by `stacx serve` --------------
        log(f"\n[3/3] On-policy distillation: student {settings.student.describe()} learns from the GRPO model "
            f"served by `stacx serve`, {settings.opd.describe()}")
        phase_start = time.monotonic()
        log("  starting `stacx serve` with the GRPO model as the teacher (log: teacher_server.log)...")
        server = TeacherServer(paths["grpo"], os.path.join(out_dir, "teacher_server.log"), settings.seed)
        teacher = TeacherClient(server.url)
        try:
            def reverse_kl(path: str) -> float:
                log(f"  measuring the reverse KL to the teacher of {os.path.basename(path)} on {len(eval_rows)} "
                    f"held-out prompts x {settings.kl_samples_per_prompt} samples...")
                return measure.reverse_kl_to_teacher(
                    measure.load_reference_model(path), tokenizer, eval_rows, teacher, max_new_tokens=max_new_tokens,
                    num_samples=settings.kl_samples_per_prompt, seed=settings.seed)

            kl_before, accuracy_before = reverse_kl(paths["student_init"]), accuracy(paths["student_init"])
            log("  training the student on its own samples, scored by the teacher...")
            train(demo_run_config(settings, out_dir, "opd", {
                **settings.opd.run_values(), "hf_checkpoint": paths["student_init"], "prompt_data": paths["train"],
                "teacher_url": server.url, "distill_kl_mode": settings.opd_kl_mode,
                "rollout_max_response_len": max_new_tokens, "export_hf": paths["student"]}), graph)
            _save_tokenizer(task.name, paths["student"])
            kl_after, accuracy_after = reverse_kl(paths["student"]), accuracy(paths["student"])
        finally:
            teacher.close()
            server.close()
        results.append(PhaseResult("opd", "reverse KL(student || teacher) per token", kl_before, kl_after,
                                   time.monotonic() - phase_start,
                                   {"student_accuracy_before": accuracy_before, "student_accuracy_after": accuracy_after,
                                    "teacher_accuracy": results[-1].after}))
    finally:
        try:
            if graph is not None and graph.ended is None:
                graph.shutdown()
        finally:
            connection.shutdown()

    plot = write_demo_plot(out_dir, ["sft", "grpo", "opd"], [asdict(result) for result in results], task=task.name)
    summary = {
        "task": task.name,
        "settings": asdict(settings),
        "phases": [asdict(result) for result in results],
        "outputs": {
            **phase_outputs(out_dir, ("sft", "grpo", "opd")),
            "checkpoints": {name: paths[name] for name in ("init", "sft", "grpo", "student_init", "student")},
            "overview_plot": plot,
        },
        "seconds": time.monotonic() - started,
    }
    return write_summary(out_dir, summary)
