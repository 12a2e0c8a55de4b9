"""Ray role workers on a local CPU cluster: TP collectives, colocation, exchange syncs, failures.

The shared test Ray cluster (4 CPUs, `ray_address`) and one role graph are used by the module: a 2-rank TP=2
`policy` and a 2-rank DP=2 `reference` colocated on one pool, with an exchange sync
policy -> reference. The failure test starts its own small role so that killing a worker
does not disturb the shared graph; that role is also the one a two-file `stacx/custom/` folder is shipped to
(one role's start-up, not two: each costs a Ray actor per rank).
"""

from __future__ import annotations

import os
import time
from functools import partial

import pytest
import torch

from stacx.specializations.base import Specialization
from stacx.trainer.config.recipe import ExchangeSync, ModelRole, TrainingConfig
from stacx.trainer.cluster.ray.graph import WorkerLayout, create_role_workers
from stacx.trainer.cluster.ray import (
    PlacedPool,
    ResourcePool,
    RolePlacement,
    RoleWorker,
    RoleWorkerDied,
    RoleWorkerRaised,
    RoleWorkers,
    RoleWorkerTimeout,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(400)]


def _exchange_recipe() -> TrainingConfig:
    return TrainingConfig(
        name="exchange_test",
        description="policy trains on a dataset; its weights are exchanged to a colocated reference",
        data_source="dataset",
        roles=(
            ModelRole(name="policy", specialization_cls=Specialization, tensor_model_parallel_size=2),
            ModelRole(name="reference", specialization_cls=Specialization, trainable=False,
                      shares_pool_with="policy"),
        ),
        syncs=(ExchangeSync(source_role="policy", target_role="reference", keys=("weights",), bucket_size_mb=1),),
    )


@pytest.fixture(scope="module")
def role_graph(ray_address):
    # The pool has tp * dp = 2 bundles; the colocated reference (tp=1) fills them with dp=2.
    graph = create_role_workers(
        _exchange_recipe(),
        WorkerLayout(data_parallel_size=1, num_cpus_per_rank=1.0, collective_timeout_s=60.0, call_timeout_s=120.0),
    )
    yield graph
    graph.shutdown()


# ---- functions shipped to workers (module level: Ray pickles them) ----------------------

def tp_all_reduce(worker):
    """Each rank contributes (rank + 1) * [1, 2, 3]; the TP all-reduce sums them."""
    import torch.distributed as dist

    contribution = (worker.rank + 1) * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    dist.all_reduce(contribution, group=worker.groups.tp)
    return {"sum": contribution.tolist(), "tp_rank": worker.groups.tp_rank, "tp_size": worker.groups.tp_size}


def payload(rank: int) -> dict[str, torch.Tensor]:
    """Tensors whose bits must survive the trip: bf16 NaN payloads, -0.0, int extremes, bool, empty,
    a 0-dim scalar, a non-contiguous view, and one tensor larger than a 1 MiB bucket."""
    generator = torch.Generator().manual_seed(100 + rank)
    odd_bf16 = torch.tensor([0x7FC1, -1, -0x8000, 0x0001], dtype=torch.int16)  # NaN payloads, -0.0, tiny.view(torch.bfloat16)
    return {
        "embedding.weight": torch.randn(64, 48, generator=generator).to(torch.bfloat16),
        "odd_bits": odd_bf16,
        "layer.bias": torch.tensor([-0.0, float("inf"), float("-inf"), 1e-45]),
        "counts": torch.tensor([torch.iinfo(torch.int64).min, -1, torch.iinfo(torch.int64).max]),
        "mask": torch.rand(17, generator=generator) > 0.5,
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.25 + rank, dtype=torch.float64),
        "transposed": torch.randn(5, 7, generator=generator).t(),
        "large": torch.randn(300_000, generator=generator),  # 1.2 MB > the 1 MiB bucket
    }


def produce_payload(worker):
    return payload(worker.rank)


def keep_received(worker, tensors):
    worker.state["received"] = tensors
    return {name: tensor.clone() for name, tensor in tensors.items()}


def raise_on_rank_one(worker):
    if worker.rank == 1:
        raise ValueError("deliberate failure on rank one")
    return worker.rank


def exit_on_rank_one_during_all_reduce(worker):
    """Rank 1 dies while rank 0 waits for it inside an all-reduce."""
    import torch.distributed as dist

    if worker.rank == 1:
        time.sleep(0.5)
        os._exit(7)
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


