"""scripts/train/swe/: each launcher's commands (printed by STACX_PRINT_ONLY=1) run in this process, `stacx
train` with --dry-run, on Ray's and torchrun's command lines; ENV_REFERENCE.md lists exactly the STACX_*
variables the code reads and every flag the launchers set."""

from __future__ import annotations

import glob
import http.server
import json
import os
import re
import shlex
import subprocess
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHERS = os.path.join(REPO, "scripts", "train", "swe")
REFERENCE = os.path.join(LAUNCHERS, "ENV_REFERENCE.md")
VARIABLE = re.compile(r"\bSTACX_[A-Z0-9_]+\b")


def _code_lines(path: str):
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            yield line.split("#", 1)[0] if path.endswith(".sh") else line


def test_env_reference_lists_every_variable_and_launcher_flag():
    sources = glob.glob(os.path.join(REPO, "stacx", "**", "*.py"), recursive=True)
    scripts = sorted(glob.glob(os.path.join(LAUNCHERS, "*.sh")))
    read = {name for path in sources + scripts for line in _code_lines(path) for name in VARIABLE.findall(line)}
    with open(REFERENCE, encoding="utf-8") as handle:
        reference = handle.read()
    listed = set(re.findall(r"`(STACX_[A-Z0-9_]+)`", reference))
    assert read >= {"STACX_MODEL", "STACX_LAUNCHER", "STACX_API_KEY", "STACX_TEACHER_URL"}
    assert listed == read, f"read but not listed: {sorted(read - listed)}; listed but not read: {sorted(listed - read)}"
    flags = {flag for path in scripts for line in _code_lines(path) for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*",
                                                                                          line)}
    assert {"--algorithm", "--teacher-url", "--nproc-per-node", "--sandbox-backend"} <= flags
    missing = [flag for flag in flags if not re.search(rf"(?<![\w-]){flag}(?![\w-])", reference)]
    assert not missing, f"flags the launchers use but ENV_REFERENCE.md does not list: {missing}"


class _Health(http.server.BaseHTTPRequestHandler):
    """A teacher stand-in for the dry run's reachability check: /health only."""

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _printed(launcher: str, environ: dict) -> list[list[str]]:
    done = subprocess.run(["bash", os.path.join(LAUNCHERS, launcher)], env=environ, capture_output=True, text=True,
                          timeout=30, check=True)
    return [shlex.split(line) for line in done.stdout.splitlines()]


def test_every_launcher_dry_runs_on_ray_and_under_torchrun(tmp_path, capsys):
    from stacx.launch.cli import main
    from stacx.models.testing import tiny_hf_config
    from stacx.rollout.agents.chat_tokenizers import build_tool_chat_tokenizer

    tokenizer = build_tool_chat_tokenizer("qwen")
    model = str(tmp_path / "model")
    # A dry run reads the config and the tokenizer, never the weights.
    tiny_hf_config("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                   max_position_embeddings=4096).save_pretrained(model)
    tokenizer.save_pretrained(model)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = {"PATH": os.environ["PATH"], "STACX_PRINT_ONLY": "1", "STACX_MODEL": model, "STACX_NUM_STEPS": "1",
            "STACX_TEACHER_URL": f"http://127.0.0.1:{server.server_port}"}
    try:
        for launcher, algorithm in (("grpo.sh", "grpo"), ("opd.sh", "opd"), ("mixed_dagger.sh", "mixture_dagger_opd"),
                                    ("mini_swe_agent.sh", "grpo")):
            out = str(tmp_path / launcher)
            (write, train) = _printed(launcher, {**base, "STACX_OUT_DIR": out})
            assert write[1:4] == ["-m", "stacx", "tasks"] and train[1:3] == ["-m", "stacx"]
            assert main(write[3:]) == 0
            with open(os.path.join(out, "swe_tasks.jsonl")) as handle:
                rows = [json.loads(line) for line in handle]
            assert len(rows) == 30 and rows[0]["metadata"]["environment"] == "swe"
            assert rows[0]["metadata"]["sandbox"] == {"backend": "namespace"}
            assert train[train.index("--algorithm") + 1] == algorithm
            assert main(train[3:] + ["--dry-run"]) == 0, capsys.readouterr().err[-2000:]
            assert f"recipe {algorithm}" in capsys.readouterr().out.lower().replace("'", "")
            if launcher == "mini_swe_agent.sh":  # mini-swe-agent runs each episode, its commands in a sandbox
                command = shlex.split(train[train.index("--agent-command") + 1])
                assert command[1:] == ["-m", "stacx.tasks.swe.mini_swe_agent"] and "--agent-timeout" in train
            # Under torchrun: the same `stacx train` flags (two data-parallel ranks), rows already written.
            (torchrun,) = _printed(launcher, {**base, "STACX_OUT_DIR": out, "STACX_LAUNCHER": "torchrun",
                                              "STACX_NPROC": "2", "STACX_PROMPT_DATA": os.path.join(out, "swe_tasks.jsonl")})
            expected = list(train[4:])
            expected[expected.index("--data-parallel-size") + 1] = "2"
            assert torchrun == ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "stacx.train", *expected]
    finally:
        server.shutdown()
    with pytest.raises(subprocess.CalledProcessError) as refused:
        _printed("grpo.sh", {**base, "STACX_LAUNCHER": "slurm"})
    assert "STACX_LAUNCHER=slurm" in refused.value.stderr


def test_a_launcher_says_when_its_recipe_is_overridden(tmp_path):
    environ = {"PATH": os.environ["PATH"], "STACX_PRINT_ONLY": "1", "STACX_MODEL": str(tmp_path),
               "STACX_PROMPT_DATA": "rows.jsonl"}
    for flags in (["--algorithm", "my_algo"], ["--algorithm=my_algo"]):
        done = subprocess.run(["bash", os.path.join(LAUNCHERS, "grpo.sh"), *flags], env=environ, capture_output=True,
                              text=True, timeout=30, check=True)
        assert f"grpo.sh: {' '.join(flags) if len(flags) == 2 else flags[0]} overrides this launcher's recipe (grpo)" \
            in done.stderr
    quiet = subprocess.run(["bash", os.path.join(LAUNCHERS, "grpo.sh"), "--algorithm", "grpo"], env=environ,
                           capture_output=True, text=True, timeout=30, check=True)
    assert quiet.stderr == ""


def test_stacx_tasks_swe_writes_the_chosen_rows_and_names_a_bad_flag(tmp_path):
    from stacx.launch.cli import main

    out = str(tmp_path / "rows.jsonl")
    assert main(["tasks", "swe", "--out", out, "--format", "patch", "--instance", "seriescalc__sum_up_to"]) == 0
    with open(out) as handle:
        (row,) = [json.loads(line) for line in handle]
    assert row["metadata"]["swe_task"]["instance_id"] == "seriescalc__sum_up_to" and "```diff" in row["prompt"]
    for flags, message in [(["--sandbox-backend", "dockr"], "--sandbox-\\* flags: sandbox.backend 'dockr' is unknown"),
                           (["--instance", "nope"], "--instance nope: no such task"),
                           (["--format", "patch", "--max-turns", "3"], "apply to --format environment only")]:
        with pytest.raises(SystemExit, match=message):
            main(["tasks", "swe", "--out", out, *flags])
