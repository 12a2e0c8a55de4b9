import os

import pytest
import torch

# Tests share two cores with their own spawned ranks; keep each process single-threaded.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


RAY_STARTING_FIXTURES = ("ray_address", "ray_cluster")
"""Fixtures that start a local Ray cluster: every test using them (directly or through another
fixture) must be marked `slow`, so that `pytest -m "not slow"` never starts Ray."""


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items
                if set(RAY_STARTING_FIXTURES) & set(getattr(item, "fixturenames", ())) and "slow" not in item.keywords]
    if unmarked:
        raise pytest.UsageError("tests that start Ray must be marked slow (@pytest.mark.slow or the module's "
                                "pytestmark): " + ", ".join(unmarked))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marked gpu); run on a GPU machine with: pytest -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _user_modules_stay_with_their_test():
    """User modules a test imports (`--custom-module`, plain imports that register) are shipped to
    every Ray worker the process starts later; keep one test's modules out of the next test's workers."""
    from stacx.objectives import discovery

    before = dict(discovery._USER_MODULE_SOURCES)
    yield
    discovery._USER_MODULE_SOURCES.clear()
    discovery._USER_MODULE_SOURCES.update(before)
