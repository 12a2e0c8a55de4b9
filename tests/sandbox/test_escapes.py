"""Every escape attempt fails, on every backend (namespace, bubblewrap, and remote: a reference server
running the namespace backend; the rlimit attempts on the local two; the session's disk and inode bounds
on the local two, each both kernel-bounded and measured), under tight limits (conftest.TIGHT: 2 CPU
seconds, 256 MB, 32 processes, 8 MiB and 500 files per session; SHORT: a 0.5 s wall time for the
attempts that never end).

What each attempt would do if the sandbox let it is checked from the host side where it can be (a
file that must not exist, a listening socket that must not get a connection, a process that must not
be alive), not only from what the command reports.
"""

import functools
import gzip
import io
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import uuid

import pytest

from stacx.sandbox import SandboxConfig, SandboxLimits, build_sandbox
from stacx.sandbox.disk import usage
from stacx.sandbox.server import create_app

from tests.sandbox.conftest import TIGHT, processes_with, serving

SHORT = SandboxLimits(**{**TIGHT.to_dict(), "wall_time_s": 0.5})
"""For the attempts that run until the wall time kills them."""
PATIENT = SandboxLimits(**{**TIGHT.to_dict(), "wall_time_s": 60})
"""For the attempts a measured bound must end: the wall time (a guard on a loaded machine) never comes first."""


def test_the_working_copy_is_fresh_private_and_writable(sandbox, repo):
    with sandbox.create(repo) as session:
        result = session.run("python3 hello.py && echo edited > hello.py && cat hello.py && pwd")
        assert result.ok, result
        assert result.stdout.splitlines() == ["hello from the repo", "edited", "/workspace"]
        assert session.run("cat hello.py").stdout == "edited\n"  # a session's runs share its copy
    assert (repo / "hello.py").read_text() == "print('hello from the repo')\n"  # the source is untouched
    with sandbox.create(repo) as fresh:
        assert fresh.run("cat hello.py").stdout == "print('hello from the repo')\n"


def test_reading_outside_the_working_copy_fails(sandbox, repo):
    secret = repo.parent / "host_secret.txt"
    with sandbox.create(repo) as session:
        result = session.run(f"cat {secret}; cat ../host_secret.txt; cat /etc/shadow; cat /proc/1/root{secret}; "
                             f"ls {repo.parent}; cat /etc/passwd")
    assert "HOST-SECRET" not in result.stdout + result.stderr
    assert "root:" not in result.stdout and "host_secret" not in result.stdout


def test_writing_outside_the_working_copy_fails(sandbox, repo):
    outside = repo.parent / "escaped.txt"
    with sandbox.create(repo) as session:
        result = session.run(f"echo x > {outside}; echo x > ../escaped.txt; touch /usr/escaped /escaped; "
                             "mount -o remount,rw /usr; umount /workspace; echo x > /proc/sys/kernel/pid_max; "
                             "unshare -Urm sh -c 'mount -o remount,rw /usr; touch /usr/escaped'; "
                             "unshare -Um sh -c 'umount -l /usr; touch /usr/escaped'; echo done")
    assert result.stdout.strip() == "done"
    assert not outside.exists() and not os.path.exists("/usr/escaped") and not os.path.exists("/escaped")
    assert not any(repo.parent.glob("escaped*")) and not any(repo.glob("../*/escaped*"))
    assert "Read-only file system" in result.stderr or "Permission denied" in result.stderr


def test_no_socket_reaches_anything(sandbox, repo):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    probe = ("import socket\n"
             "for address in [('127.0.0.1', %d), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
             "    try:\n"
             "        socket.create_connection(address, timeout=0.5); print('CONNECTED', address)\n"
             "    except OSError as err:\n"
             "        print('BLOCKED', address, err)\n" % port)
    with sandbox.create(repo) as session:
        result = session.run(["python3", "-c", probe])
    try:
        listener.accept()
        raise AssertionError("the sandbox reached a host socket")
    except BlockingIOError:
        pass
    finally:
        listener.close()
    assert "CONNECTED" not in result.stdout
    assert result.stdout.count("BLOCKED") == 3, result


def test_a_fork_bomb_is_bounded_and_leaves_nothing(local_sandbox, repo):
    token = f"bomb{uuid.uuid4().hex[:8]}"
    counter = ("import os, time\n"
               "n = 0\n"
               "try:\n"
               "    while n < 10000:\n"
               "        if os.fork() == 0:\n"
               "            time.sleep(30); os._exit(0)\n"
               "        n += 1\n"
               "except OSError:\n"
               "    pass\n"
               "print(n, flush=True)\n")
    with local_sandbox.create(repo) as session:
        counted = session.run(["python3", "-c", counter, token])
        started = time.monotonic()
        bomb = session.run(f"bomb() {{ bomb | bomb & }}; bomb; sleep 30 # {token}", SHORT)
        elapsed = time.monotonic() - started
    assert int(counted.stdout) < TIGHT.max_processes, counted
    assert elapsed < 10  # the wall time ended it, not the sleep
    assert bomb.exit_code != 0 or bomb.killed
    assert processes_with(token) == []


