"""The one home of the engine and server fixtures: tiny checkpoints, this process as a one-rank world, the
CPU engine, `stacx serve`'s server around a policy, and the taught tool-calling policy.

tests/serving/conftest.py and tests/rollout/conftest.py hand these fixtures to their tests; another test
module imports the fixtures it uses by name (`from tests.serving.fixtures import single_process_world`).
"""

import contextlib
import os

import pytest


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """Two tiny llama checkpoints (different seeds) with a character tokenizer whose vocab fits."""
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.rollout.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    paths = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"tiny{seed}")
        save_tiny_hf_checkpoint(path, "llama", seed=seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def single_process_world():
    """A one-rank gloo world with megatron's trivial layout, torn down after the module."""
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.serving.cpu_engine import ensure_single_process_layout

    groups = ensure_single_process_layout()
    yield groups
    destroy_parallel_layout()


@pytest.fixture(scope="module")
def cpu_engine(tiny_checkpoints, single_process_world):
    """The CPU engine serving the first tiny checkpoint (one per test module)."""
    from stacx.serving.cpu_engine import CpuEngine

    return CpuEngine.from_hf_checkpoint(tiny_checkpoints[0])


def second_checkpoint_buckets(tiny_checkpoints, world, *, bucket_bytes: int) -> list[list]:
    """The second tiny checkpoint's weights as buckets of Hugging Face names (a weight update)."""
    from stacx.models import build_model, iter_hf_weight_buckets, load_hf_checkpoint

    source = build_model(tiny_checkpoints[1], world)
    load_hf_checkpoint(source, tiny_checkpoints[1], world)
    return [list(b) for b in iter_hf_weight_buckets(source, world, bucket_bytes=bucket_bytes)]


def _run_temp_folder(tmp_path_factory):
    """A folder every pytest worker of this run sees (xdist gives each worker a folder under the run's own),
    and no other run: the run's temporary folder, or this process's when it runs alone."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def taught_policy(tmp_path_factory):
    """(checkpoint path, tokenizer) of the taught tool-calling policy (`tests/serving/taught_policy.py`):
    taught once per pytest run, whichever worker asks first; the others wait for it and reuse it."""
    from tests.rollout.agents.agent_fixtures import tool_tokenizer
    from tests.serving.taught_policy import taught_checkpoint

    return taught_checkpoint(_run_temp_folder(tmp_path_factory)), tool_tokenizer()


@contextlib.contextmanager
def served_policy(path: str, tokenizer):
    """`stacx serve`'s server (the CPU engine) around the checkpoint at `path`, started and stopped around the block."""
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.serving.server import EngineHttpServer

    with EngineHttpServer(CpuEngine.from_hf_checkpoint(path), model_path=path, tokenizer=tokenizer) as running:
        yield running


@pytest.fixture(scope="module")
def taught_server(taught_policy, single_process_world):
    """`stacx serve`'s server around the taught policy, one per test module: a module's tests share its
    sessions' store, so each uses its own session ids."""
    with served_policy(*taught_policy) as running:
        yield running
