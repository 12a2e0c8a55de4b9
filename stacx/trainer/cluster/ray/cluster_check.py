"""`python -m stacx.trainer.cluster.ray.cluster_check`: prove a Ray cluster can run Stacx roles.

Attaches to the cluster (`--ray-address`, else `RAY_ADDRESS` - which `ray job submit` sets
for its entry command - else a fresh local cluster), places a `check` role of `--num-ranks`
workers (rank i in bundle i; `--bundle-resources node_a,node_b` pins bundles to nodes started
with matching `--resources`), initializes torch.distributed with TP=`--tp`, runs a TP and a
world all-reduce, sends every rank's tensors to a second role over an exchange group, checks
all results against values computed here, and prints one line
`STACX_CLUSTER_CHECK {json}` with the per-rank nodes and the results. Exit status 0 on success.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

from stacx.trainer.cluster.ray import ExchangeSyncGroup, PlacedPool, ResourcePool, RolePlacement, RoleWorkers
from stacx.trainer.cluster.ray.connect import connect_ray

RESULT_PREFIX = "STACX_CLUSTER_CHECK"


def rank_contribution(rank: int) -> torch.Tensor:
    """What rank `rank` adds to the all-reduces: float64, so the sums are exact."""
    return torch.arange(4, dtype=torch.float64) + 10.0 * rank


def _all_reduces(worker) -> dict:
    tp_sum = rank_contribution(worker.rank)
    dist.all_reduce(tp_sum, group=worker.groups.tp)
    world_sum = rank_contribution(worker.rank)
    dist.all_reduce(world_sum)
    return {"tp_rank": worker.groups.tp_rank, "tp_sum": tp_sum.tolist(), "world_sum": world_sum.tolist()}


def _produce(worker) -> dict:
    return {"contribution": rank_contribution(worker.rank), "rank": torch.tensor(worker.rank)}


def _consume(worker, tensors) -> dict:
    return {name: tensor.tolist() for name, tensor in tensors.items()}


def run_check(num_ranks: int, tensor_model_parallel_size: int, bundle_resources: list[str], num_cpus_per_rank: float,
              timeout_s: float) -> dict:
    """Run the check on the connected cluster; returns the result (raises on any mismatch)."""
    resources = tuple({name: 1.0} for name in bundle_resources)
    pool = ResourcePool(name="check", num_bundles=num_ranks, num_cpus_per_bundle=num_cpus_per_rank,
                        bundle_resources=resources, strategy="SPREAD" if resources else "PACK")
    placed = PlacedPool.create(pool, num_sharing_roles=2, timeout_s=timeout_s)
    check = RoleWorkers("check", num_ranks, RolePlacement(placed), tensor_model_parallel_size=tensor_model_parallel_size,
                        collective_timeout_s=timeout_s, call_timeout_s=timeout_s)
    receiver = RoleWorkers("receiver", num_ranks, RolePlacement(placed), collective_timeout_s=timeout_s,
                           call_timeout_s=timeout_s)
    try:
        start = time.monotonic()
        check.setup()
        receiver.setup()
        placement = check.placement_info()
        reduced = check.execute_all(_all_reduces)
        exchange = ExchangeSyncGroup("check_to_receiver", check, receiver, timeout_s=timeout_s)
        exchange.connect()
        # Reversed pairing, so every value crosses to the other bundle (the other node when pinned).
        received = exchange.transfer(_produce, _consume, sources_by_target=list(reversed(range(num_ranks))))
        exchange.close()
        expected_world = sum(rank_contribution(r) for r in range(num_ranks)).tolist()
        for rank, result in enumerate(reduced):
            group_start = rank - rank % tensor_model_parallel_size
            expected_tp = sum(rank_contribution(r) for r in range(group_start, group_start + tensor_model_parallel_size))
            if result["tp_sum"] != expected_tp.tolist() or result["world_sum"] != expected_world:
                raise RuntimeError(f"cluster check: rank {rank} all-reduce gave {result}, expected tp "
                                   f"{expected_tp.tolist()} and world {expected_world}")
        for target_rank, got in enumerate(received):
            source_rank = num_ranks - 1 - target_rank
            if got != {"contribution": rank_contribution(source_rank).tolist(), "rank": source_rank}:
                raise RuntimeError(f"cluster check: receiver rank {target_rank} got {got} from check rank {source_rank}")
        return {
            "ok": True,
            "num_ranks": num_ranks,
            "tensor_model_parallel_size": tensor_model_parallel_size,
            "node_ids": [info["node_id"] for info in placement],
            "tp_sums": [result["tp_sum"] for result in reduced],
            "world_sum": reduced[0]["world_sum"],
            "exchange_backend": exchange.resolved_backends[0],
            "seconds": round(time.monotonic() - start, 2),
        }
    finally:
        check.shutdown()
        receiver.shutdown()
        placed.remove()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stacx.trainer.cluster.ray.cluster_check", description=__doc__.split("\n")[0])
    parser.add_argument("--ray-address", default=None, help="attach to this cluster (default: RAY_ADDRESS, else local)")
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the check role")
    parser.add_argument("--bundle-resources", default="",
                        help="comma-separated custom resource per bundle, e.g. node_a,node_b (one per rank)")
    parser.add_argument("--num-cpus-per-rank", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    bundle_resources = [name for name in args.bundle_resources.split(",") if name]
    if bundle_resources and len(bundle_resources) != args.num_ranks:
        parser.error(f"--bundle-resources names {len(bundle_resources)} resources for {args.num_ranks} ranks")


    connection = connect_ray(args.ray_address, log_to_driver=False)
    try:
        result = run_check(args.num_ranks, args.tp, bundle_resources, args.num_cpus_per_rank, args.timeout_s)
        result["attached_to"] = connection.address
    finally:
        connection.shutdown()
    print(f"{RESULT_PREFIX} {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
