"""Run a function on N spawned gloo ranks with a megatron-core (tp, cp, dp) layout.

    results = run_distributed(check_allreduce, world_size=4, tensor_model_parallel_size=2,
                              context_parallel_size=2, args=(x,))

`fn(groups, *args)` runs on every rank with the rank's `ProcessGroups`; its return values come
back in rank order. Any rank's exception is re-raised here as `DistributedRunError` carrying
that rank's number and traceback; a rank that dies without a word, or a run that exceeds its
deadline, fails the same way. Nothing waits forever: init and run both have timeouts, and
every child is killed before this returns or raises.

Ranks are forked from a forkserver that imported torch and megatron-core once per parent process
(`RANK_PRELOAD_MODULES`), so a rank starts in a fraction of a second instead of paying those
imports again (about 4 s of CPU each). A forked rank would inherit the server's environment and
standard output from when the server started; the parent's environment, stdout and stderr at call
time are handed to every rank explicitly, so a rank behaves as a spawned one would.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp


class DistributedRunError(RuntimeError):
    """A rank raised, died, or did not finish in time."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RANK_PRELOAD_MODULES = ("torch", "torch.distributed", "stacx.testing.megatron_preload", "stacx.parallel.groups")
"""Imported once by the forkserver every rank is forked from (what each rank would import anyway)."""


def _rank_context():
    """The forkserver context, its preload list set before the server starts (first use per process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD_MODULES))
    return ctx


class _ParentStdio:
    """The parent's file descriptors 1 and 2 at `Process.start`, received by a forked rank as its own.

    Pickled while the rank starts, when multiprocessing can pass descriptors along (`DupFd`)."""

    def __init__(self, received=None):
        self.received = received

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return (_ParentStdio, ((DupFd(1), DupFd(2)),))

    def adopt(self) -> None:
        for target, received in zip((1, 2), self.received):
            fd = received.detach()
            os.dup2(fd, target)
            os.close(fd)


def _rank_main(rank, world_size, port, fn, args, kwargs, layout, timeout_s, results, environ, stdio):
    stdio.adopt()
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    from stacx.parallel.groups import destroy_parallel_layout, initialize_parallel_layout

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    # Several ranks share two cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        tp, cp, pp = layout
        groups = initialize_parallel_layout(tp, cp, pipeline_model_parallel_size=pp, timeout_s=timeout_s)
        value = fn(groups, *args, **kwargs)
        # Pickled here, to plain bytes: a failure is reported with this rank's traceback (the queue
        # pickles in a background thread and drops what fails), and tensors travel as their bytes,
        # not as shared-memory handles that vanish when this rank exits before the parent reads them.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy_parallel_layout()
        except Exception:  # noqa: BLE001 - teardown after a failure may fail too; the cause was sent
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 180.0,
) -> list[Any]:
    """Spawn `world_size` gloo ranks, run `fn(groups, *args, **kwargs)` on each, return results by rank.

    `fn` must be importable by name (a module-level function), as spawned children unpickle it.
    `timeout_s` bounds process-group init, every collective, and the whole run.
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size must be in [1, 8], got {world_size}")
    ctx = _rank_context()
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, fn, args, kwargs or {},
                  (tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size), timeout_s, results, dict(os.environ), _ParentStdio()),
            # Not daemonic: megatron's torch_dist checkpoint writer starts processes of its own, which a
            # daemonic process may not; every child is killed in the `finally` below either way.
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s + 30.0  # spawn + imports on top of the run itself
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue_module.Empty:
                _check_alive(procs, collected)
                if time.monotonic() > deadline:
                    waiting = sorted(set(range(world_size)) - set(collected))
                    raise DistributedRunError(
                        f"distributed run timed out after {timeout_s:.0f}s; ranks {waiting} did not finish"
                    )
                continue
            if not ok:
                raise DistributedRunError(f"rank {rank} raised:\n{value}", rank=rank)
            collected[rank] = pickle.loads(value)  # a rank's result, pickled by that rank (our own child)
    finally:
        # After a failure the other ranks may be blocked in a collective: kill them at once rather
        # than waiting for them; after success they have sent their result and are exiting.
        finished = len(collected) == world_size
        for proc in procs:
            if finished:
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    return [collected[rank] for rank in range(world_size)]


def _check_alive(procs, collected) -> None:
    for rank, proc in enumerate(procs):
        if rank not in collected and not proc.is_alive() and proc.exitcode not in (None, 0):
            raise DistributedRunError(f"rank {rank} died with exit code {proc.exitcode}", rank=rank)


def _forked_main(fn, args, results, environ, stdio):
    stdio.adopt()
    os.environ.clear()
    os.environ.update(environ)
    try:
        results.put((True, pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - the failure must reach the parent
        results.put((False, traceback.format_exc()))


def run_forked(fn: Callable[..., Any], *args: Any, environ: dict | None = None, timeout_s: float = 120.0) -> Any:
    """`fn(*args)` in one process forked from the rank forkserver (torch and megatron-core imported, no
    process group), with `environ` as its whole environment (default: the caller's); returns its value.

    For a check that needs a process of its own (what it listens on, what it imports) without paying a fresh
    interpreter's imports. `fn` must be importable by name; its exception is re-raised as `DistributedRunError`."""
    ctx = _rank_context()
    results = ctx.Queue()
    proc = ctx.Process(target=_forked_main, args=(fn, args, results, dict(os.environ if environ is None else environ),
                                                  _ParentStdio()), daemon=False)
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                ok, value = results.get(timeout=0.5)
                break
            except queue_module.Empty:
                if not proc.is_alive() and proc.exitcode not in (None, 0):
                    raise DistributedRunError(f"the forked process died with exit code {proc.exitcode}") from None
                if time.monotonic() > deadline:
                    raise DistributedRunError(f"the forked process did not finish in {timeout_s:.0f}s") from None
        if not ok:
            raise DistributedRunError(f"the forked process raised:\n{value}")
        return pickle.loads(value)  # pickled by our own child
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
