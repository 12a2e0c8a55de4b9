"""Which in-flight requests were asked to stop (`InferenceEngine.abort`), for engines that decode
in this process (the CPU engine, `stacx serve`).

A request is registered where it enters (the `/generate` endpoint, `CpuEngine.submit`, or
`CpuEngine.generate` itself) and gets an `AbortFlag`; the flag travels with it through the
request batcher into the decoding loop, which polls it between decoding steps. `abort(rids)`
sets the flags of the registered requests with those rids, `abort()` those of every registered
request: requests registered later are not affected (as SGLang's `abort_all`).
"""

from __future__ import annotations

import threading
from typing import Iterable, Optional, Sequence


class AbortFlag:
    """Set once the request with `rid` (None: no rid) must stop. `output`: the request's `GenerateOutput` while
    an engine that decodes in this process builds it (set when its decoding starts, appended to token by token),
    which a streamed `/generate` reads (stacx.serving.generate_stream); None before. `routes`: with
    `return_routed_experts`, the route rows computed so far, as pieces laid end to end (the output gets them at the
    end of the call; stacx.wire.generate_progress)."""

    __slots__ = ("rid", "_event", "output", "routes")

    def __init__(self, rid: Optional[str]):
        self.rid = rid
        self._event = threading.Event()
        self.output = None
        self.routes = ()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class AbortBook:
    """The flags of the requests registered now; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._flags: dict[int, AbortFlag] = {}

    def register(self, rids: Sequence[Optional[str]]) -> list[AbortFlag]:
        flags = [AbortFlag(rid) for rid in rids]
        with self._lock:
            self._flags.update((id(flag), flag) for flag in flags)
        return flags

    def release(self, flags: Iterable[AbortFlag]) -> None:
        with self._lock:
            for flag in flags:
                self._flags.pop(id(flag), None)

    def abort(self, rids: Optional[Iterable[str]] = None) -> int:
        """Set the flags of the registered requests named in `rids` (every one when None); return
        how many were set (a rid that is not registered, finished or unknown, is ignored)."""
        wanted = None if rids is None else set(rids)
        with self._lock:
            hits = [flag for flag in self._flags.values() if wanted is None or flag.rid in wanted]
        for flag in hits:
            flag.set()
        return len(hits)

    def num_registered(self) -> int:
        with self._lock:
            return len(self._flags)
