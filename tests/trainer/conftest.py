"""Fixtures shared by the training-loop tests (`ray_address`, the shared Ray cluster, is in tests/conftest.py)."""

import pytest

from tests.trainer.training_fixtures import ATTACHED_SERVER_KEY, write_tiny_run_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny policy/teacher checkpoints and prompt files (modules may override with richer ones)."""
    return write_tiny_run_files(str(tmp_path_factory.mktemp("run_files")))


@pytest.fixture
def attached_server_key(monkeypatch):
    """The key of the servers a test attaches its run to, given to the driver as STACX_API_KEY."""
    monkeypatch.setenv("STACX_API_KEY", ATTACHED_SERVER_KEY)
    return ATTACHED_SERVER_KEY


@pytest.fixture(scope="module")
def engine_world():
    """This (driver) process as a one-rank world, so it can host CPU engines for the tests."""
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.serving.cpu_engine import ensure_single_process_layout

    yield ensure_single_process_layout()
    destroy_parallel_layout()
