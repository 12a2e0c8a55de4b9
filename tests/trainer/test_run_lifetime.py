"""A run never leaves a second writer: the --save lock names its holder, a process ends with the
process that started it (torchrun's ranks with the launcher, `stacx serve` with its driver), and a
local Ray cluster's processes end with a SIGKILLed driver (the reaper). Processes here are tiny Python
ones; the real launchers are checked in tests/launch/test_signals.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.launch.test_signals import _alive  # running and not a zombie, read from /proc

from stacx.trainer.cluster.ray.reaper import REAPER_TOKEN_ENV, processes_with_token, sweep
from stacx.trainer.save_lock import SaveFolderInUse, check_save_folder_free, hold_save_folder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wait_gone(pids, timeout_s: float) -> list[int]:
    """The pids still alive after polling up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


# ---- the --save lock ------------------------------------------------------------------------------

def test_a_second_run_on_a_held_save_folder_is_refused_naming_the_holders_pid_and_host(tmp_path):
    save = tmp_path / "ckpt"
    check_save_folder_free(save)  # no folder yet: free, and nothing written
    assert not save.exists()
    with hold_save_folder(save):
        with pytest.raises(SaveFolderInUse) as refused:
            check_save_folder_free(save)
        message = str(refused.value)
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
        assert f"--save {save}" in message and "choose another --save" in message
        with pytest.raises(SaveFolderInUse, match=f"pid {os.getpid()}"), hold_save_folder(save):
            pass
    check_save_folder_free(save)  # released with the run
    assert not save.exists()  # which saved nothing into the folder it created
    with hold_save_folder(save):  # and taken again by the next run
        (save / "step_000000001").mkdir()
    assert sorted(os.listdir(save)) == [".stacx-run.lock", "step_000000001"]


def test_the_lock_of_a_killed_holder_is_free(tmp_path):
    save = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from stacx.trainer.save_lock import "
                               "hold_save_folder\nwith hold_save_folder(sys.argv[1]):\n print('held', flush=True)\n"
                               " time.sleep(600)", str(save)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SaveFolderInUse, match=f"pid {holder.pid} on host"):
            check_save_folder_free(save)
    finally:
        holder.kill()
        holder.wait()
    check_save_folder_free(save)


def test_preflight_refuses_a_save_folder_another_run_holds(tmp_path, monkeypatch):
    from stacx.trainer.config.checks import PreflightError
    from stacx.trainer.config.run import RunConfig
    from stacx.trainer.preflight import check_resume_and_save

    monkeypatch.delenv("RANK", raising=False)
    save = tmp_path / "ckpt"
    config = RunConfig.from_dict({"save": str(save)})
    with hold_save_folder(save):
        with pytest.raises(PreflightError, match=f"--save {save} is in use by another run: pid {os.getpid()}"):
            check_resume_and_save(config)
        monkeypatch.setenv("RANK", "1")  # a torchrun rank other than 0: its own rank 0 holds the lock
        check_resume_and_save(config)


# ---- ending with the parent -----------------------------------------------------------------------

LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)  # as torch elastic does
print(rank.pid, flush=True)
time.sleep(600)
"""

RANK = """
import sys, time
from stacx.trainer.lifetime import end_with_launcher, set_parent_death_signal
import stacx.trainer.lifetime as lifetime
if {no_prctl}:
    lifetime.set_parent_death_signal = lambda signum=None: False
end_with_launcher()
print("armed", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("no_prctl", [False, True], ids=["death-signal", "watch-thread"])
def test_a_rank_in_its_own_session_ends_when_its_launcher_is_sigkilled(no_prctl):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK.format(no_prctl=no_prctl)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=REPO),
                                start_new_session=True)
    try:
        rank = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "armed"  # the rank inherited the launcher's stdout
        os.killpg(launcher.pid, signal.SIGKILL)  # `kill -9 -- -PGID`: the rank's own session is not in it
        launcher.wait()
        assert not _wait_gone([rank], 15), "the rank outlived its SIGKILLed launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


