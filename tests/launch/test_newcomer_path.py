"""Issue 17's "done when": a new user's first hour, walked end to end through the command line.

A tiny Hugging Face model and tokenizer made locally, prompts as JSONL, `stacx train --dry-run`
(and its one-line refusal of each bad input), a two-step GRPO run with `--export-hf` (which warns
that a random model's identical rewards give a zero loss), `stacx eval` of the export, the export
loaded by `transformers`, and `stacx serve` answering text with text.
Every command is a subprocess, as a user runs it.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
import urllib.request

import pytest
from tests.warm import warm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE_READY_TIMEOUT_S = 120.0
"""Bound on `stacx serve` printing its URL and answering /health 200."""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "STACX_API_KEY")}
    env.update({"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"})
    return env


def _stacx(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([warm_python(), "-m", "stacx", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout_s)


def _write_jsonl(path: str, rows: list) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def _train_flags(checkpoint: str, data: str, out: str) -> list[str]:
    return ["train", "--algorithm", "grpo", "--hf-checkpoint", checkpoint, "--prompt-data", data,
            "--rollout-engine", "cpu", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--num-steps", "2", "--max-tokens-per-micro-batch", "64",
            "--lr", "1e-4", "--num-cpus-per-rank", "1", "--out", out, "--no-progress-bar", "--no-tensorboard",
            "--no-plots"]


def _assert_refused(returncode: int, stderr: str, *named: str) -> None:
    """Exit 2 with one line on stderr (after any harmless tool notices), naming the flag, no traceback."""
    assert returncode == 2, (returncode, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-2000:]
    refusals = [line for line in stderr.splitlines() if line.startswith("stacx train: ")]
    assert len(refusals) == 1, stderr[-2000:]
    for text in named:
        assert text in refusals[0], refusals[0]


def _stacx_in_process(capsys, *args: str) -> tuple[int, str]:
    """`stacx ARGS` through the same entry point in this process: (exit code, stderr)."""
    from stacx.launch.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse refusals exit like the command does
        code = exit_.code
    return code, capsys.readouterr().err


def _start_server(export: str):
    """`stacx serve --port 0` on the export; returns (process, base URL) once /health answers 200."""
    server = subprocess.Popen([warm_python(), "-m", "stacx", "serve", "--hf-checkpoint", export, "--port", "0"],
                              cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    deadline = time.monotonic() + SERVE_READY_TIMEOUT_S
    url, seen = None, []
    while url is None:
        remaining = deadline - time.monotonic()
        assert remaining > 0 and server.poll() is None, f"stacx serve did not start: {''.join(seen)[-2000:]}"
        try:
            line = lines.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        seen.append(line)
        if "(ready)" in line:
            url = line.split(" at ", 1)[1].split(" (ready)", 1)[0].strip()
    while True:  # bounded poll of /health
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return server, url
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url}/health never answered 200"
        time.sleep(0.2)


def test_a_new_users_first_hour(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stacx.tasks import write_tiny_checkpoint

    # 1. A tiny model and tokenizer made locally, and the user's own JSONL prompts.
    checkpoint = write_tiny_checkpoint(str(tmp_path / "tiny"), "addition")
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(1, 5) for b in range(1, 3)]
    data = _write_jsonl(str(tmp_path / "prompts.jsonl"), rows)
    out, export = str(tmp_path / "run"), str(tmp_path / "export")
    flags = _train_flags(checkpoint, data, out) + ["--export-hf", export]

    # 2. The dry run passes on good inputs, and refuses each bad one in one line naming the flag: the
    # first refusal as a process (what the user's terminal shows), the rest through the same entry point.
    from stacx.launch.cli import main

    capsys.readouterr()
    assert main([*flags, "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("recipe grpo:")
    missing = _stacx(*flags, "--hf-checkpoint", str(tmp_path / "missing_model"), "--dry-run")
    _assert_refused(missing.returncode, missing.stderr, "--hf-checkpoint", "missing_model: no such folder")
    bad_rows = _write_jsonl(str(tmp_path / "bad.jsonl"), rows[:2] + ['{"prompt": "1+1=", "label": '])
    for extra, named in [
        (["--prompt-data", str(tmp_path / "missing.jsonl")], ("--prompt-data", "missing.jsonl: no such file")),
        (["--prompt-data", bad_rows], ("--prompt-data", "bad.jsonl:3")),
        (["--algorithm", "opd"], ("--teacher-url is not set",)),
        (["--tensor-model-parallel-size", "3"], ("--tensor-model-parallel-size 3 does not divide",
                                                 "num_attention_heads 4", "use one of [1, 2, 4]")),
    ]:
        _assert_refused(*_stacx_in_process(capsys, *flags, *extra, "--dry-run"), *named)

    # 3. A short GRPO run that keeps its model as a Hugging Face export.
    run = _stacx(*flags)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        assert [json.loads(line)["step"] for line in handle] == [0, 1]
    assert not os.path.exists(os.path.join(out, "plots"))  # --no-plots (the demo's run draws them)
    assert export in run.stdout  # the end-of-run summary says where the model went
    # A random model earns no reward: the run says why its loss is 0 (once), not silently.
    assert run.stderr.count("every group's rewards are identical") == 1, run.stderr[-3000:]
    assert "Falling back" not in run.stderr  # megatron's CPU fallback warnings stay hidden...
    import torch

    from stacx.backend_warnings import absent_gpu_packages
    if not torch.cuda.is_available() and absent_gpu_packages():  # ...one line names what is absent
        assert run.stderr.count("stacx: CPU path; optional GPU packages not installed:") == 1, run.stderr[-3000:]

    # 4. `stacx eval` of the export writes a JSON report with the held-out metrics (the same entry
    # point, in this process).
    report_path = str(tmp_path / "eval.json")
    code, stderr = _stacx_in_process(capsys, "eval", "--hf-checkpoint", export, "--eval-data", data,
                                     "--max-new-tokens", "4", "--n-samples", "2", "--temperature", "1.0",
                                     "--out", report_path)
    assert code == 0, stderr[-2000:]
    with open(report_path) as handle:
        report = json.load(handle)
    assert report["num_prompts"] == len(rows) and report["n_samples"] == 2
    assert 0.0 <= report["metrics"]["eval/mean_reward"] <= 1.0 and "eval/pass@2" in report["metrics"]

    # 5. The export loads with plain transformers, tokenizer included.
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    assert tokenizer.decode(tokenizer("3+4=", add_special_tokens=False)["input_ids"]) == "3+4="
    assert model.config.vocab_size == len(tokenizer)

    # 6. `stacx serve` of the export takes text and answers text.
    server, url = _start_server(export)
    try:
        body = json.dumps({"text": "3+4=", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}).encode()
        request = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert answer["output_ids"], answer
    assert answer["text"] == tokenizer.decode(answer["output_ids"], skip_special_tokens=True)