def test_a_memory_bomb_fails_inside_the_sandbox(local_sandbox, repo):
    with local_sandbox.create(repo) as session:
        result = session.run(["python3", "-c", "x = bytearray(1 << 30); print('ALLOCATED')"])
    assert "ALLOCATED" not in result.stdout
    assert "MemoryError" in result.stderr and result.exit_code == 1, result


def test_an_infinite_loop_is_killed_at_the_wall_time(sandbox, repo):
    with sandbox.create(repo) as session:
        started = time.monotonic()
        result = session.run("while :; do :; done", SHORT)
    assert result.timed_out and result.killed and result.exit_code is None
    assert time.monotonic() - started < 10


def test_a_gigabyte_of_output_is_cut_at_the_cap(sandbox, repo):
    with sandbox.create(repo) as session:
        started = time.monotonic()
        result = session.run("head -c 1000000000 /dev/zero | tr '\\0' x")
    assert result.output_truncated and result.killed
    assert len(result.stdout) == TIGHT.max_output_bytes
    assert time.monotonic() - started < 5


def test_a_file_past_the_size_limit_is_refused(local_sandbox, repo):
    with local_sandbox.create(repo) as session:
        result = session.run("head -c 3000000 /dev/zero > big; wc -c < big")
    assert int(result.stdout) <= TIGHT.max_file_bytes


def test_a_child_left_running_is_killed_with_its_command(sandbox, repo):
    token = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 10**6}"
    with sandbox.create(repo) as session:
        result = session.run(f"(setsid sleep 100{token} &) ; nohup sleep 200{token} > /dev/null 2>&1 & echo started")
        assert result.stdout.strip() == "started"
        assert processes_with(token) == []
        # A command still running when the session closes is killed with its tree.
        box = {}
        runner = threading.Thread(target=lambda: box.update(result=session.run(f"sleep 300{token}")))
        runner.start()
        deadline = time.monotonic() + 60  # a poll with a bound: entering a namespace can take seconds under load
        while not processes_with(f"300{token}") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert processes_with(f"300{token}"), "the command did not start"
        session.close()
        runner.join(timeout=30)
    assert not runner.is_alive() and box["result"].exit_code != 0
    assert processes_with(token) == []


def test_proc_1_shows_no_host_environment_and_no_host_path(sandbox, repo, monkeypatch):
    # bwrap's own init is the sandbox's PID 1: it kept the launcher's environment (the trainer's tokens) and
    # its argv (the venv's and the working copy's host paths).
    monkeypatch.setenv("STACX_TEST_HOST_TOKEN", "HOST-TOKEN-93e1")
    with sandbox.create(repo) as session:
        result = session.run("for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ; tr '\\0' ' ' < $p/cmdline; "
                             "echo; done; env")
    seen = result.stdout + result.stderr
    assert result.ok and "PATH=" in seen and "sh -c" in seen, result  # it did read them
    assert "HOST-TOKEN" not in seen
    host_paths = [str(repo.parent), "stacx-sandbox-", "stacx-bwrap-", "site-packages", os.getcwd()]
    assert not [path for path in host_paths if path in seen], seen


def test_dev_shm_is_bounded(local_sandbox, repo):
    with local_sandbox.create(repo) as session:
        result = session.run("for i in $(seq 1 40); do head -c 1000000 /dev/zero > /dev/shm/f$i || break; done; "
                             "cat /dev/shm/f* 2>/dev/null | wc -c")
    assert int(result.stdout) <= TIGHT.max_disk_bytes, result  # bwrap's unbounded /dev took all 40 MB


def test_writing_past_the_session_disk_cap_fails(bounded_sandbox, repo):
    with bounded_sandbox.create(repo) as session:
        result = session.run("for i in $(seq 1 12); do head -c 1000000 /dev/zero > f$i || exit 7; done; "
                             "echo WROTE; sleep 30", PATIENT)
        used, _ = usage(session.directory)
    assert not result.ok, result
    if bounded_sandbox.bound == "tmpfs":  # the kernel refuses the write itself
        assert result.exit_code == 7 and "WROTE" not in result.stdout, result
        assert "No space left on device" in result.stderr, result
        assert used <= TIGHT.max_disk_bytes
    else:  # measured: the command is ended once a walk sees the bound passed (the writes themselves may succeed)
        assert result.killed and "SandboxLimits.max_disk_bytes = 8388608" in result.stderr, result
        assert result.duration_s < 30  # ended while it ran, not at its end


