"""Warm Python processes for the test suite: a zygote that imported torch, megatron-core, `transformers` and
Stacx once forks each process the suite would otherwise start cold (Ray excepted: `NEVER_PRELOADED`).

Almost all of an end-to-end test's CPU is process start-up: every `stacx train` driver, `stacx serve`,
Ray role worker and torchrun rank is a fresh interpreter importing the same 3-6 s of modules. Here one
process (the zygote) imports them once; a tiny stdlib-only client (`write_client`), given to the suite as
its Python executable, asks the zygote to fork a child that runs the client's command line, with the
client's arguments, environment, working folder and standard streams, and mirrors its exit status.

Semantics a caller relies on, kept:
- the exit status is the child's (a signal death is re-raised in the client, so `returncode == -9` holds);
- SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to the client reach the child;
- the child dies when its client dies (SIGKILL included: the child watches the client's pidfd), so
  killing the process the caller started ends the work, as it would for a cold process;
- inside the child `sys.executable` is the client again, so what it starts (`stacx serve` beside a
  driver, torchrun's ranks, a Ray cluster's workers) is warm too;
- the child is not below its client in the process tree (the zygote forked it): the zygote publishes each
  running client's child (`WarmPython.child_of`), so a test can follow a process tree through clients.

Anything the client does not recognise (an interpreter option other than -u/-B/-s/-W, a module or script
outside the allowed prefixes, a `sitecustomize` on the child's `PYTHONPATH`, no zygote) runs cold with
`os.execv` of the real interpreter: the fallback is always today's behaviour. The suite keeps cold
processes where process identity is what a test checks (signals, orphans, `ps`); see docs/testing.md.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
from typing import Sequence

from stacx.testing.warm_python_child import child_main
from stacx.testing.warm_python_client import recv_message, send_message

DEFAULT_PRELOAD = (
    "torch", "torch.distributed", "stacx.testing.megatron_preload", "transformers", "torch.distributed.run",
    "stacx.serving.server", "stacx.trainer.factory", "stacx.trainer.loop",
)
"""What a driver, a `stacx serve`, a role worker and a torchrun rank each import first, Ray excepted."""

NEVER_PRELOADED = ("ray",)
"""Ray's core library reads its process's environment when it loads (a worker's job id among it), so a
child forked after it loaded would carry the zygote's: Ray is imported by each child itself (about 0.3-1 s)."""

DEFAULT_WARM_MODULES = ("stacx", "tests", "torch.distributed.run")
"""`-m` targets run warm (the module or a submodule of it); other modules run cold."""

DEFAULT_WARM_SCRIPTS = ("ray/_private/workers/default_worker.py", "ray/_private/workers/setup_worker.py", "/bin/ray")
"""Scripts run warm (absolute path suffixes): Ray's Python worker and its runtime-env wrapper, and the `ray`
command (a node `ray start` brings up then starts its Python workers warm); `write_client` adds the folders
given as `warm_folders` (a test suite's own launcher scripts)."""


# ---------------------------------------------------------------------------------------------------------
# The zygote.


def serve(socket_path: str, client_path: str, preload: Sequence[str], owner_pid: int) -> None:
    """Import `preload`, then fork a child per client request until `owner_pid` ends."""
    import importlib

    for name in preload:
        importlib.import_module(name)
        loaded = [never for never in NEVER_PRELOADED if never in sys.modules]
        if loaded:
            raise RuntimeError(f"warm python: preloading {name} imported {loaded}, which must load in each child")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(64)
    os.rename(socket_path + ".tmp", socket_path)  # ready: a client never finds a socket nobody accepts on
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    owner = os.pidfd_open(owner_pid)
    children: dict[int, socket.socket] = {}
    departed: set[int] = set()  # children whose client has gone (killed; not yet reaped)
    published = children_folder(socket_path)
    os.makedirs(published, exist_ok=True)
    client_of: dict[int, int] = {}  # child pid -> its client's pid (the name of its file in `published`)
    while True:
        try:
            clients = [connection for pid, connection in children.items() if pid not in departed]
            readable, _, _ = select.select([listener, wake_read, owner, *clients], [], [])
        except InterruptedError:
            continue
        if owner in readable:
            break
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(children, departed, published, client_of)
        _kill_children_whose_client_left(children, departed, readable)
        if listener in readable:
            connection, _ = listener.accept()
            fds: list[int] = []
            try:
                request = recv_message(connection, fds)
            except (ConnectionError, ValueError, OSError):
                connection.close()
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                os.close(wake_read)
                os.close(wake_write)
                for other in children.values():
                    other.close()
                connection.close()
                child_main(request, fds, client_path)
            for fd in fds:
                os.close(fd)
            children[pid] = connection
            client_of[pid] = int(request.get("client_pid", 0))
            _publish(published, client_of[pid], pid)
            try:
                send_message(connection, {"pid": pid})
            except OSError:
                pass
            _reap(children, departed, published, client_of)
    for connection in children.values():
        connection.close()
    try:
        os.unlink(socket_path)
    except OSError:
        pass


def children_folder(socket_path: str) -> str:
    """Where the zygote publishes, for each client, the pid of the child that runs its command: a file named
    by the client's pid, holding the child's (`child_of`)."""
    return os.path.join(os.path.dirname(socket_path), "children")


def _publish(folder: str, client_pid: int, child_pid: int) -> None:
    if client_pid <= 0:
        return
    temporary = os.path.join(folder, f".{client_pid}.tmp")
    with open(temporary, "w") as handle:
        handle.write(str(child_pid))
    os.rename(temporary, os.path.join(folder, str(client_pid)))


def _unpublish(folder: str, client_pid: int) -> None:
    try:
        os.unlink(os.path.join(folder, str(client_pid)))
    except OSError:
        pass


def _kill_children_whose_client_left(children: dict[int, socket.socket], departed: set[int],
                                     readable: list) -> None:
    """A client sends nothing after its request: its connection turning readable means it ended (SIGKILL
    included). Its child's process group is killed from here, so a child that cannot act (stopped by SIGSTOP,
    or its watch thread starved) still dies with its client, as a cold process would have, being the client."""
    for pid, connection in children.items():
        if connection in readable and pid not in departed:
            departed.add(pid)
            for kill in (os.killpg, os.kill):  # its group; itself, if it has not made its group yet
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _reap(children: dict[int, socket.socket], departed: set[int], published: str, client_of: dict[int, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        departed.discard(pid)
        _unpublish(published, client_of.pop(pid, 0))
        if connection is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            send_message(connection, {"exit": code})
        except OSError:
            pass
        connection.close()


# ---------------------------------------------------------------------------------------------------------
# The client: a file the suite runs as its Python; it imports only the standard library.

CLIENT_TEMPLATE = '''#!{real_python} -IS
# Generated by stacx.testing.warm_python: runs this command line in a child of the warm zygote,
# or cold with the real interpreter when it cannot.
import os, sys
REAL_PYTHON = {real_python!r}
WARM_MODULES = {warm_modules!r}
WARM_SCRIPTS = {warm_scripts!r}
WARM_FOLDERS = {warm_folders!r}
SOCKET_PATH = {socket_path!r}
sys.path.insert(0, {stacx_testing!r})


def cold():
    os.execv(REAL_PYTHON, [REAL_PYTHON, *sys.argv[1:]])


def parse(argv):
    unbuffered, warnings = False, []
    index = 0
    while index < len(argv) and argv[index].startswith("-") and argv[index] not in ("-m", "-c", "-"):
        option = argv[index]
        if option == "-u":
            unbuffered = True
        elif option in ("-B", "-s"):
            pass
        elif option == "-W" and index + 1 < len(argv):
            index += 1
            warnings.append(argv[index])
        elif option.startswith("-W") and len(option) > 2:
            warnings.append(option[2:])
        else:
            return None
        index += 1
    if index + 1 >= len(argv) and argv[index:index + 1] in (["-m"], ["-c"]):
        return None
    if index >= len(argv):
        return None
    common = dict(unbuffered=unbuffered, warnings=warnings)
    if argv[index] == "-c":
        return dict(kind="code", target=argv[index + 1], args=argv[index + 2:], **common)
    if argv[index] == "-m":
        module = argv[index + 1]
        if not any(module == warm or module.startswith(warm + ".") for warm in WARM_MODULES):
            return None
        return dict(kind="module", target=module, args=argv[index + 2:], **common)
    script = argv[index]
    absolute = os.path.abspath(script)
    if script.startswith("-") or not (any(absolute.endswith(suffix) for suffix in WARM_SCRIPTS)
                                      or any(absolute.startswith(folder + os.sep) for folder in WARM_FOLDERS)):
        return None
    return dict(kind="script", target=script, args=argv[index + 1:], **common)


def has_user_site_hook(environ):
    for entry in environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.exists(os.path.join(entry, "usercustomize.py")):
            return True
    return False


def main():
    request = parse(sys.argv[1:])
    if request is None or has_user_site_hook(os.environ):
        cold()
    from warm_python_client import run
    env = dict(os.environ)
    if request["unbuffered"]:
        env["PYTHONUNBUFFERED"] = "1"
    request.update(argv=sys.argv[1:], env=env, cwd=os.getcwd(), client_pid=os.getpid())
    code = run(SOCKET_PATH, request)
    if code is None:
        cold()
    sys.exit(code)


main()
'''


def write_client(folder: str, socket_path: str, *, real_python: str | None = None,
                 warm_modules: Sequence[str] = DEFAULT_WARM_MODULES, warm_scripts: Sequence[str] = DEFAULT_WARM_SCRIPTS,
                 warm_folders: Sequence[str] = ()) -> str:
    """Write the client script into `folder` (executable; its shebang names the real interpreter)."""
    path = os.path.join(folder, "python")
    text = CLIENT_TEMPLATE.format(real_python=real_python or sys.executable, socket_path=socket_path,
                                  warm_modules=tuple(warm_modules),
                                  warm_scripts=tuple(warm_scripts),
                                  warm_folders=tuple(os.path.abspath(folder) for folder in warm_folders),
                                  stacx_testing=os.path.dirname(os.path.abspath(__file__)))
    with open(path, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o755)
    return path


class WarmPython:
    """A running zygote and its client (`start`)."""

    def __init__(self, process, client: str, socket_path: str):
        self.process = process
        self.client = client
        self.socket_path = socket_path

    def child_of(self, client_pid: int) -> int | None:
        """The pid of the child running the command of the client `client_pid` (None: not a running client)."""
        try:
            with open(os.path.join(children_folder(self.socket_path), str(client_pid))) as handle:
                return int(handle.read())
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


def start(folder: str, *, preload: Sequence[str] = DEFAULT_PRELOAD, warm_folders: Sequence[str] = (),
          timeout_s: float = 300.0) -> WarmPython:
    """Start a zygote owned by this process (it exits when this process does), write its client into
    `folder`, and wait (polling, at most `timeout_s`) until it accepts requests."""
    import subprocess
    import time

    socket_path = os.path.join(folder, "zygote.sock")
    client = write_client(folder, socket_path, warm_folders=warm_folders)
    # `-c`, not `-m`: this module's globals must not be `__main__`'s, which a child's `-m` target runs in.
    process = subprocess.Popen([sys.executable, "-c", "from stacx.testing.warm_python import main; main()",
                                "--socket", socket_path, "--client", client, "--owner-pid", str(os.getpid()),
                                "--preload", ",".join(preload)],
                               stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(socket_path):
        if process.poll() is not None:
            raise RuntimeError(f"the warm-python zygote exited with {process.returncode} before it was ready")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"the warm-python zygote was not ready after {timeout_s:.0f} s")
        time.sleep(0.05)
    return WarmPython(process, client, socket_path)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="the warm-python zygote (test support)")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--client", required=True)
    parser.add_argument("--owner-pid", type=int, required=True)
    parser.add_argument("--preload", default=",".join(DEFAULT_PRELOAD))
    args = parser.parse_args(argv)
    serve(args.socket, args.client, [name for name in args.preload.split(",") if name], args.owner_pid)


if __name__ == "__main__":
    main()
