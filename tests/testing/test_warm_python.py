"""The suite's warm Python (stacx/testing/warm_python.py): a child forked by the zygote behaves, for the
process that started the client, as a cold interpreter running the same command line would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from stacx.testing.warm_python import start, write_client

PROGRAM = '''
import os, sys, time
print("pid", os.getpid(), "cwd", os.getcwd(), "argv", sys.argv[1:], "env", os.environ.get("WARM_TEST"),
      "executable", sys.executable, "zygote_modules", "stacx.testing.warm_python_client" in sys.modules, flush=True)
mode = sys.argv[1]
if mode == "echo":
    print("read", sys.stdin.readline().strip(), flush=True)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "raise":
    raise ValueError("boom from the program")
elif mode == "sleep":
    time.sleep(120)
'''


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm")
    programs = tmp_path_factory.mktemp("programs")
    (programs / "program.py").write_text(PROGRAM)
    zygote = start(str(folder), preload=("json",), warm_folders=(str(programs),), timeout_s=60)
    yield zygote, str(programs / "program.py")
    zygote.stop()


def _run(client, *args, **kwargs):
    return subprocess.run([client, *args], capture_output=True, text=True, timeout=60, **kwargs)


def _fields(stdout: str) -> dict:
    words = stdout.splitlines()[0].split(" ", 1)[1]
    return dict(zip(["pid", "cwd", "argv", "env", "executable", "zygote_modules"],
                    [part.strip() for part in words.replace(" cwd ", "|").replace(" argv ", "|").replace(" env ", "|")
                     .replace(" executable ", "|").replace(" zygote_modules ", "|").split("|")]))


def test_a_warm_child_gets_the_clients_arguments_streams_environment_folder_and_exit_status(warm, tmp_path):
    zygote, program = warm
    completed = _run(zygote.client, program, "echo", input="hello\n", cwd=str(tmp_path),
                     env={**os.environ, "WARM_TEST": "7"})
    assert completed.returncode == 0, completed.stderr
    fields = _fields(completed.stdout)
    assert fields["cwd"] == str(tmp_path) and fields["argv"] == "['echo']" and fields["env"] == "7"
    assert fields["zygote_modules"] == "True"  # forked from the zygote, not a cold interpreter
    assert fields["executable"] == zygote.client  # what it starts goes through the client too
    assert "read hello" in completed.stdout
    assert _run(zygote.client, program, "exit", "7").returncode == 7


def test_code_and_warning_options_run_warm_as_the_interpreter_would_run_them(warm):
    zygote, _ = warm
    code = "import sys, warnings; print(sys.argv, 'stacx.testing.warm_python_client' in sys.modules); warnings.warn('w')"
    completed = _run(zygote.client, "-W", "error::UserWarning", "-c", code, "a", "b")
    assert "['-c', 'a', 'b'] True" in completed.stdout
    assert completed.returncode == 1 and "UserWarning: w" in completed.stderr


def test_an_uncaught_error_exits_1_with_a_traceback_that_starts_in_the_program(warm):
    zygote, program = warm
    completed = _run(zygote.client, program, "raise")
    assert completed.returncode == 1
    assert "ValueError: boom from the program" in completed.stderr
    assert "warm_python" not in completed.stderr and "runpy" not in completed.stderr, completed.stderr


def test_a_signal_to_the_client_reaches_the_child_and_its_death_is_the_clients(warm):
    zygote, program = warm
    process = subprocess.Popen([zygote.client, program, "sleep"], stdout=subprocess.PIPE, text=True)
    child_pid = int(process.stdout.readline().split()[1])
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
    _wait_gone(child_pid)


def test_a_sigkilled_client_takes_its_child_with_it(warm):
    zygote, program = warm
    process = subprocess.Popen([zygote.client, program, "sleep"], stdout=subprocess.PIPE, text=True)
    child_pid = int(process.stdout.readline().split()[1])
    assert child_pid != process.pid
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL
    _wait_gone(child_pid)


def test_the_zygote_publishes_each_running_clients_child(warm):
    """A test follows a process tree through a client (the child is the zygote's, not the client's)."""
    zygote, program = warm
    process = subprocess.Popen([zygote.client, program, "sleep"], stdout=subprocess.PIPE, text=True)
    child_pid = int(process.stdout.readline().split()[1])
    assert zygote.child_of(process.pid) == child_pid
    assert zygote.child_of(os.getpid()) is None  # not a client
    process.terminate()
    process.wait(timeout=30)
    deadline = time.monotonic() + 30  # unpublished once the zygote has reaped it
    while zygote.child_of(process.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert zygote.child_of(process.pid) is None


def test_a_stopped_child_dies_with_its_sigkilled_client(warm):
    """SIGSTOP leaves the child unable to act (its own watch cannot run): the zygote, seeing the client's
    connection close, kills the child's group, as a hung cold process dies when it is killed."""
    zygote, program = warm
    process = subprocess.Popen([zygote.client, program, "sleep"], stdout=subprocess.PIPE, text=True)
    child_pid = int(process.stdout.readline().split()[1])
    os.kill(child_pid, signal.SIGSTOP)
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL
    _wait_gone(child_pid)


def test_a_sitecustomize_on_pythonpath_runs_in_the_warm_child_before_the_program(warm, tmp_path):
    zygote, program = warm
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nprint('site hook sees', sys.orig_argv[1:3], flush=True)\n")
    completed = _run(zygote.client, program, "exit", "0", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    lines = completed.stdout.splitlines()
    assert lines[0] == f"site hook sees [{program!r}, 'exit']", completed.stdout  # first, with the child's argv
    assert "zygote_modules True" in lines[1]
    (tmp_path / "sitecustomize.py").write_text("raise RuntimeError('broken hook')\n")
    completed = _run(zygote.client, program, "exit", "5", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert completed.returncode == 5 and "Error in sitecustomize" in completed.stderr  # reported; the program ran


def test_what_the_client_does_not_run_warm_runs_cold(warm, tmp_path):
    zygote, program = warm
    # A module outside the warm prefixes, an interpreter option it does not know, a usercustomize on PYTHONPATH.
    assert _run(zygote.client, "-m", "platform").stdout.strip() == _run(sys.executable, "-m", "platform").stdout.strip()
    completed = _run(zygote.client, "-O", program, "exit", "3")
    assert completed.returncode == 3 and "zygote_modules False" in completed.stdout
    (tmp_path / "usercustomize.py").write_text("")
    completed = _run(zygote.client, program, "exit", "0", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert "zygote_modules False" in completed.stdout
    # No zygote at the socket: cold, not a failure.
    orphan = write_client(str(tmp_path), str(tmp_path / "no-zygote.sock"), warm_folders=(os.path.dirname(program),))
    completed = _run(orphan, program, "exit", "4")
    assert completed.returncode == 4 and "zygote_modules False" in completed.stdout


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                if handle.read().split(") ", 1)[1].startswith("Z"):
                    return  # exited, not yet reaped by the zygote
        except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
            return
        time.sleep(0.05)
    raise AssertionError(f"the warm child {pid} outlived its client")
