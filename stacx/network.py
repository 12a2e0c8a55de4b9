"""Address facts shared by the servers, the engines and the Ray connection, and the private files that
hold a server's generated key."""

from __future__ import annotations

import ipaddress
import os
import stat
import tempfile


def is_loopback_host(host: str) -> bool:
    """True for a host only this machine can reach (127.0.0.0/8, ::1, 'localhost'); False for a
    wildcard (0.0.0.0, ::), any other address, or a name that is not 'localhost'."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def private_file_path(name: str) -> str:
    """`name` in $XDG_RUNTIME_DIR (private to the user), else in a stacx-UID folder of the temp folder, created
    mode 0700; PermissionError when that folder exists but is not this user's private folder (another user may
    have made it first to read what is written there)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, name)
    folder = os.path.join(tempfile.gettempdir(), f"stacx-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} is not a private folder of this user (another user may read a key "
                              "written there)")
    return os.path.join(folder, name)


def write_private_file(path: str, text: str) -> str:
    """Write `text` and a newline to `path`, mode 0600, atomically (a new file renamed over the name, so a link
    planted there is replaced, never followed). Returns the absolute path; OSError when it cannot."""
    path = os.path.abspath(path)
    handle, staged = tempfile.mkstemp(prefix=".stacx-key-", dir=os.path.dirname(path))  # O_EXCL, mode 0600
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text + "\n")
        os.replace(staged, path)
    except BaseException:
        if os.path.exists(staged):
            os.unlink(staged)
        raise
    return path
