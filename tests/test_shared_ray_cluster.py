"""The tests' shared Ray cluster (`tests/shared_ray_cluster.py`) keeps no idle Python workers: its raylet
starts with worker prestart off, so no `ray::IDLE` process ticks through the whole pytest run for the
holder's job, which never runs anything (docs/testing.md, session 12)."""

from __future__ import annotations

import os

import pytest

from tests.shared_ray_cluster import NO_IDLE_WORKERS_ENV

pytestmark = pytest.mark.slow


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:  # ended while listed
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found[1:]


def _read(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as source:
            return source.read()
    except OSError:
        return b""


def test_the_shared_clusters_raylet_prestarts_no_workers_and_none_sits_idle(shared_ray_cluster):
    processes = {pid: _read(pid, "cmdline") for pid in _descendants(shared_ray_cluster.holder_pid)}
    raylets = [pid for pid, cmdline in processes.items() if b"/raylet/raylet" in cmdline.split(b"\0")[0]]
    assert len(raylets) == 1, processes
    raylet_env = dict(entry.split(b"=", 1) for entry in _read(raylets[0], "environ").split(b"\0") if b"=" in entry)
    for name, value in NO_IDLE_WORKERS_ENV.items():
        assert raylet_env.get(name.encode()) == value.encode(), name
    idle = [pid for pid, cmdline in processes.items() if cmdline.startswith(b"ray::IDLE")]
    assert idle == [], f"idle Ray workers under the shared cluster's holder: {idle}"