SERVER_STARTED_FROM_A_THREAD = """
import subprocess, sys, threading, time
child = []
code = "import os, time; from stacx.trainer.lifetime import end_with_parent; end_with_parent(os.getppid()); " \\
       "print('armed', flush=True); time.sleep(600)"
def start():  # as CpuServerProcess does: the starting thread waits for the server to be ready, then ends
    child.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True))
    assert child[0].stdout.readline().strip() == "armed"
starter = threading.Thread(target=start)
starter.start()
starter.join()  # the forking thread is gone; its process lives on
print(child[0].pid, flush=True)
time.sleep(600)
"""


def test_a_server_started_from_a_thread_lives_while_its_driver_does_and_ends_with_it():
    """The engine pool starts `stacx serve --parent-pid` in threads: the kernel's death signal (sent when the forking
    thread exits) killed those servers while their driver ran ("rollout engine ... not healthy after 60s")."""
    driver = subprocess.Popen([sys.executable, "-c", SERVER_STARTED_FROM_A_THREAD], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        server = int(driver.stdout.readline())
        time.sleep(1.0)  # a death signal would have arrived at once (the thread was already gone)
        assert _wait_gone([server], 0.1), "the server died when the thread that started it ended"
        driver.kill()
        driver.wait()
        assert not _wait_gone([server], 15), "the server outlived its SIGKILLed driver"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_the_parent_watch_signals_once_a_non_parent_process_is_gone():
    from stacx.trainer.lifetime import watch_parent

    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    got: list[int] = []
    done = threading.Event()

    def on_gone(signum):
        got.append(signum)
        if len(got) == 2:
            done.set()

    watch_parent(watched.pid, poll_s=0.05, grace_s=0.05, on_gone=on_gone)
    assert not done.wait(0.3) and got == []
    watched.kill()
    watched.wait()
    assert done.wait(10), got
    assert got == [signal.SIGTERM, signal.SIGKILL]
    with pytest.raises(ProcessLookupError):
        watch_parent(watched.pid)


# ---- the reaper of a local Ray cluster ----------------------------------------------------------

DRIVER = """
import subprocess, sys, time
from stacx.trainer.cluster.ray.reaper import ClusterReaper
reaper = ClusterReaper.start()
# Stand-ins for the cluster's GCS, raylet and agents, in their own sessions as Ray starts some of them.
cluster = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
           for _ in range(2)]
print(reaper.token, reaper.process.pid, *(p.pid for p in cluster), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_sigkilled_drivers_local_cluster_processes_are_reaped():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO))
    try:
        token, reaper, *cluster = driver.stdout.readline().split()
        cluster = [int(pid) for pid in cluster]
        deadline = time.monotonic() + 20  # a child just started may not show its environment yet: poll, bounded
        while sorted(processes_with_token(token, exclude=(int(reaper),))) != sorted(cluster):
            assert time.monotonic() < deadline, (processes_with_token(token, exclude=(int(reaper),)), cluster)
            time.sleep(0.05)
        driver.kill()
        driver.wait()
        assert not _wait_gone([*cluster, int(reaper)], 20), "the cluster's processes outlived the driver"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_a_normal_shutdowns_sweep_stops_only_rays_processes(tmp_path):
    token = "test-" + os.urandom(4).hex()
    env = dict(os.environ, **{REAPER_TOKEN_ENV: token})
    ray_dir = tmp_path / "ray"
    ray_dir.mkdir()
    (ray_dir / "agent.py").write_text("import time\ntime.sleep(600)\n")
    ray_like = subprocess.Popen([sys.executable, str(ray_dir / "agent.py")], env=env)
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
    try:
        deadline = time.monotonic() + 10
        while len(processes_with_token(token)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sweep(token, ray_only=True, kill_after_s=5) == [ray_like.pid]
        assert ray_like.wait(timeout=10) == -signal.SIGTERM
        assert server.poll() is None  # the driver stops its own servers
        assert sweep(token, kill_after_s=5) == [server.pid]
        assert server.wait(timeout=10) == -signal.SIGTERM
    finally:
        for process in (ray_like, server):
            if process.poll() is None:
                process.kill()
                process.wait()
