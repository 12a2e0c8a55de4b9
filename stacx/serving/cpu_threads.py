"""Pin the CPU engine's OpenMP threads one to a core, as vLLM's CPU backend pins its worker's.

torch runs every parallel op (oneDNN's matmuls, the attention kernel, the log-softmax) on an OpenMP team:
the thread that calls the op plus `torch.get_num_threads() - 1` workers that OpenMP keeps for that
thread. Left to the scheduler these threads float between the cores; vLLM binds its worker's team to the
cores in `VLLM_CPU_OMP_THREADS_BIND` (`GOMP_CPU_AFFINITY`, read when the OpenMP runtime loads).

`OpenMpBinding.ensure_bound()` does the same from inside a running process, for the calling thread's team:
one OpenMP parallel region of the team's size in which thread i sets its own affinity to `cores[i]`. The
OpenMP runtime reuses the same worker threads, in the same order, for every later region of that size
started by the same thread, so the binding holds for torch's ops. Threads the bound caller starts later
inherit its core (`cores[0]`), as with `GOMP_CPU_AFFINITY`.

Only GNU OpenMP (libgomp, what torch's Linux builds ship) is supported; `OpenMpBinding` raises naming the
reason elsewhere. Binding is off unless asked for: several engines, or an engine beside a trainer, bound to
the same cores would queue behind each other instead of spreading over the machine.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional, Sequence


def parse_core_list(text: str) -> tuple[int, ...]:
    """"0-1", "0,2,4-5" -> (0, 1), (0, 2, 4, 5): core ids in the given order; ValueError naming the text."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores += range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"core list {text!r} is not like '0-1' or '0,2,4-5'") from None
    if not cores or len(set(cores)) != len(cores) or min(cores) < 0:
        raise ValueError(f"core list {text!r} must name each core (>= 0) once")
    return tuple(cores)


def check_cores_available(cores: Sequence[int]) -> None:
    """ValueError naming the cores this process may not run on (its affinity mask), if any."""
    available = os.sched_getaffinity(0)
    missing = sorted(set(cores) - available)
    if missing:
        raise ValueError(f"cores {missing} are not among this process's cores {sorted(available)}")


def _loaded_libgomp() -> str:
    """The path of the GNU OpenMP runtime torch loaded (torch's own copy first)."""
    import torch  # here: checking a core list (`stacx serve --bind-cores`) must not import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    found: list[str] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libgomp") and path not in found:
                found.append(path)
    if not found:
        raise RuntimeError("binding the engine's threads needs torch built with GNU OpenMP (libgomp), which this "
                           "process has not loaded; run without the core binding")
    found.sort(key=lambda path: not os.path.realpath(path).startswith(os.path.dirname(torch_dir)))
    return found[0]


class OpenMpBinding:
    """Binds the OpenMP team of every thread that calls `ensure_bound()` (once per thread) to `cores`.

    cores: one core id per torch thread; `ensure_bound` sets torch's thread count to len(cores).
    """

    def __init__(self, cores: Sequence[int]):
        self.cores = tuple(cores)
        if not self.cores:
            raise ValueError("OpenMpBinding needs at least one core")
        check_cores_available(self.cores)
        self._lib = ctypes.CDLL(_loaded_libgomp())
        self._lib.omp_get_thread_num.restype = ctypes.c_int
        self._this_thread = threading.local()  # `bound` set in each thread whose team is pinned (dies with it)
        self.thread_ids: dict[int, int] = {}
        """The last team bound: {OpenMP thread number: native thread id}."""

    def ensure_bound(self) -> None:
        """Bind the calling thread's team unless this thread did already; returns at once after the first call."""
        if getattr(self._this_thread, "bound", False):
            return
        import torch

        torch.set_num_threads(len(self.cores))
        self.thread_ids = self._bind_team()
        self._this_thread.bound = True

    def _bind_team(self) -> dict[int, int]:
        """One parallel region of len(cores) threads, each binding itself; {OpenMP thread number: native id}."""
        bound: dict[int, int] = {}
        errors: list[BaseException] = []

        def bind_this_thread(_data: Optional[int]) -> None:
            index = self._lib.omp_get_thread_num()
            try:
                os.sched_setaffinity(0, {self.cores[index]})  # 0: the calling thread
                bound[index] = threading.get_native_id()
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread below
                errors.append(err)

        body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(bind_this_thread)
        self._lib.GOMP_parallel(body, None, ctypes.c_uint(len(self.cores)), ctypes.c_uint(0))
        if errors:
            raise errors[0]
        if len(bound) != len(self.cores):
            raise RuntimeError(f"the OpenMP runtime started {len(bound)} threads for {len(self.cores)} cores; "
                               "is OMP_THREAD_LIMIT or OMP_DYNAMIC set?")
        return bound
