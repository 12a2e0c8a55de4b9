import os

import pytest
import torch

# Tests share two cores with their own spawned ranks; keep each process single-threaded.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marked gpu); run on a GPU machine with: pytest -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
