"""A session's fresh working copy: a folder copied, or a tarball unpacked, into the session's directory.

Tarballs are checked member by member before anything is written (no absolute paths, no `..`, no
links, devices or FIFOs), since a remote client sends them; so are their sizes: a snapshot whose
members declare more bytes than `SandboxLimits.max_disk_bytes`, or that has more members than
`max_inodes`, is refused while its headers are read (a tar bomb is never unpacked, and a member's
data past the first over-limit header is never even decompressed).
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from typing import Optional

from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.protocol import Source


class SnapshotTooLargeError(ValueError):
    """A snapshot past the session's disk or inode bound; the message names the SandboxLimits field."""


def _too_large(amount: str, field: str, bound: int) -> SnapshotTooLargeError:
    return SnapshotTooLargeError(f"the working-copy snapshot holds {amount}, over SandboxLimits.{field} = {bound} "
                                 f"(refused before unpacking); raise sandbox.limits.{field} for a larger repository")


def _check_member(member: tarfile.TarInfo) -> None:
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"working-copy tarball member {member.name!r} points outside the working copy")
    if not (member.isfile() or member.isdir()):
        raise ValueError(f"working-copy tarball member {member.name!r} is not a regular file or folder "
                         "(links, devices and FIFOs are refused)")


def _checked_members(archive: tarfile.TarFile, limits: Optional[SandboxLimits]) -> list[tarfile.TarInfo]:
    """Every member, each checked as its header is read; stops at the first member past a bound."""
    members, total = [], 0
    while (member := archive.next()) is not None:
        _check_member(member)
        members.append(member)
        total += member.size if member.isfile() else 0
        if limits is not None and len(members) > limits.max_inodes:
            raise _too_large(f"more than {limits.max_inodes} members", "max_inodes", limits.max_inodes)
        if limits is not None and total > limits.max_disk_bytes:
            raise _too_large(f"at least {total} bytes", "max_disk_bytes", limits.max_disk_bytes)
    return members


def _extract(archive: tarfile.TarFile, destination: Path, limits: Optional[SandboxLimits]) -> None:
    members = _checked_members(archive, limits)
    for member in members:
        target = destination / member.name
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with archive.extractfile(member) as data, open(target, "wb") as out:
            shutil.copyfileobj(data, out)
        os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)


def _check_folder(path: Path, limits: SandboxLimits) -> None:
    """The same bounds for a folder source, measured before copying (entries and bytes of regular files)."""
    entries = total = 0
    for parent, dirs, files in os.walk(path):
        entries += len(dirs) + len(files)
        if entries > limits.max_inodes:
            raise _too_large(f"more than {limits.max_inodes} files and folders", "max_inodes", limits.max_inodes)
        for name in files:
            total += os.lstat(os.path.join(parent, name)).st_size
        if total > limits.max_disk_bytes:
            raise _too_large(f"at least {total} bytes", "max_disk_bytes", limits.max_disk_bytes)


def make_working_copy(source: Source, destination: Path, limits: Optional[SandboxLimits] = None) -> None:
    """Fill the empty folder `destination` with a copy of `source` (folder, .tar[.gz] file or tarball bytes);
    with `limits`, a source past `max_disk_bytes` or `max_inodes` is refused (SnapshotTooLargeError) before
    anything is written."""
    try:
        if isinstance(source, (bytes, bytearray)):
            with tarfile.open(fileobj=io.BytesIO(bytes(source)), mode="r:*") as archive:
                _extract(archive, destination, limits)
            return
        path = Path(source)
        if path.is_dir():
            if limits is not None:
                _check_folder(path, limits)
            shutil.copytree(path, destination, symlinks=True, dirs_exist_ok=True)
        elif path.is_file() and tarfile.is_tarfile(path):
            with tarfile.open(path, mode="r:*") as archive:
                _extract(archive, destination, limits)
        else:
            raise ValueError(f"sandbox working copy source {str(path)!r} is neither a folder nor a tarball "
                             "(.tar, .tar.gz)")
    except tarfile.TarError as err:
        raise ValueError(f"the working-copy tarball cannot be read: {err}") from None
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):  # the session's bounded file system is full
            raise SnapshotTooLargeError(f"the working-copy snapshot does not fit the session's file system ({err}); "
                                        "raise sandbox.limits.max_disk_bytes or sandbox.limits.max_inodes") from None
        raise


def pack_folder(folder: Source) -> bytes:
    """A gzip tarball of `folder`'s contents (paths relative to it): what the remote backend uploads."""
    if isinstance(folder, (bytes, bytearray)):
        return bytes(folder)
    path = Path(folder)
    if path.is_file():
        return path.read_bytes()
    if not path.is_dir():
        raise ValueError(f"sandbox working copy source {str(path)!r} is neither a folder nor a tarball")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for entry in sorted(path.rglob("*")):
            if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
                continue  # the receiving side refuses links; a working copy holds files and folders
            archive.add(entry, arcname=str(entry.relative_to(path)), recursive=False)
    return buffer.getvalue()


def give_to(folder: Path, uid: int, gid: int) -> None:
    """chown -R: the sandbox's user owns its working copy (used when the host runs as root)."""
    os.chown(folder, uid, gid)
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            os.chown(os.path.join(parent, name), uid, gid, follow_symlinks=False)
