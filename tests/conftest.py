import os
import sys

import pytest
import torch

# Tests share two cores with their own spawned ranks; keep each process single-threaded.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray turns token authentication on for every local cluster it starts, by setting RAY_AUTH_MODE=token
# in the starting process; a process reads the switch once (Ray caches its config), so a test process
# that attaches to a cluster another process started (`shared_ray_address`) must have it from the start.
os.environ.setdefault("RAY_AUTH_MODE", "token")

from stacx.launch.workloads import discover_workloads  # noqa: E402 (after the environment above)

# The catalog as `stacx train` sees it (the workloads' recipes included), in every test process and
# before collection: tests parametrized over the recipes collect the same list on every xdist worker.
discover_workloads()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY_STARTING_FIXTURES = ("shared_ray_cluster", "shared_ray_address", "ray_address")
"""Fixtures that start a local Ray cluster: every test using them (directly or through another
fixture) must be marked `slow`, so that `pytest -m "not slow"` never starts Ray."""


FIRST_FILES = (
    "tests/launch/test_demo_end_to_end.py",
    "tests/launch/test_fault_tolerance.py",
    "tests/trainer/test_restarts_end_to_end.py",
    "tests/launch/test_newcomer_path.py",
    "tests/trainer/cluster/test_ray_multinode.py",
    "tests/launch/test_design_doc_examples.py",
    "tests/trainer/test_training_loop.py",
    "tests/launch/test_signals.py",
    "tests/serving/test_openai_endpoint.py",
    "tests/tasks/swe/test_reward_hacks.py",
    "tests/serving/test_openai_sessions.py",
)
"""Files started before all others, longest first (measured with --durations: the demo is the longest,
about 195 s on a quiet machine, then the chaos run, the two restart launches and the newcomer's hour,
about 140-200 s each, then the two-node cluster, about 110 s): a long file that starts last
runs alone while the other pytest worker has nothing left to do. The OpenAI endpoint's file also teaches
the policy that `tests/serving/test_anthropic_endpoint.py` serves (`taught_policy`, once per run): started
early, it has taught it before the Anthropic file, one of the short ones, waits for it."""


def _order_files(items) -> None:
    """Test files in the order the pytest workers take them (longest-first, so the end of the run is
    filled by short files): FIRST_FILES in their order, then every other file with a slow test, then the
    rest, most tests first. Used with `--no-loadscope-reorder`; the tests of one file stay together and
    in their own order."""
    counts: dict[str, int] = {}
    slow_files: set[str] = set()
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        counts[path] = counts.get(path, 0) + 1
        if "slow" in item.keywords:
            slow_files.add(path)
    first_seen = {path: index for index, path in enumerate(counts)}
    first_rank = {path: index for index, path in enumerate(FIRST_FILES)}

    def key(item):
        path = item.nodeid.split("::", 1)[0]
        return (first_rank.get(path, len(FIRST_FILES)), path not in slow_files, -counts[path], first_seen[path])

    items.sort(key=key)


def _deselect_vllm_tier(config, items):
    """The `vllm` tier runs against a real vLLM server from its own environment (`make test-vllm`); a run
    whose -m expression does not name it leaves it out."""
    if "vllm" in (config.getoption("markexpr", "") or ""):
        return
    tier = [item for item in items if item.get_closest_marker("vllm") is not None]
    if tier:
        config.hook.pytest_deselected(items=tier)
        items[:] = [item for item in items if item.get_closest_marker("vllm") is None]


def pytest_collection_modifyitems(config, items):
    _deselect_vllm_tier(config, items)
    _order_files(items)
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


def _kernel_registries():
    from stacx.objectives import registry

    return [value for value in vars(registry).values() if isinstance(value, registry.Registry)]


@pytest.fixture(autouse=True)
def _user_modules_stay_with_their_test():
    """User modules a test imports (`--custom-module`, plain imports that register) are shipped to
    every Ray worker the process starts later; keep one test's modules out of the next test's workers.

    A user kernel that replaced a built-in name in this process (the guide's `vanilla_pg` loaded by the
    documented commands' test) gives the name back to the built-in after the test, and its module
    leaves `sys.modules` when nothing else of it stays registered, so that a later load registers it
    again; other user kernels stay registered, as their modules stay imported."""
    from stacx.plugins import discovery

    before = dict(discovery._USER_MODULE_SOURCES)
    replaced_before = {id(registry): set(registry._replaced_builtins) for registry in _kernel_registries()}
    yield
    discovery._USER_MODULE_SOURCES.clear()
    discovery._USER_MODULE_SOURCES.update(before)
    restored_modules = set()
    for registry in _kernel_registries():
        for name in set(registry._replaced_builtins) - replaced_before.get(id(registry), set()):
            restored_modules.add(getattr(registry[name], "__module__", None))
            registry.unregister(name)  # the replaced built-in gets its name back
    still_registered = {getattr(entry, "__module__", None)
                        for registry in _kernel_registries() for entry in registry.values()}
    for module in restored_modules - still_registered - {None}:
        sys.modules.pop(module, None)


@pytest.fixture
def warm_engine_servers(monkeypatch):
    """Engines started by a driver that runs in the pytest process start warm (tests/warm.py)."""
    from tests.warm import warm_servers_of_in_process_drivers

    warm_servers_of_in_process_drivers(monkeypatch)


@pytest.fixture(scope="session")
def shared_ray_cluster():
    """One loopback Ray cluster (4 CPUs, 300 MB object store) for this pytest process, held by its own
    process (`tests/shared_ray_cluster.py`); each xdist worker has its own, so a test never shares it
    with a test running beside it. Tests take its address through `shared_ray_address`."""
    from tests.shared_ray_cluster import SharedRayCluster

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cluster = SharedRayCluster.start(num_cpus=4, object_store_mb=300, env=env, cwd=REPO)
    mismatched = {name: value for name, value in cluster.attach_env.items() if os.environ.get(name) != value}
    if mismatched:
        cluster.close()
        raise RuntimeError(f"the shared Ray cluster needs {mismatched} to attach, which this test process "
                           "lacks (set at conftest import, before Ray reads it)")
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def shared_ray_address(shared_ray_cluster):
    """The address of this pytest process's shared cluster (`shared_ray_cluster`).

    End-to-end runs that do not test cluster start-up attach to it (`--ray-address`), instead of
    paying a cluster start and stop each; a run's job ends when its driver detaches, and Ray then
    kills that job's actors, so every test starts from an empty cluster."""
    return shared_ray_cluster.address


@pytest.fixture(scope="module")
def ray_address(shared_ray_address):
    """This test process attached to the shared cluster as a Ray driver for one test module; detaching
    at the module's end ends its job, which kills the actors the module left."""
    from stacx.trainer.cluster.ray.connect import connect_ray

    connection = connect_ray(shared_ray_address, log_to_driver=False)
    yield shared_ray_address
    connection.shutdown()
