"""How a `stacx train` process ends when it cannot finish: Ctrl-C and SIGTERM stop the driver within
30 s leaving nothing behind (no `stacx serve` child, no /dev/shm/stacx-* file, no checkpoint staging
folder), and a NaN reward stops the run with exit 1 and a one-line message. Under torchrun: Ctrl-C of
`stacx torchrun` exits 130 with the same two lines as on Ray, while the run holds --save another run
is refused naming its pid, and a SIGKILLed `torchrun` leaves no rank or server writing checkpoints.

In the signal test the reward function hangs from the second step on (after a weight push has used
shared memory), so the signal arrives while the driver waits on it."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.warm import process_running, warm_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER_ENV = "STACX_TEST_HANG_MARKER"
SAMPLES_PER_STEP = 4  # rollout_batch_size 2 x n_samples_per_prompt 2
_calls = [0]


def mark_the_second_step(response: str, label, metadata: dict) -> float:
    """A reward that writes the marker file once the second step scores its samples, and goes on."""
    _calls[0] += 1
    if _calls[0] > SAMPLES_PER_STEP:
        with open(os.environ[MARKER_ENV], "w") as handle:
            handle.write("second step\n")
    return float(len(response) % 3)


def hang_from_the_second_step(response: str, label, metadata: dict) -> float:
    """A reward that answers the first step's samples, then writes the marker file and hangs."""
    _calls[0] += 1
    if _calls[0] <= SAMPLES_PER_STEP:
        return float(len(response) % 3)
    with open(os.environ[MARKER_ENV], "w") as handle:
        handle.write("hanging\n")
    threading.Event().wait()
    return 0.0


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the direct children of `pid`."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid:
                continue
            child = int(stat.split("/")[2])
            with open(f"/proc/{child}/cmdline", "rb") as handle:
                found.append((child, handle.read().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _shm_files_mapped_by(pids: list[int]) -> set[str]:
    """The /dev/shm/stacx-* files these processes have mapped (a run's staging files: other runs on
    this machine, e.g. tests on another worker, have their own, under another random prefix)."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as handle:
                found.update(line.split()[-1] for line in handle if "/dev/shm/stacx-" in line)
        except OSError:
            continue
    return {path.removesuffix(" (deleted)") for path in found}


def _shm_prefixes(paths: set[str]) -> set[str]:
    """`/dev/shm/stacx-weights-<server prefix>-`: every staging file one server makes starts with it."""
    return {path.rsplit("-", 1)[0] + "-" for path in paths}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from stacx.tasks import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("signals") / "ckpt"), "addition")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_driver_stops_within_30_s_and_leaves_nothing_behind(checkpoint, tmp_path, signum, request):
    """SIGTERM reaches a driver that started its own local Ray cluster; Ctrl-C one attached to a running
    cluster with --ray-address (the shared test cluster). The attached one runs warm (tests/warm.py), followed
    through its client; the other cold, as the reaper finds its cluster's processes by their environment."""
    marker = tmp_path / "hanging"
    save = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({MARKER_ENV: str(marker), "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0",
                "PYTHONPATH": REPO})
    python = warm_python() if signum == signal.SIGINT else sys.executable
    command = [python, "-m", "stacx", "train", "--algorithm", "grpo", "--hf-checkpoint", checkpoint,
               "--prompt-data", "builtin:addition", "--rollout-engine", "cpu", "--rollout-batch-size", "2",
               "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-steps", "5",
               "--max-tokens-per-micro-batch", "64", "--lr", "1e-4", "--num-cpus-per-rank", "1",
               "--reward-fn", "tests.launch.test_signals:hang_from_the_second_step", "--save", str(save),
               "--save-interval", "1", "--out", str(tmp_path / "out"), "--no-progress-bar", "--no-tensorboard",
               "--no-plots"]
    if signum == signal.SIGINT:
        command += ["--ray-address", request.getfixturevalue("shared_ray_address")]
    driver = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(driver.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 400
        while not marker.exists():
            assert driver.poll() is None, f"the run ended before its reward hung:\n{''.join(output)[-4000:]}"
            assert time.monotonic() < deadline, f"the reward never hung:\n{''.join(output)[-4000:]}"
            time.sleep(0.5)
        running = process_running(driver.pid)
        servers = [pid for pid, cmdline in _children(running) if " serve " in cmdline]
        assert servers, f"no `stacx serve` child of the driver: {_children(running)}"
        servers = sorted({*servers, *map(process_running, servers)})  # a warm server's client and its process
        # The reaper of the cluster the driver started (none when attached): its token marks the cluster's processes.
        tokens = [cmdline.split()[-2] for pid, cmdline in _children(running) if "reaper.py" in cmdline]
        assert len(tokens) == (1 if signum == signal.SIGTERM else 0), _children(running)
        if tokens:  # Ray's own processes and the run's server carry the mark the reaper sweeps by
            from stacx.trainer.cluster.ray.reaper import processes_with_token

            marked = " ".join(_cmdline(pid) for pid in processes_with_token(tokens[0]))
            assert "raylet" in marked and "gcs_server" in marked and " serve " in marked, marked[:2000]
        staged = _shm_files_mapped_by([running, *servers])
        assert staged, "the first step's weight push did not go through a shared-memory staging file"
        sent = time.monotonic()
        driver.send_signal(signum)
        code = driver.wait(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    log = "".join(output)[-4000:]
    assert elapsed < 30, f"the driver took {elapsed:.0f} s to stop:\n{log}"
    assert code == 128 + signum, log
    assert f"stopped by {signal.Signals(signum).name}" in log
    assert f"resume with the same command plus --load {save}" in log and "step_000000001" in log
    server_deadline = time.monotonic() + 10  # the server's own exit may trail the driver's by a moment
    while any(_alive(pid) for pid in servers) and time.monotonic() < server_deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in servers), "the `stacx serve` child outlived the driver"
    if tokens:  # Ray's agents (ray::DashboardAgent, ray::RuntimeEnvAgent) lived on for 35 s to 4 minutes
        from stacx.trainer.cluster.ray.reaper import processes_with_token

        cluster_deadline = time.monotonic() + 20
        while processes_with_token(tokens[0]) and time.monotonic() < cluster_deadline:
            time.sleep(0.2)
        assert not processes_with_token(tokens[0]), "processes of the driver's local Ray cluster outlived it"
    leaked = {path for prefix in _shm_prefixes(staged) for path in glob.glob(prefix + "*")}
    assert not leaked, f"shared-memory files left behind: {sorted(leaked)}"
    assert not glob.glob(str(save / ".staging-*")), "a checkpoint staging folder was left behind"
    assert os.path.isdir(save / "step_000000001")  # the finished step's checkpoint is kept


def nan_reward(response: str, label, metadata: dict) -> float:
    return float("nan")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_rl_run_with_a_nan_reward_exits_non_zero_naming_step_role_and_metric(checkpoint, tmp_path, shared_ray_address,
                                                                              monkeypatch, capfd, warm_engine_servers):
    """Before: the NaN went into the advantages, the weights and the engine, and the run died a step
    later as 'server unavailable' (or exited 0 with NaN weights exported).

    `stacx train`'s own entry point (`stacx.launch.cli.main`) in this test process, attached to the shared
    cluster: the same driver, role workers and engine as the command, without a Python process to start."""
    from stacx.launch.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    export = tmp_path / "export"
    code = main(["train", "--algorithm", "grpo", "--hf-checkpoint", checkpoint, "--prompt-data", "builtin:addition",
                 "--rollout-engine", "cpu", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-max-response-len", "4", "--num-steps", "2", "--max-tokens-per-micro-batch", "64",
                 "--reward-fn", "tests.launch.test_signals:nan_reward", "--export-hf", str(export),
                 "--save", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--no-progress-bar",
                 "--no-tensorboard", "--ray-address", shared_ray_address])
    stderr = capfd.readouterr().err
    assert code == 1, stderr[-4000:]
    assert "stacx train: step 0: role 'policy' produced a non-finite reward of sample 0 (nan)" in stderr
    assert "Traceback" not in stderr[-2000:]
    assert not export.exists() and not (tmp_path / "ckpt").exists()
    import ray

    assert not ray.is_initialized()  # the driver detached: its job and actors are gone, the next test starts clean


RUN_MARK_ENV = "STACX_TEST_RUN_MARK"


def _marked(mark: str) -> list[int]:
    """Live processes whose environment carries RUN_MARK_ENV=mark (a launcher and all it started)."""
    needle = f"{RUN_MARK_ENV}={mark}".encode()
    found = []
    for environ in glob.glob("/proc/[0-9]*/environ"):
        pid = int(environ.split("/")[2])
        try:
            with open(environ, "rb") as handle:
                if needle in handle.read().split(b"\0") and _alive(pid):
                    found.append(pid)
        except OSError:
            continue
    return found


def _torchrun_grpo(launcher: list[str], checkpoint: str, tmp_path, reward: str, num_steps: int):
    """(process, its output lines, marker file, --save, the run's mark, the train flags) of a one-rank GRPO
    run under `launcher`, in its own session as from a terminal."""
    mark = os.urandom(6).hex()
    marker, save = tmp_path / "marker", tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({MARKER_ENV: str(marker), RUN_MARK_ENV: mark, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": REPO,
                "OMP_NUM_THREADS": "1"})
    flags = ["--algorithm", "grpo", "--hf-checkpoint", checkpoint, "--prompt-data", "builtin:addition",
             "--rollout-engine", "cpu", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
             "--rollout-max-response-len", "4", "--num-steps", str(num_steps), "--max-tokens-per-micro-batch", "64",
             "--lr", "1e-4", "--reward-fn", f"tests.launch.test_signals:{reward}", "--save", str(save),
             "--save-interval", "1", "--out", str(tmp_path / "out"), "--no-progress-bar", "--no-tensorboard",
             "--no-plots"]
    command = [*launcher, "--standalone", "--nproc-per-node", "1", "-m", "stacx.train", *flags]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(process.stdout), daemon=True).start()
    deadline = time.monotonic() + 400
    while not marker.exists():
        assert process.poll() is None, f"the run ended before its second step:\n{''.join(output)[-4000:]}"
        assert time.monotonic() < deadline, f"the second step never came:\n{''.join(output)[-4000:]}"
        time.sleep(0.5)
    return process, output, save, mark, flags


def _wait_gone(mark: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _marked(mark)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_under_stacx_torchrun_exits_130_with_rays_two_lines_and_the_save_folder_is_locked(checkpoint, tmp_path,
                                                                                              capfd):
    """Before: exit 1, a `shm_staging/release ... ConnectionError` line (the rank's `stacx serve` got the
    SIGINT torchrun sends to the rank's process group) and torchrun's 30-line SignalException traceback."""
    from stacx.launch.cli import main

    launcher = [sys.executable, "-m", "stacx", "torchrun"]
    process, output, save, mark, flags = _torchrun_grpo(launcher, checkpoint, tmp_path, "hang_from_the_second_step", 5)
    try:
        rank = next(pid for pid, cmdline in _children(process.pid) if "stacx.train" in cmdline)
        # A second run on the same --save is refused before it starts, naming the holder (rank 0).
        assert main(["train", *flags, "--load", str(save), "--dry-run"]) == 2  # a resume while it runs
        refused = capfd.readouterr().err
        assert f"--save {save} is in use by another run: pid {rank} on host" in refused, refused
        sent = len(output)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does (the rank has its own session)
        code = process.wait(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log = "".join(output)
    after = [line.rstrip("\n") for line in output[sent:] if line.strip()]
    assert code == 130, log[-4000:]
    assert after[-2:] == ["stacx train: stopped by SIGINT; the run's workers and servers were stopped",
                          f"stacx train: resume with the same command plus --load {save} (its newest complete "
                          f"checkpoint is {save / 'step_000000001'})"], log[-4000:]
    assert "Traceback" not in log and "ConnectionError" not in log and "SignalException" not in log, log[-4000:]
    assert not _wait_gone(mark, 10), "a rank or its server outlived the interrupted run"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sigkilled_torchrun_leaves_no_rank_or_server_writing_checkpoints(checkpoint, tmp_path):
    """Before: after `kill -9 -- -PGID` of torchrun its rank (own session) trained on and wrote step_2 ... step_60."""
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    process, output, save, mark, _ = _torchrun_grpo(launcher, checkpoint, tmp_path, "mark_the_second_step", 500)
    try:
        running = _marked(mark)
        assert any(" serve " in _cmdline(pid) for pid in running), [_cmdline(pid) for pid in running]
        before_kill = _steps_in(save)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        left = _wait_gone(mark, 45)
        assert not left, f"still running after the launcher's SIGKILL: {[_cmdline(pid) for pid in left]}"
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
    written = sorted(os.listdir(save))
    steps = _steps_in(save)
    assert steps and len(steps) < 500, written  # it was writing, and it stopped
    # At most the checkpoint being written at the kill completes: the rank stops at its death signal. (Before,
    # about one run in ten lost that signal in a fork handler and trained on for 30 s, a checkpoint a step.)
    assert len(steps) <= len(before_kill) + 1, (before_kill, steps)
    assert sorted(os.listdir(save)) == written  # nothing of the run is left to write more


def _steps_in(save) -> list[str]:
    return sorted(name for name in os.listdir(save) if name.startswith("step_"))


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
