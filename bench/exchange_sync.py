"""Exchange-sync throughput between two roles' Ray workers, against baselines measured in the same run.

    python bench/exchange_sync.py [--total-mb 128 --num-tensors 256 --repeats 3]

One source worker and one target worker (separate Ray actors, gloo over TCP on CPU) move a
state dict of `--num-tensors` float32 tensors totalling `--total-mb`:
- baseline "object store": the driver `ray.get`s the source's dict and passes it to the target
  (how a naive implementation moves tensors between actors);
- "per tensor": the exchange group with one bucket per tensor (bucket_bytes=1);
- "bucketed": the exchange group with the default 256 MiB buckets (what Stacx uses).
Times are the best of `--repeats`, each including produce and a consume that checksums the
bytes. Prints MB/s and ratios against the object-store baseline; results go to
bench/results/exchange_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def make_state_dict(worker, total_mb: int, num_tensors: int) -> dict:
    """Deterministic float32 tensors of roughly equal size (cached on the worker)."""
    key = ("bench_state", total_mb, num_tensors)
    if key not in worker.state:
        generator = torch.Generator().manual_seed(0)
        numel = total_mb * 1024 * 1024 // 4 // num_tensors
        worker.state[key] = {f"layer{i}.weight": torch.randn(numel, generator=generator) for i in range(num_tensors)}
    return worker.state[key]


def checksum(worker, tensors) -> float:
    return float(sum(t.double().sum() for t in tensors.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mb", type=int, default=128)
    parser.add_argument("--num-tensors", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import ray

    from stacx.trainer.cluster.ray.connect import connect_ray
    from stacx.trainer.cluster.ray import ExchangeSyncGroup, PlacedPool, ResourcePool, RolePlacement, RoleWorkers

    connection = connect_ray(num_cpus=2, object_store_memory_bytes=max(200, 3 * args.total_mb) * 1024 * 1024,
                             log_to_driver=False)
    try:
        pool = PlacedPool.create(ResourcePool(name="bench", num_bundles=1, num_cpus_per_bundle=1.0), num_sharing_roles=2)
        source = RoleWorkers("source", 1, RolePlacement(pool), collective_timeout_s=300)
        target = RoleWorkers("target", 1, RolePlacement(pool), collective_timeout_s=300)
        produce = lambda worker: make_state_dict(worker, args.total_mb, args.num_tensors)  # noqa: E731
        expected = source.execute_rank0(lambda w: checksum(w, make_state_dict(w, args.total_mb, args.num_tensors)))
        num_bytes = args.total_mb * 1024 * 1024

        def object_store() -> float:
            tensors = ray.get(source.actors[0].execute.remote(produce))
            return ray.get(target.actors[0].execute.remote(checksum, tensors))

        exchanges = {}
        for name, bucket_bytes in (("per_tensor", 1), ("bucketed", 256 * 1024 * 1024)):
            exchanges[name] = ExchangeSyncGroup(f"bench_{name}", source, target, bucket_bytes=bucket_bytes)
            exchanges[name].connect()

        def timed(fn) -> float:
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                got = fn()
                best = min(best, time.perf_counter() - start)
                assert abs(got - expected) <= 1e-6 * max(1.0, abs(expected)), (got, expected)
            return best

        seconds = {
            "object_store": timed(object_store),
            "per_tensor": timed(lambda: exchanges["per_tensor"].transfer(produce, checksum)[0]),
            "bucketed": timed(lambda: exchanges["bucketed"].transfer(produce, checksum)[0]),
        }
        for exchange in exchanges.values():
            exchange.close()
        source.kill()
        target.kill()
        pool.remove()
    finally:
        connection.shutdown()

    baseline = seconds["object_store"]
    rows = {name: {"seconds": round(s, 4), "mb_per_s": round(num_bytes / 2**20 / s, 1),
                   "speedup_vs_object_store": round(baseline / s, 2)} for name, s in seconds.items()}
    print(f"exchange sync: {args.num_tensors} float32 tensors, {args.total_mb} MB, best of {args.repeats}")
    for name, row in rows.items():
        print(f"  {name:13s} {row['seconds']:8.3f} s  {row['mb_per_s']:8.1f} MB/s  "
              f"x{row['speedup_vs_object_store']:.2f} vs object store")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    out_path = os.path.join(os.path.dirname(__file__), "results", "exchange_sync.json")
    with open(out_path, "w") as f:
        json.dump({"args": vars(args), "machine": platform.machine(), "cpus": os.cpu_count(), "results": rows}, f, indent=2)
    print(f"results: {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
