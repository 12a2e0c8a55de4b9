"""Weight versions only move forward on a server (replayed or stale buckets get 409).

One weight update is several buckets sent in order, all with the update's `version`, numbered
by `bucket` (0, 1, ...) and the last one marked `final`; the engine serves `version` once the
final bucket is loaded. A bucket is accepted only when

- its version is newer than the version the engine serves (an older or equal one is a replay of a
  finished update, or a stale sender), and
- it comes after the last accepted bucket of the unfinished update: a lower version, or the same
  version with a bucket number at or below the last one, is a replay within the update.

A newer version starts a new update (an unfinished one is abandoned; the new update rewrites
every parameter). Senders without bucket numbers (older clients) are checked by version only.

Each sender names itself in every bucket (`sender`, a random id per client). A 409 answer carries the last
accepted bucket with its sender, so a client that retried a bucket whose first attempt landed (only the answer
was lost) recognizes its own bucket (`is_own_accepted_bucket`) and another sender's bucket of the same version
and number is never taken for its own: a second run attached to a server that an earlier run pushed to would
otherwise skip its push silently and leave the earlier run's weights served.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional



class StaleWeightsError(Exception):
    """A replayed or stale bucket (HTTP 409); `fields`: the server's version and last accepted bucket."""

    def __init__(self, message: str, fields: dict):
        super().__init__(message)
        self.fields = fields


@dataclass(frozen=True)
class AcceptedBucket:
    version: int
    bucket: Optional[int]
    final: bool
    sender: Optional[str] = None
    """The sending client's id (None from older senders)."""

    def as_dict(self) -> dict:
        return {"version": self.version, "bucket": self.bucket, "final": self.final, "sender": self.sender}


class WeightVersionGate:
    """Orders the buckets one server accepts (see the module docstring). `admit` and `record` run
    under `lock`, held across the load of the bucket in between."""

    def __init__(self):
        self.lock = threading.Lock()
        self.last: Optional[AcceptedBucket] = None

    def admit(self, header: dict, served_version: int, *, where: str) -> None:
        """Raise StaleWeightsError unless the bucket `header` describes may be loaded now."""
        version, bucket = header["version"], header.get("bucket")
        last = self.last
        fields = {"weight_version": str(served_version), "last_accepted": last.as_dict() if last else None}
        if version <= served_version:
            raise StaleWeightsError(f"{where}: weight version {version} is not newer than the version this server "
                                    f"serves ({served_version}); versions only move forward (a replayed or stale "
                                    f"update){_other_sender_hint(header, last)}", fields)
        if last is None or last.final:
            return
        if version < last.version or (version == last.version and bucket is not None and last.bucket is not None
                                      and bucket <= last.bucket):
            raise StaleWeightsError(f"{where}: bucket {bucket} of weight version {version} comes after bucket "
                                 f"{last.bucket} of version {last.version} was accepted; a bucket is sent once, "
                                    "in order (a replayed or stale bucket)", fields)

    def record(self, header: dict) -> None:
        self.last = AcceptedBucket(header["version"], header.get("bucket"), header["final"], header.get("sender"))


def _other_sender_hint(header: dict, last: Optional[AcceptedBucket]) -> str:
    """The likely cause when the served version came from another sender than this bucket's."""
    sender = header.get("sender")
    if sender is None or last is None or last.sender is None or last.sender == sender:
        return ""
    return ("; it was pushed by another sender: an earlier run attached to this server (a new run numbers its "
            "pushes from 1), or a process of a run that has ended. Start a fresh server for a new run (restart "
            "`stacx serve`)")


def is_own_accepted_bucket(answer: object, *, version: int, bucket: int, sender: Optional[str]) -> bool:
    """Whether a 409 answer says this very bucket, from this very sender, was the last one the server accepted:
    the sender's earlier attempt landed and only its answer was lost (a client retry). Another sender's bucket
    of the same version and number is not (an earlier run's push would otherwise stand in for this run's)."""
    last = answer.get("last_accepted") if isinstance(answer, dict) else None
    return (isinstance(last, dict) and last.get("version") == version and last.get("bucket") == bucket
            and last.get("sender") == sender)
