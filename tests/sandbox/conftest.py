import contextlib
import os
import threading
import time

import pytest
import uvicorn

from stacx.sandbox import SandboxConfig, SandboxLimits, build_sandbox
from stacx.sandbox.server import create_app

TIGHT = SandboxLimits(wall_time_s=10, cpu_time_s=2, memory_bytes=256 << 20, max_processes=32,
                      max_file_bytes=1 << 20, max_output_bytes=64 << 10, max_disk_bytes=8 << 20, max_inodes=500)
"""Each escape attempt's limits: tight, so the whole file stays fast. The wall time is a guard for attempts
that end on their own (it includes the sandbox's start-up, slow on a loaded machine); the attempts that run
until the wall time kills them use test_escapes.SHORT."""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app):
    """Serve the ASGI `app` on a free loopback port in this process; yields its URL once /health answers."""
    import requests
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "the sandbox server did not answer /health within 20 s"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def sandbox_server():
    """A reference sandbox server (namespace backend) in this process; yields its URL once /health answers."""
    app = create_app(build_sandbox(SandboxConfig(backend="namespace", max_concurrent_runs=4)), api_key="test-key")
    with serving(app) as url:
        yield url


@pytest.fixture(params=["namespace", "bubblewrap", "remote"])
def sandbox(request):
    """Every backend; 'remote' is the reference server running the namespace backend."""
    if request.param == "remote":
        url = request.getfixturevalue("sandbox_server")
        return build_sandbox(SandboxConfig(backend="remote", remote_url=url, remote_api_key="test-key", limits=TIGHT))
    return build_sandbox(SandboxConfig(backend=request.param, limits=TIGHT))


@pytest.fixture(params=["namespace", "bubblewrap"])
def local_sandbox(request):
    """The local backends only: for the kernel rlimits, which 'remote' forwards as it forwards every limit
    (the wall time and the output cap are checked through it)."""
    return build_sandbox(SandboxConfig(backend=request.param, limits=TIGHT))


@pytest.fixture
def repo(tmp_path):
    """A small working-copy source folder, inside a folder that also holds a host secret beside it."""
    source = tmp_path / "repo"
    source.mkdir()
    (source / "hello.py").write_text("print('hello from the repo')\n")
    (tmp_path / "host_secret.txt").write_text("HOST-SECRET-7f3a\n")
    return source


def processes_with(token: str) -> list[int]:
    """Host PIDs whose command line contains `token` (a process the sandbox left running)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.fixture(params=["namespace-tmpfs", "namespace-measured", "bubblewrap-tmpfs", "bubblewrap-measured"])
def bounded_sandbox(request, monkeypatch):
    """The local backends with each way a session's disk and inode bounds are kept: the kernel's (a bounded
    tmpfs, where the host may mount: root here and in CI) and the measured one (every other host; forced here
    by refusing the mount)."""
    backend, bound = request.param.split("-")
    if bound == "measured":
        monkeypatch.setattr("stacx.sandbox.local.SessionDisk.mount", lambda *args, **kwargs: None)
    sandbox = build_sandbox(SandboxConfig(backend=backend, limits=TIGHT))
    sandbox.bound = bound
    return sandbox
