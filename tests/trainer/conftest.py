"""Fixtures shared by the training-loop tests (one module-scoped local Ray cluster per test file)."""

import pytest

from tests.trainer.training_fixtures import write_tiny_run_files

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def ray_address():
    """A small local Ray cluster (4 CPUs, 200 MB object store) for one test module."""
    import ray

    from stacx.trainer.cluster.ray.connect import connect_ray

    connection = connect_ray(num_cpus=4, object_store_memory_bytes=200 * MIB, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    connection.shutdown()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny policy/teacher checkpoints and prompt files (modules may override with richer ones)."""
    return write_tiny_run_files(str(tmp_path_factory.mktemp("run_files")))


@pytest.fixture(scope="module")
def engine_world():
    """This (driver) process as a one-rank world, so it can host CPU engines for the tests."""
    from stacx.parallel.groups import destroy_parallel_layout
    from stacx.rollout.engines.cpu import ensure_single_process_layout

    yield ensure_single_process_layout()
    destroy_parallel_layout()
