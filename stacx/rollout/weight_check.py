"""The post-sync check: after a weight push, does the engine hold exactly what the trainer sent?

The sender digests every tensor as it streams it (`DigestingBuckets`, `stacx.parallel.tensor_digests`),
then asks the engine for the digests of the same Hugging Face names, read back from the weights it
now serves (`engine.weight_digests(names)`: the vLLM worker extension, `stacx serve`'s
`/stacx/weight_digests`, SGLang's `/get_weights_by_name`), and compares them:

    digesting = DigestingBuckets(buckets, dtype=engine.weight_digest_dtype())
    engine.update_weights(digesting, version=v)
    verify_engine_weights(engine, digesting.digests, url=url)   # WeightSyncMismatch names the tensor

A mismatch raises `WeightSyncMismatch`, which stops the run, naming the first tensors that differ. A
tensor the engine cannot read back (a layout it does not expose) is reported as unverified (a warning,
not an error). The check costs a digest of every tensor on both ends (measured in docs/performance.md);
`--weight-check-every N` runs it on every Nth push only.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional

import torch

from stacx.parallel.tensor_digests import tensor_digest

logger = logging.getLogger(__name__)

MAX_NAMES_SHOWN = 5


class WeightSyncMismatch(RuntimeError):
    """The engine's weights differ from the trainer's after a push (`names`: the tensors that differ)."""

    def __init__(self, message: str, names: list[str]):
        super().__init__(message)
        self.names = names


def check_due(version: int, every: int) -> bool:
    """Whether push number `version` is checked under `--weight-check-every every` (0: never)."""
    if every < 0:
        raise ValueError(f"--weight-check-every must be >= 0 (0: never), got {every}")
    return every > 0 and version % every == 0


class DigestingBuckets:
    """Iterates `buckets` unchanged, recording `digests[name]` of each tensor (cast to `dtype`, the
    engine's parameter dtype, when floating) as it passes."""

    def __init__(self, buckets: Iterable, *, dtype: Optional[torch.dtype] = None):
        self._buckets, self.dtype = buckets, dtype
        self.digests: dict[str, str] = {}

    def __iter__(self) -> Iterator:
        for bucket in self._buckets:
            for name, tensor in bucket:
                self.digests[name] = tensor_digest(tensor, dtype=self.dtype)
            yield bucket


def compare_digests(sent: dict[str, str], held: dict[str, Optional[str]], *, url: str, version: int) -> list[str]:
    """Raise WeightSyncMismatch for the tensors whose digests differ (or that the engine lacks); return the
    names the engine could not read back (unverified)."""
    missing = sorted(name for name in sent if name not in held)
    unverified = sorted(name for name in sent if name in held and held[name] is None)
    differing = sorted(name for name in sent if held.get(name) is not None and held[name] != sent[name])
    if differing or missing:
        names = differing + missing
        shown = ", ".join(names[:MAX_NAMES_SHOWN]) + (f" (and {len(names) - MAX_NAMES_SHOWN} more)"
                                                      if len(names) > MAX_NAMES_SHOWN else "")
        raise WeightSyncMismatch(
            f"after pushing weight version {version}, the engine at {url} holds {len(differing)} tensor(s) that differ "
            f"from the trainer's{f' and lacks {len(missing)}' if missing else ''}: {shown}. The engine would sample "
            "from weights that are not the policy's; the run stops (--weight-check-every sets how often this is "
            "checked; docs/vllm.md, 'Post-sync check')", names)
    return unverified


def verify_engine_weights(engine, sent: dict[str, str], *, url: str, version: int) -> dict:
    """Compare `sent` with the engine's digests of the same names; returns {"checked", "unverified"}.
    An engine without `weight_digests` is skipped with a warning."""
    digests = getattr(engine, "weight_digests", None)
    if digests is None:
        logger.warning("engine %s (%s) cannot report weight digests; the post-sync check is skipped", url,
                       type(engine).__name__)
        return {"checked": 0, "unverified": len(sent)}
    unverified = compare_digests(sent, digests(sorted(sent)), url=url, version=version)
    if unverified:
        logger.warning("post-sync check of %s: %d tensor(s) could not be read back from the engine (e.g. %s); "
                       "they are unverified", url, len(unverified), unverified[0])
    return {"checked": len(sent) - len(unverified), "unverified": len(unverified)}
