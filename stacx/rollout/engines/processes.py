"""Server processes a run starts (`stacx serve`, SGLang): stopping one without leaving it behind."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen, *, timeout_s: float) -> None:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL and reap it; nothing when it has already exited."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)
