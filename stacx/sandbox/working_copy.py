"""A session's fresh working copy: a folder copied, or a tarball unpacked, into the session's directory.

Tarballs are checked member by member before anything is written (no absolute paths, no `..`, no
links, devices or FIFOs), since a remote client sends them.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from stacx.sandbox.protocol import Source


def _check_member(member: tarfile.TarInfo) -> None:
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"working-copy tarball member {member.name!r} points outside the working copy")
    if not (member.isfile() or member.isdir()):
        raise ValueError(f"working-copy tarball member {member.name!r} is not a regular file or folder "
                         "(links, devices and FIFOs are refused)")


def _extract(archive: tarfile.TarFile, destination: Path) -> None:
    members = archive.getmembers()
    for member in members:
        _check_member(member)
    for member in members:
        target = destination / member.name
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with archive.extractfile(member) as data, open(target, "wb") as out:
            shutil.copyfileobj(data, out)
        os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)


def make_working_copy(source: Source, destination: Path) -> None:
    """Fill the empty folder `destination` with a copy of `source` (folder, .tar[.gz] file or tarball bytes)."""
    if isinstance(source, (bytes, bytearray)):
        with tarfile.open(fileobj=io.BytesIO(bytes(source)), mode="r:*") as archive:
            _extract(archive, destination)
        return
    path = Path(source)
    if path.is_dir():
        shutil.copytree(path, destination, symlinks=True, dirs_exist_ok=True)
    elif path.is_file() and tarfile.is_tarfile(path):
        with tarfile.open(path, mode="r:*") as archive:
            _extract(archive, destination)
    else:
        raise ValueError(f"sandbox working copy source {str(path)!r} is neither a folder nor a tarball (.tar, .tar.gz)")


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
