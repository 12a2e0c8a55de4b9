"""`RoleWorker`: one torch.distributed rank of one role, living in a Ray actor.

The worker is generic: it owns the rank's process groups and a `state` dict, and runs whatever
the driver ships. The training loop plugs model building, forward/backward and checkpointing
in as callables `fn(worker, *args, **kwargs)`; its own methods are called the same way:

    workers.execute_all(build_policy_model, model_config)      # fn(worker, model_config)
    workers.execute_all(RoleWorker.placement_info)              # a method of this class

User code: the driver passes the source of every user module it imported (`--custom-module`
files, `stacx/custom/`) as `user_modules`; the worker executes them under the driver's module
names in `__init__`, before any call is unpickled, so a custom kernel, recipe or specialization
class resolves here even on a node whose file system lacks the file.

Lifecycle: `host_rendezvous` starts the role's rendezvous store on rank 0, bound to the node's
cluster address (never 0.0.0.0 / ::); `setup(...)` initializes torch.distributed (gloo on CPU, NCCL on GPU) over the
role's ranks and megatron-core's (tp, cp, pp, dp) groups and expert grid (etp, ep, edp) with
`initialize_parallel_layout`;
`open_exchange(...)` joins an exchange group with another role's workers; `shutdown()` tears
everything down. Every collective inherits the timeout given to `setup`. A worker kept for another run
(`RoleWorkerGraph.prepare_run`) is emptied by `clear_for_next_run` and set up again: nothing of the run
it served is left but the modules it imported.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from stacx.plugins.discovery import import_user_module_sources
from stacx.parallel.bound_store import host_bound_store
from stacx.parallel.groups import default_backend, destroy_parallel_layout, initialize_parallel_layout
from stacx.parallel.megatron_globals import reset_megatron_globals
from stacx.parallel.node_interface import bind_collectives_to_node
from stacx.trainer.cluster.ray.exchange_endpoint import ExchangeEndpoint, host_store
from stacx.trainer.cluster.ray.tensor_transport import register_tensor_transport


def join_role_world(rank: int, world_size: int, *, node_address: str, store_address: str, store_port: int,
                    hosted_store=None, timeout_s: float) -> None:
    """`init_process_group` over the role's store, with gloo/NCCL listening on `node_address`'s interface.

    Rank 0 passes the store it hosts (`exchange.host_store`, bound to its node address); the other
    ranks connect to `store_address:store_port`. No `tcp://` or `env://` rendezvous is involved:
    torch's own would listen on every interface.
    """
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        if hosted_store is None:
            raise ValueError("join_role_world: rank 0 must pass the store it hosts (hosted_store)")
        store = hosted_store
    else:
        store = dist.TCPStore(store_address, store_port, None, False, timeout)
    # gloo (the default group and megatron-core's groups) and NCCL listen on the node's interface.
    bind_collectives_to_node(node_address)
    dist.init_process_group(backend=default_backend(), store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


class RoleWorker:
    """State and entry points of one rank. Wrapped with `ray.remote` by `RoleWorkers`."""

    def __init__(self, role_name: str, rank: int, world_size: int, *, num_threads: int | None = None,
                 user_modules: tuple = ()):
        """`user_modules`: `stacx.plugins.discovery.UserModuleSource`s to import before any call."""
        self.role_name = role_name
        self.rank = rank
        self.world_size = world_size
        self.groups = None
        """`stacx.parallel.groups.ProcessGroups` of this rank, set by `setup`."""
        self.state: dict[str, Any] = {}
        """Whatever plugged-in code keeps between calls (model, optimizer, data iterator...)."""
        self.exchanges: dict[str, Any] = {}
        self._hosted_stores: dict[str, Any] = {}
        self._rendezvous_store = None
        """Rank 0: the role's torch.distributed store, started by `host_rendezvous` and used by `setup`."""
        register_tensor_transport()  # its results (log-probs, metrics) go back as raw bytes
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.user_module_names: list[str] = []
        """The user modules executed from the driver's sources in this process."""
        if user_modules:
            self.user_module_names = import_user_module_sources(user_modules)

    # ---- placement and rendezvous -------------------------------------------------------
    def placement_info(self) -> dict[str, Any]:
        """Where this worker runs: node, placement group, process, visible GPUs."""
        # Imported here: Ray is slow to import (start-up time).
        import ray

        context = ray.get_runtime_context()
        placement_group_id = context.get_placement_group_id()
        return {
            "role": self.role_name,
            "rank": self.rank,
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "placement_group_id": placement_group_id,
            "assigned_resources": context.get_assigned_resources(),
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def host_rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: start the role's rendezvous store on this node's cluster address; returns (address, port).

        The store (`parallel.bound_store.host_bound_store`: its listening socket bound to the node address, never to
        0.0.0.0 / ::) is kept for `setup`, which hands it to `init_process_group`; the other ranks
        connect to (address, port).
        """
        # Imported here: Ray is slow to import (start-up time).
        import ray

        if self.rank != 0:
            raise ValueError(f"role {self.role_name!r}: host_rendezvous runs on rank 0, not rank {self.rank}")
        node_address = ray.util.get_node_ip_address()  # the node's cluster address: 127.0.0.1 on a local cluster
        self._rendezvous_store, port = host_bound_store(node_address, timeout_s, purpose=f"role {self.role_name!r} rendezvous")
        return node_address, port

    def setup(self, rank: int, world_size: int, master_addr: str, master_port: int,
              tensor_model_parallel_size: int = 1, context_parallel_size: int = 1, timeout_s: float = 300.0,
              pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
              expert_tensor_parallel_size: int | None = None) -> dict:
        """Join the role's torch.distributed world and build its megatron-core (tp, cp, pp, dp) groups and
        expert grid (etp, ep, edp: a mixture-of-experts model's experts spread over ep ranks).

        Must run on every rank of the role at the same time, after `host_rendezvous` on rank 0, whose
        store at (`master_addr`, `master_port`) the other ranks join. Returns this rank's coordinates.
        """
        # Imported here: Ray is slow to import (start-up time).
        import ray


        if (rank, world_size) != (self.rank, self.world_size):
            raise ValueError(
                f"role {self.role_name!r}: setup for rank {rank}/{world_size} sent to the worker created as "
                f"rank {self.rank}/{self.world_size}"
            )
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        if torch.cuda.is_available():
            # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, which is then device 0.
            torch.cuda.set_device(0)
        if rank == 0 and self._rendezvous_store is None:
            raise RuntimeError(f"role {self.role_name!r}: rank 0 has no rendezvous store; "
                               "call host_rendezvous before setup (RoleWorkers.submit_setup does)")
        join_role_world(rank, world_size, node_address=ray.util.get_node_ip_address(), store_address=master_addr,
                        store_port=master_port, hosted_store=self._rendezvous_store, timeout_s=timeout_s)
        self.groups = initialize_parallel_layout(tensor_model_parallel_size, context_parallel_size,
                                                 pipeline_model_parallel_size=pipeline_model_parallel_size,
                                                 expert_model_parallel_size=expert_model_parallel_size,
                                                 expert_tensor_parallel_size=expert_tensor_parallel_size,
                                                 timeout_s=timeout_s)
        return {
            "rank": rank,
            "tp_rank": self.groups.tp_rank,
            "cp_rank": self.groups.cp_rank,
            "dp_rank": self.groups.dp_rank,
            "pp_rank": self.groups.pp_rank,
            "tp_size": self.groups.tp_size,
            "cp_size": self.groups.cp_size,
            "dp_size": self.groups.dp_size,
            "pp_size": self.groups.pp_size,
            "ep_rank": self.groups.ep_rank,
            "ep_size": self.groups.ep_size,
        }

    # ---- running shipped code -----------------------------------------------------------
    def execute(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run `fn(self, *args, **kwargs)` and return its value (a method of this class: `RoleWorker.ping`)."""
        if not callable(fn):
            raise TypeError(f"execute expects a callable fn(worker, ...), got {type(fn).__name__} {fn!r}; "
                            "pass a function or a RoleWorker method (RoleWorker.placement_info), not its name")
        return fn(self, *args, **kwargs)

    def ping(self) -> tuple[str, int]:
        return self.role_name, self.rank

    # ---- exchange groups ----------------------------------------------------------------
    def host_exchange_store(self, name: str, timeout_s: float) -> tuple[str, int]:
        """Start exchange group `name`'s store on this node; returns (node ip, port)."""
        # Imported here: Ray is slow to import (start-up time).
        import ray

        node_address = ray.util.get_node_ip_address()  # the node's cluster address: 127.0.0.1 on a local cluster
        store, port = host_store(node_address, timeout_s)
        self._hosted_stores[name] = store
        return node_address, port

    def open_exchange(self, name: str, group_rank: int, group_size: int, host: str, port: int, *,
                      secret: bytes, backend: str = "auto", timeout_s: float = 300.0) -> str:
        """Join exchange group `name` as `group_rank`; all members must call this together.

        `secret` is the group's per-run secret from the driver (authenticates transfer headers)."""
        # Imported here: Ray is slow to import (start-up time).
        import ray

        if name in self.exchanges:
            raise ValueError(f"role {self.role_name!r} rank {self.rank}: exchange group {name!r} is already open")
        self.exchanges[name] = ExchangeEndpoint(
            name, group_rank, group_size, host, port, secret=secret, local_host=ray.util.get_node_ip_address(),
            backend=backend, timeout_s=timeout_s, hosted_store=self._hosted_stores.get(name),
        )
        return self.exchanges[name].backend

    def exchange_send(self, name: str, transfer_id: int, produce: Callable[..., Any],
                      dst_group_ranks: list[int], bucket_bytes: int) -> int:
        """Run `produce` (collectively on every source rank) and send its tensors to `dst_group_ranks`."""
        tensors = self.execute(produce)
        if not isinstance(tensors, dict):
            raise TypeError(
                f"role {self.role_name!r}: exchange {name!r} produce must return a dict of tensors, "
                f"got {type(tensors).__name__}"
            )
        if not dst_group_ranks:
            return 0
        return self._exchange(name).send(transfer_id, tensors, dst_group_ranks, bucket_bytes)

    def exchange_receive(self, name: str, transfer_id: int, consume: Callable[..., Any],
                         src_group_rank: int) -> Any:
        """Receive the tensors of `src_group_rank` and return `consume(self, tensors)`."""
        tensors = self._exchange(name).receive(transfer_id, src_group_rank)
        return self.execute(consume, tensors)

    def close_exchange(self, name: str) -> None:
        endpoint = self.exchanges.pop(name, None)
        if endpoint is not None:
            endpoint.close()
        self._hosted_stores.pop(name, None)

    def _exchange(self, name: str):
        if name not in self.exchanges:
            raise KeyError(
                f"role {self.role_name!r} rank {self.rank}: exchange group {name!r} is not open; "
                f"open: {sorted(self.exchanges)}"
            )
        return self.exchanges[name]

    # ---- teardown -----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close exchange groups, megatron-core's groups and the default process group."""
        for name in list(self.exchanges):
            self.close_exchange(name)
        destroy_parallel_layout()
        self.groups = None
        self._rendezvous_store = None

    def clear_for_next_run(self, user_modules: tuple = ()) -> list[str]:
        """Leave nothing of the run this worker served, as a fresh worker would start the next one.

        Drops `state` (the runtime: model, optimizer, reference weights, specialization), closes its exchange
        groups, ends megatron-core's groups and the default process group (`setup` builds them again), resets
        megatron-core's other module state (RNG tracker, micro-batch calculator, MoE loss tracker, rerun
        machine: `parallel.megatron_globals`) and turns gradients back on. `user_modules`: the driver's user
        module sources now; those this process lacks are imported, in the driver's order, as a worker started
        now would import them (a user module is never un-imported: the driver keeps every one it loaded and
        ships them all to new workers too). Returns the user modules imported in this process.
        """
        self.shutdown()
        self.state.clear()
        reset_megatron_globals()
        torch.set_grad_enabled(True)
        if user_modules:
            imported = set(self.user_module_names)
            self.user_module_names += [name for name in import_user_module_sources(user_modules)
                                       if name not in imported]
        gc.collect()
        return list(self.user_module_names)