def test_creating_past_the_session_inode_cap_fails(bounded_sandbox, repo):
    creator = ("import os, time\n"
               "n = 0\n"
               "try:\n"
               "    for n in range(800):\n"
               "        open(f'f{n}', 'w').close()\n"
               "    print('CREATED', flush=True)\n"
               "except OSError as err:\n"
               "    print('REFUSED', n, err, flush=True); raise SystemExit(7)\n"
               "time.sleep(30)\n")
    with bounded_sandbox.create(repo) as session:
        result = session.run(["python3", "-c", creator], PATIENT)
    assert not result.ok, result
    if bounded_sandbox.bound == "tmpfs":
        assert result.exit_code == 7 and "No space left on device" in result.stdout, result
        assert int(result.stdout.split()[1]) + len(list(repo.iterdir())) <= TIGHT.max_inodes
    else:
        assert result.killed and "SandboxLimits.max_inodes = 500" in result.stderr, result
        assert result.duration_s < 30


def _gzip_tar_bomb(member_bytes: int) -> bytes:
    """A .tar.gz of one member of `member_bytes` zeros, about member_bytes / 1000 bytes: gzip members of a
    compressed MiB of zeros, concatenated (a valid gzip stream)."""
    header = tarfile.TarInfo("bomb.bin")
    header.size = member_bytes
    mib = gzip.compress(bytes(1 << 20), compresslevel=9)
    assert member_bytes % (1 << 20) == 0
    return gzip.compress(header.tobuf()) + mib * (member_bytes >> 20) + gzip.compress(bytes(1024))


def test_a_tar_bomb_is_refused_before_it_is_unpacked(sandbox):
    bomb = _gzip_tar_bomb(1025 << 20)  # past the default 1 GiB too (the remote server's bound)
    assert len(bomb) < 2 << 20
    started = time.monotonic()
    refusal = r"holds at least \d+ bytes, over SandboxLimits.max_disk_bytes = \d+ \(refused before unpacking\)"
    with pytest.raises(ValueError, match=refusal):
        sandbox.create(bomb)
    assert time.monotonic() - started < 10  # refused at the header: 1 GiB was never inflated


@functools.lru_cache(maxsize=None)
def _many_members(count: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for n in range(count):
            archive.addfile(tarfile.TarInfo(f"f{n}"), io.BytesIO(b""))
    return buffer.getvalue()


def test_a_snapshot_with_too_many_members_is_refused_and_nothing_is_written(local_sandbox, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    sandbox = build_sandbox(SandboxConfig(backend=local_sandbox.name, limits=TIGHT, scratch_dir=str(scratch)))
    with pytest.raises(ValueError, match="holds more than 500 members, over SandboxLimits.max_inodes = 500"):
        sandbox.create(_many_members(TIGHT.max_inodes + 100))
    assert list(scratch.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the launcher drops to uid 65534 only when the host runs as root")
def test_bubblewrap_runs_as_root_from_a_private_0700_folder(tmp_path, repo, monkeypatch):
    # A project (and its venv's bwrap and bundled libcap) under a 0700 folder such as /root: uid 65534, which
    # the launcher runs as, cannot reach them.
    from stacx.sandbox.bubblewrap import find_bwrap
    private = tmp_path / "private"
    real = os.path.realpath(find_bwrap())
    listing = subprocess.run(["ldd", real], capture_output=True, text=True, check=True).stdout
    libraries = [os.path.realpath(line.split("=>")[1].split(" (")[0].strip()) for line in listing.splitlines()
                 if "=> /" in line]
    files = [real] + [lib for lib in libraries if not lib.startswith(("/usr/", "/lib"))]
    base = os.path.commonpath([os.path.dirname(path) for path in files])
    for path in files:
        target = private / "venv" / os.path.relpath(path, base)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    private.chmod(0o700)
    copied = str(private / "venv" / os.path.relpath(real, base))
    monkeypatch.setattr("stacx.sandbox.bubblewrap.find_bwrap", lambda: copied)
    sandbox = build_sandbox(SandboxConfig(backend="bubblewrap", limits=TIGHT))
    assert not sandbox.bwrap.startswith(str(private))  # it runs a copy the sandbox user can reach
    with sandbox.create(repo) as session:
        result = session.run("python3 hello.py; id -u")
    assert result.ok and result.stdout.split("\n")[:2] == ["hello from the repo", "65534"], result


def test_a_chunked_upload_is_refused_once_past_the_limit_without_being_read_whole():
    import requests
    app = create_app(build_sandbox(SandboxConfig(backend="namespace", limits=TIGHT)), api_key="k",
                     max_upload_bytes=4 << 20)
    sent = []

    def three_hundred_mb():  # no Content-Length: requests sends a generator chunked
        for _ in range(300):
            sent.append(1 << 20)
            yield bytes(1 << 20)

    with serving(app) as url:
        try:
            answer = requests.post(f"{url}/sessions", data=three_hundred_mb(), timeout=60,
                                   headers={"Authorization": "Bearer k"})
            assert answer.status_code == 413 and "4194304-byte limit" in answer.text, answer.text
        except requests.ConnectionError:
            pass  # the server answered 413 and closed the connection while the client was still sending
        declared = requests.post(f"{url}/sessions", data=bytes(5 << 20), headers={"Authorization": "Bearer k"},
                                 timeout=60)
        assert declared.status_code == 413
    # The server stopped reading at the limit: the client could push only that and the sockets' buffers.
    assert sum(sent) < 64 << 20, sum(sent)
