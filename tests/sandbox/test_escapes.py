"""Every escape attempt fails, on every backend (namespace, bubblewrap, and remote: a reference server
running the namespace backend; the rlimit attempts on the local two), under tight limits (conftest.TIGHT:
2 CPU seconds, 256 MB, 32 processes; SHORT: a 0.5 s wall time for the attempts that never end).

What each attempt would do if the sandbox let it is checked from the host side where it can be (a
file that must not exist, a listening socket that must not get a connection, a process that must not
be alive), not only from what the command reports.
"""

import os
import socket
import threading
import time
import uuid

from stacx.sandbox import SandboxLimits

from tests.sandbox.conftest import TIGHT, processes_with

SHORT = SandboxLimits(**{**TIGHT.to_dict(), "wall_time_s": 0.5})
"""For the attempts that run until the wall time kills them."""


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
