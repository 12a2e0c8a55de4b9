"""Fixtures shared by the training-loop tests (`ray_address`, the shared Ray cluster, is in tests/conftest.py;
`single_process_world` comes from the engine fixtures' one home, tests/serving/fixtures.py)."""

import pytest

from tests.serving.fixtures import single_process_world  # noqa: F401  (a fixture, found by name: this process as a one-rank world hosting CPU engines)
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
