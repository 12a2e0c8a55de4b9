"""The spawned-rank harness itself: real groups, real failures, no hangs."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from stacx.testing.distributed import DistributedRunError, run_distributed, run_forked

pytestmark = pytest.mark.distributed


def tp_allreduce_and_cp_allgather(groups):
    rank = dist.get_rank()
    summed = torch.tensor([float(rank)])
    dist.all_reduce(summed, group=groups.tp)
    gathered = [torch.zeros(1) for _ in range(groups.cp_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=groups.cp)
    return {
        "rank": rank,
        "sizes": (groups.tp_size, groups.cp_size, groups.dp_size),
        "tp_rank": groups.tp_rank,
        "cp_rank": groups.cp_rank,
        "tp_sum": summed.item(),
        "cp_members": [t.item() for t in gathered],
    }


@pytest.mark.slow
def test_tp2_cp2_collectives_on_four_ranks():
    results = run_distributed(tp_allreduce_and_cp_allgather, 4, tensor_model_parallel_size=2, context_parallel_size=2)
    # megatron's default order is tp-cp-dp: TP groups are {0,1},{2,3}; CP groups are {0,2},{1,3}.
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["sizes"] == (2, 2, 1) for r in results)
    assert [r["tp_sum"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r["cp_members"] for r in results] == [[0.0, 2.0], [1.0, 3.0], [0.0, 2.0], [1.0, 3.0]]
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    assert [r["cp_rank"] for r in results] == [0, 0, 1, 1]


def raise_on_rank_two(groups):
    if dist.get_rank() == 2:
        raise ValueError("boom from the third rank")
    return dist.get_rank()


def test_rank_exception_is_reported_with_its_rank():
    with pytest.raises(DistributedRunError, match=r"rank 2 raised:(.|\n)*boom from the third rank") as info:
        run_distributed(raise_on_rank_two, 4, tensor_model_parallel_size=2, timeout_s=60)
    assert info.value.rank == 2


def die_on_rank_one(groups):
    if dist.get_rank() == 1:
        os._exit(7)
    time.sleep(30)


def test_dead_rank_is_reported_fast():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank 1 died with exit code 7"):
        run_distributed(die_on_rank_one, 2, timeout_s=60)
    assert time.monotonic() - start < 45


def rank_zero_skips_the_barrier(groups):
    if dist.get_rank() != 0:
        dist.barrier()
    else:
        time.sleep(60)


@pytest.mark.slow
def test_hang_times_out_instead_of_waiting_forever():
    start = time.monotonic()
    with pytest.raises(DistributedRunError):
        run_distributed(rank_zero_skips_the_barrier, 2, timeout_s=8)
    assert time.monotonic() - start < 60


def return_an_unpicklable_value(groups):
    return lambda: None


def test_unpicklable_result_is_reported_not_waited_for():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"rank 0 raised:(.|\n)*(pickle|Pickl)"):
        run_distributed(return_an_unpicklable_value, 1, timeout_s=60)
    assert time.monotonic() - start < 45


def print_and_read_the_environment(groups, name):
    print(f"rank {dist.get_rank()} says hello", flush=True)
    return os.environ.get(name)


def test_ranks_write_to_the_callers_stdout_and_see_its_environment_at_call_time(capfd, monkeypatch):
    """Ranks are forked from a forkserver started by an earlier call: they still write where the caller's
    stdout points now (capfd here) and see the environment as it is now, like spawned ranks."""
    run_distributed(print_and_read_the_environment, 1, args=("STACX_TEST_HARNESS_VALUE",))  # the server is up
    capfd.readouterr()
    monkeypatch.setenv("STACX_TEST_HARNESS_VALUE", "set after the server started")
    values = run_distributed(print_and_read_the_environment, 2, args=("STACX_TEST_HARNESS_VALUE",))
    assert values == ["set after the server started"] * 2
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out


def environment_and_world(name):
    if name == "raise":
        raise ValueError("raised in the forked process")
    return os.environ.get(name), sorted(os.environ), dist.is_initialized()


def test_run_forked_runs_one_process_with_the_given_environment_and_no_world():
    assert run_forked(environment_and_world, "ONLY", environ={"ONLY": "this"}) == ("this", ["ONLY"], False)
    with pytest.raises(DistributedRunError, match=r"(?s)raised:.*ValueError: raised in the forked process"):
        run_forked(environment_and_world, "raise")