def sleep_then_return(worker, seconds: float):
    time.sleep(seconds)
    return worker.rank


# ---- tests --------------------------------------------------------------------------------

def test_tp2_role_runs_all_reduce_and_returns_per_rank_values(role_graph):
    policy = role_graph.workers["policy"]
    results = policy.execute_all(tp_all_reduce)
    expected = sum((rank + 1) * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) for rank in range(2)).tolist()
    assert [r["sum"] for r in results] == [expected, expected]
    assert [r["tp_rank"] for r in results] == [0, 1]
    assert {r["tp_size"] for r in results} == {2}
    assert policy.execute_rank0(RoleWorker.ping) == ("policy", 0)


def test_shared_pool_colocates_roles_with_fractional_shares(role_graph):
    policy_info = role_graph.workers["policy"].placement_info()
    reference_info = role_graph.workers["reference"].placement_info()
    assert role_graph.layouts["reference"].world_size == 2 and role_graph.layouts["reference"].tensor_model_parallel_size == 1
    placement_groups = {info["placement_group_id"] for info in policy_info + reference_info}
    assert len(placement_groups) == 1 and None not in placement_groups
    assert {info["node_id"] for info in policy_info} == {info["node_id"] for info in reference_info}
    for info in policy_info + reference_info:
        assert info["assigned_resources"].get("CPU") == pytest.approx(0.5), info
    assert len({info["pid"] for info in policy_info + reference_info}) == 4  # one process per rank


def test_exchange_sync_delivers_bitwise_identical_tensors(role_graph):
    exchange = role_graph.exchanges["policy_to_reference"]
    assert set(exchange.resolved_backends) == {"gloo"}
    # Default pairing: reference rank j receives from policy rank j % 2.
    received = exchange.transfer(produce_payload, keep_received)
    # Broadcast-style pairing: every reference rank receives from policy rank 0.
    broadcast = exchange.transfer(produce_payload, keep_received, sources_by_target=[0, 0])
    for target_rank, (default_result, broadcast_result) in enumerate(zip(received, broadcast)):
        for result, source_rank in ((default_result, target_rank), (broadcast_result, 0)):
            expected = payload(source_rank)
            assert list(result) == list(expected)  # order kept
            for name, tensor in expected.items():
                got = result[name]
                assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
                assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                                   tensor.contiguous().reshape(-1).view(torch.uint8)), name
    with pytest.raises(ValueError, match="sources_by_target"):
        exchange.transfer(produce_payload, keep_received, sources_by_target=[0, 5])


def test_raising_method_names_role_and_rank_and_worker_survives(role_graph):
    policy = role_graph.workers["policy"]
    with pytest.raises(RoleWorkerRaised) as info:
        policy.execute_all(raise_on_rank_one)
    assert (info.value.role_name, info.value.rank) == ("policy", 1)
    assert "role 'policy' rank 1" in str(info.value) and "deliberate failure on rank one" in str(info.value)
    with pytest.raises(RoleWorkerRaised, match="expects a callable"):
        policy.execute_all("ping")  # a method name is refused: calls are functions or RoleWorker methods
    assert policy.execute_all(RoleWorker.ping) == [("policy", 0), ("policy", 1)]


# ---- user code shipped to workers -------------------------------------------------------

TWO_FILE_SPEC = "class TwoFileSpecialization:\n    SCALE = 7\n"
TWO_FILE_RECIPE = ("from stacx.custom.twofile_algo_spec import TwoFileSpecialization\n\n"
                   "RESULT = TwoFileSpecialization.SCALE * 6\n")
FAILING_FILE = ("def helper():\n    raise RuntimeError('deliberate failure inside the user file: ' + 'x' * 800)\n\n"
                "helper()\n")


def read_two_file_result(worker):
    import sys

    return sys.modules["stacx.custom.twofile_algo"].RESULT, list(worker.user_module_names)


@pytest.fixture()
def two_file_custom_folder(tmp_path):
    """A `stacx/custom/` folder of two files, the recipe importing the specialization file (the
    guide's layout), imported here as `stacx train` imports the folder. Ray workers do not see it."""
    import sys

    import stacx.custom
    from stacx.plugins import discovery

    (tmp_path / "twofile_algo.py").write_text(TWO_FILE_RECIPE)  # sorts (and is walked) first
    (tmp_path / "twofile_algo_spec.py").write_text(TWO_FILE_SPEC)
    stacx.custom.__path__.append(str(tmp_path))
    try:
        discovery._import_user_package()
        yield [entry for entry in discovery.user_module_sources() if entry.module_name.startswith("stacx.custom.twofile")]
    finally:
        stacx.custom.__path__.remove(str(tmp_path))
        for name in ("stacx.custom.twofile_algo", "stacx.custom.twofile_algo_spec"):
            sys.modules.pop(name, None)


