"""The warm zygote's child (stacx/testing/warm_python.py): what a fresh interpreter would do with the
client's command line, in a process forked from the zygote: take the client's standard streams, session,
environment, folder and death, run the module, script or code as `__main__`, and exit as the interpreter
would (an uncaught error: its traceback from the program's own frames, status 1; a signal: that signal)."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading


def _rebuild_standard_streams(unbuffered: bool) -> None:
    import io

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            raw = io.FileIO(fd, mode, closefd=False)
        except OSError:
            setattr(sys, name, None)
            continue
        tty = raw.isatty()
        if mode == "r":
            stream = io.TextIOWrapper(io.BufferedReader(raw), line_buffering=tty)
        elif unbuffered or name == "stderr":
            stream = io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=True, write_through=True,
                                      errors="backslashreplace" if name == "stderr" else "strict")
        else:
            stream = io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=tty)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _die_with_client(client_pid: int) -> None:
    """A daemon thread that SIGKILLs this process's group when the client process ends (it may be SIGKILLed,
    alone or with its group): a cold process's group would have been the client's."""
    try:
        pidfd = os.pidfd_open(client_pid)
    except (OSError, AttributeError):
        return

    def watch():
        select.select([pidfd], [], [])
        os.killpg(0, signal.SIGKILL)  # this child leads its group: what it started in the group goes too

    threading.Thread(target=watch, name="warm-python-client-watch", daemon=True).start()


def _apply_python_path(environ: dict) -> None:
    """Entries of the child's PYTHONPATH the zygote lacks go first on sys.path, as at a cold start."""
    entries = [entry for entry in environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    missing = [os.path.abspath(entry) for entry in entries if os.path.abspath(entry) not in sys.path]
    sys.path[1:1] = missing


def _run_site_hook(environ: dict) -> None:
    """A cold interpreter imports the first `sitecustomize` on its path as it starts (entries of PYTHONPATH come
    before site-packages); the zygote's start-up is long past, so the first one on the child's PYTHONPATH runs
    here, before the program, with `sys.orig_argv` already the child's. An error in it is reported
    as the interpreter reports it, and the program runs anyway."""
    import importlib.util

    for entry in filter(None, environ.get("PYTHONPATH", "").split(os.pathsep)):
        path = os.path.join(os.path.abspath(entry), "sitecustomize.py")
        if not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("sitecustomize", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 (what site.py does with a failing sitecustomize)
            print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(error).__name__}: {error}",
                  file=sys.stderr)
        return


def _report_uncaught(error: BaseException) -> None:
    """`sys.excepthook` on the error, its traceback starting at the program's own frames (a cold
    interpreter's traceback has no runner frames above them)."""
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
        traceback = traceback.tb_next
    sys.excepthook(type(error), error.with_traceback(traceback), traceback)


def _run_child(request: dict, client_path: str) -> int:
    """Run the request as `__main__`; returns the exit code (a signal death re-raises the signal)."""
    import atexit
    import runpy
    import types

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _rebuild_standard_streams(request["unbuffered"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    sys.executable = client_path
    if request["warnings"]:
        import warnings

        sys.warnoptions.extend(request["warnings"])
        warnings._processoptions(request["warnings"])
    sys.orig_argv = [client_path, *request["argv"]]
    _apply_python_path(request["env"])
    _run_site_hook(request["env"])
    kind, target, args = request["kind"], request["target"], request["args"]
    code = 0
    try:
        if kind == "module":
            sys.modules["__main__"] = types.ModuleType("__main__")  # runpy runs the module in its namespace
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(target, alter_argv=True)  # what `python -m` calls
        elif kind == "code":
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt as interrupt:
        _report_uncaught(interrupt)
        code = -signal.SIGINT
    except BaseException as error:  # noqa: BLE001 (what the interpreter does with an uncaught exception)
        _report_uncaught(error)
        code = 1
    threading._shutdown()  # non-daemon threads end before atexit, as at interpreter exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001
            pass
    return code


def child_main(request: dict, fds: list[int], client_path: str) -> None:
    """In the forked child: take the client's streams, session and death, then run the command."""
    try:
        os.setsid()
        for target_fd, fd in enumerate(fds[:3]):
            os.dup2(fd, target_fd, inheritable=True)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL if signum != signal.SIGPIPE else signal.SIG_IGN)
        _die_with_client(request["client_pid"])
        code = _run_child(request, client_path)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        code = 1
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)
