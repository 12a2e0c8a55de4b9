"""The resource limits of one sandboxed command, and how they become setrlimit values.

Each limit is enforced by the kernel inside the sandbox (setrlimit through `prlimit`), except the
wall time and the output cap, which the host enforces while it reads the command's pipes:

    wall_time_s       host timer; the whole process tree is killed when it expires (`timed_out`)
    cpu_time_s        RLIMIT_CPU: SIGXCPU, then SIGKILL one second later, per process
    memory_bytes      RLIMIT_AS: allocations past it fail (MemoryError, ENOMEM), per process
    max_processes     RLIMIT_NPROC inside the sandbox's own user namespace (and, where the kernel
                      has a per-namespace pid_max, the PID namespace's pid_max)
    max_file_bytes    RLIMIT_FSIZE: a write past it fails with EFBIG (SIGXFSZ is ignored)
    max_output_bytes  host: stdout and stderr are each kept up to this many bytes; a command that
                      writes more is killed (`output_truncated`, `killed`)
    max_disk_bytes    a session's bytes on disk: a snapshot larger than this is refused before anything
                      is written; the session's file system (a tmpfs of this size where the host may
                      mount one, see stacx.sandbox.disk) refuses writes past it (ENOSPC)
    max_inodes        a session's files and folders: a snapshot with more members is refused before
                      anything is written; the session's tmpfs has this many inodes (ENOSPC past it)

The two session bounds are read from the sandbox's default limits when the session is created (a
session's file system outlives its commands); the other limits apply per command.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Limits of one `SandboxSession.run` call; every field must be > 0."""

    wall_time_s: float = 60.0
    """Seconds from start until the whole process tree is killed (`RunResult.timed_out`)."""
    cpu_time_s: int = 60
    """CPU seconds each process may use (RLIMIT_CPU)."""
    memory_bytes: int = 1 << 30
    """Address space of each process (RLIMIT_AS), in bytes."""
    max_processes: int = 64
    """Processes and threads the sandbox may hold at once (RLIMIT_NPROC in its user namespace)."""
    max_file_bytes: int = 64 << 20
    """Largest file a process may write (RLIMIT_FSIZE), in bytes."""
    max_output_bytes: int = 1 << 20
    """Bytes of stdout, and of stderr, kept; a command that writes more is killed."""
    max_open_files: int = 256
    """File descriptors per process (RLIMIT_NOFILE)."""
    max_disk_bytes: int = 1 << 30
    """Bytes a session may hold on disk: its working copy, and /tmp and /dev/shm where they are the session's
    (a snapshot larger than this is refused before it is unpacked; stacx.sandbox.disk says how the rest is
    kept). Read from the sandbox's default limits when a session is created."""
    max_inodes: int = 100_000
    """Files and folders a session may hold, counted as `max_disk_bytes` is (a snapshot with more members is
    refused before it is unpacked). Read from the sandbox's default limits when a session is created."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{field.name} must be a number > 0, got {value!r}")

    @classmethod
    def from_dict(cls, values: dict) -> "SandboxLimits":
        """Limits from a mapping (a config section or a JSON body); unknown keys are named in the error."""
        refuse_unknown_keys(cls, values, what="sandbox limit", known_as="known limits")
        return cls(**values)

    def to_dict(self) -> dict:
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def tmp_bytes(self) -> int:
        """Size of a command's private /tmp (and bubblewrap's /dev/shm) where it is a per-command tmpfs: four
        largest files, at least 1 MiB, at most the session's disk bound."""
        return min(int(self.max_disk_bytes), max(1 << 20, 4 * int(self.max_file_bytes)))

    def prlimit_args(self) -> list[str]:
        """`prlimit` options that set every kernel-enforced limit, soft = hard so a command cannot raise it (the
        CPU hard limit is one second later, so SIGXCPU comes first)."""
        return [f"--cpu={int(self.cpu_time_s)}:{int(self.cpu_time_s) + 1}", f"--as={int(self.memory_bytes)}",
                f"--nproc={int(self.max_processes)}", f"--fsize={int(self.max_file_bytes)}",
                f"--nofile={int(self.max_open_files)}", "--core=0"]


def refuse_unknown_keys(cls, values, *, what: str, known_as: str) -> None:
    """ValueError naming the keys of `values` that are no field of the dataclass `cls`, and the known ones."""
    known = {field.name for field in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(unknown)}; {known_as}: {', '.join(sorted(known))}")