@pytest.fixture()
def disposable_role(ray_address, two_file_custom_folder):
    """A 2-rank role of its own, its workers started with the two-file folder's sources (shipped in walk order,
    recipe first: the folder is importable as a package all the same), and beside it on the same pool a
    1-rank role whose only user file raises at import. Both start at once (their start-ups overlap)."""
    from stacx.plugins.discovery import UserModuleSource

    pool = PlacedPool.create(ResourcePool(name="disposable", num_bundles=2, num_cpus_per_bundle=0.5),
                             num_sharing_roles=2)
    failing = UserModuleSource("stacx.custom.failing_user_file", FAILING_FILE, "/driver/only/failing_user_file.py")
    workers = failing_workers = None
    try:
        workers = RoleWorkers("scratch", 2, RolePlacement(pool), collective_timeout_s=30.0,
                              user_modules=list(reversed(two_file_custom_folder)))
        failing_workers = RoleWorkers("failing_code", 1, RolePlacement(pool), user_modules=[failing])
        workers.setup()
        yield workers, failing_workers
    finally:
        for role in (workers, failing_workers):
            if role is not None:
                role.kill()
        pool.remove()


def test_dead_or_slow_workers_fail_the_call_fast_with_role_and_rank(disposable_role, two_file_custom_folder):
    """Also the check of test_a_two_file_custom_folder_reaches_workers_and_a_failing_file_is_shown_whole (folded
    here, Session 10: its role was a second start-up of the same kind), made on this role before it is broken:
    issue 27, the recipe file's `from stacx.custom.my_algo_spec import ...` failed on workers
    (`No module named 'stacx.custom.my_algo_spec'`): the files were executed in walk order, the recipe before
    the file it imports. And the driver cut the worker's error to its first 600 characters."""
    disposable_role, failing_workers = disposable_role
    # The user code shipped to workers: the two files (the recipe imports the other) reach every rank.
    assert [entry.module_name for entry in two_file_custom_folder] == ["stacx.custom.twofile_algo_spec",
                                                                       "stacx.custom.twofile_algo"]
    expected_names = {"stacx.custom.twofile_algo", "stacx.custom.twofile_algo_spec"}
    for result, names in disposable_role.execute_all(read_two_file_result, timeout_s=120.0):
        assert result == 42 and set(names) == expected_names
    # A user file that raises at import: the worker's error names it and keeps its traceback whole.
    with pytest.raises(RoleWorkerDied) as info:
        failing_workers.execute_rank0(RoleWorker.ping, timeout_s=120.0)
    message = str(info.value)
    assert "custom module 'stacx.custom.failing_user_file' (from /driver/only/failing_user_file.py)" in message
    assert "deliberate failure inside the user file: " + "x" * 800 in message  # whole, not cut
    assert "line 2, in helper" in message  # the user file's own traceback
    # A call past its deadline names the rank still running.
    with pytest.raises(RoleWorkerTimeout, match="role 'scratch' rank 1"):
        disposable_role.submit_per_rank(sleep_then_return, [(0.0,), (6.0,)], timeout_s=2.0).result()
    # A worker that exits mid-collective: the driver's call fails naming it, well under 60 s.
    start = time.monotonic()
    with pytest.raises(RoleWorkerDied) as info:
        disposable_role.execute_all(exit_on_rank_one_during_all_reduce)
    assert time.monotonic() - start < 60.0
    assert (info.value.role_name, info.value.rank) == ("scratch", 1)
    assert "role 'scratch' rank 1 died" in str(info.value)
    # A worker killed from outside while a call runs on it.
    import ray

    pending = disposable_role.submit_all(partial(sleep_then_return, seconds=30.0))
    time.sleep(1.0)
    start = time.monotonic()
    ray.kill(disposable_role.actors[0], no_restart=True)
    with pytest.raises(RoleWorkerDied) as info:
        pending.result()
    assert time.monotonic() - start < 60.0
    assert (info.value.role_name, info.value.rank) == ("scratch", 0)
