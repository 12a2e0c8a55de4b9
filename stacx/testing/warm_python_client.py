"""The warm-python client's half of the protocol (standard library only: the client runs with `-I -S`).

`run(socket_path, request)` sends the request with this process's standard streams to the zygote
(stacx/testing/warm_python.py), forwards signals to the child it forks, and returns the child's exit
status (negative: the signal that ended it), or None when no zygote answers (the caller runs cold)."""

import array
import json
import os
import signal
import socket
import struct

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def send_message(sock, payload, fds=()):
    """One message: a 4-byte length, then JSON; `fds` ride along as SCM_RIGHTS."""
    data = json.dumps(payload).encode()
    message = struct.pack("!I", len(data)) + data
    if fds:
        sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(message)


def _recv_exact(sock, size, fds):
    chunks, received = [], 0
    while received < size:
        if fds is None:
            data = sock.recv(size - received)
        else:
            data, ancdata, _, _ = sock.recvmsg(size - received, socket.CMSG_SPACE(16 * array.array("i").itemsize))
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    numbers = array.array("i")
                    numbers.frombytes(cdata[:len(cdata) - (len(cdata) % numbers.itemsize)])
                    fds.extend(numbers)
        if not data:
            raise ConnectionError("warm python: the peer closed the connection")
        chunks.append(data)
        received += len(data)
    return b"".join(chunks)


def recv_message(sock, fds=None):
    """The next message; file descriptors sent with it are appended to `fds` (a list) when given."""
    (size,) = struct.unpack("!I", _recv_exact(sock, 4, fds))
    return json.loads(_recv_exact(sock, size, fds))


def _standard_fds():
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(os.open(os.devnull, os.O_RDWR))
    return fds


def run(socket_path, request):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
    except OSError:
        return None
    pending = []
    child = {}

    def forward(signum, _frame):
        if "pid" in child:
            try:
                os.kill(child["pid"], signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    try:
        send_message(sock, request, _standard_fds())
        child["pid"] = recv_message(sock)["pid"]
    except (OSError, ConnectionError, ValueError):
        return None  # nothing was forked: run cold
    for signum in pending:
        forward(signum, None)
    try:
        code = recv_message(sock)["exit"]
    except (OSError, ConnectionError, ValueError) as error:
        os.write(2, f"warm python: lost the zygote while child {child['pid']} ran ({error})\n".encode())
        return 1
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code
