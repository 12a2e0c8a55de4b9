"""The evaluation's trusted script: run inside the sandbox, in a fresh copy of the task's snapshot.

It uses the standard library only and is never a file of the copy: the host passes its text as
`python3 -I -S -c <this file>` and the job (a JSON object, with a per-evaluation secret) on stdin.

    judge (this script, no tested code ever runs in it)
      1. reads the job, lets go of stdin, makes itself non-dumpable (no other process of the sandbox
         can read its memory or open its descriptors through /proc);
      2. keeps the copy's test files (`is_test_path`, plus the files the host names), applies the
         agent's edits, then puts every test file back as it was: test files the edits changed are
         restored, test files they added are deleted, the agent's changes to them are listed in the
         report as dropped; then applies the hidden test patch;
      3. runs the tests in a child interpreter (`python3 -I -B`: no working directory, user site or
         PYTHON* variable on sys.path; the repository root is added after the standard library);
         the child reads the test ids on stdin and writes one JSON record per test to a pipe;
      4. prints one line on its stdout: `STACX-SWE-REPORT <secret> <report JSON>`. The child's output
         is only the report's `log`; a line it prints cannot carry the secret.

For `unittest` tasks whose command is `python3 -m unittest ...`, the child first compiles every listed
test's module from the restored files (served by a finder first on sys.meta_path), then loads each
listed test by name and records its outcome with the runner's own result object. Before any tested code
runs it notes the test framework (unittest's classes and module globals, the builtins, the import and
trace hooks, its own code); after every test it checks that nothing of it was replaced and that the test
that ran is the restored file's own code; anything else ends the run as tampered.
Other tasks run their test command in the child (with PYTHONSAFEPATH) and the log is parsed on the
host: weaker, since the tested code can print what it likes (docs/agents.md says so).
"""

import base64
import binascii
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import threading

REPORT_PREFIX = "STACX-SWE-REPORT"
LOG_CHARS = 20000
"""The end of the tests' output kept in the report."""

TEST_FOLDERS = ("tests", "test", "testing")
"""A file under a folder of one of these names is a test file (its `__init__.py` included)."""
TEST_FILE_PATTERNS = ("test*.py", "*_test.py", "conftest.py", "pytest.ini", "tox.ini")
"""A file whose name matches one of these is a test file (`test*.py` is unittest discovery's pattern)."""
SKIPPED_FOLDERS = (".git", "__pycache__")
"""Not walked when the judge looks for test files or the host for edits."""


def is_test_path(path, extra=()):
    """Whether the relative path `path` is a test file: under a test folder, named like a test module or a
    test configuration, or one of `extra` (the files of the listed tests and of the test patch)."""
    parts = path.replace(os.sep, "/").strip("/").split("/")
    if path in extra or any(part in TEST_FOLDERS for part in parts[:-1]):
        return True
    return any(fnmatch.fnmatchcase(parts[-1], pattern) for pattern in TEST_FILE_PATTERNS)


def safe_relative(path):
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and "" not in parts


def walk_files(root="."):
    """Relative paths of the regular files under `root` (links and special files left out)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_FOLDERS and not os.path.islink(os.path.join(folder, d)))
        for name in sorted(files):
            full = os.path.join(folder, name)
            if os.path.isfile(full) and not os.path.islink(full):
                found.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return found


def _hunk_counts(line):
    """(old lines, new lines) of a '@@ -a,b +c,d @@' header."""
    try:
        old, new = line.split("@@")[1].split()[:2]
        return tuple(int(part.split(",")[1]) if "," in part else 1 for part in (old, new))
    except (IndexError, ValueError):
        return 0, 0


def patch_sections(diff):
    """A unified diff split into one section per file: [(paths its headers name, text)]. Hunks are consumed
    by their line counts, so a removed line that reads '--- x' never starts a section."""
    lines, sections, current, index = diff.splitlines(True), [], [], 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("@@"):
            old, new = _hunk_counts(line)
            current.append(line)
            index += 1
            while index < len(lines) and (old > 0 or new > 0 or lines[index].startswith("\\")):
                body = lines[index]
                old -= body[:1] in (" ", "-", "\n")
                new -= body[:1] in (" ", "+", "\n")
                current.append(body)
                index += 1
            continue
        has_files = any(part.startswith(("+++ ", "@@")) for part in current)
        if (line.startswith("diff ") and (has_files or any(p.startswith("diff ") for p in current))) or \
                (line.startswith("--- ") and has_files):
            sections.append(current)
            current = []
        current.append(line)
        index += 1
    if current:
        sections.append(current)
    result = []
    for section in sections:
        paths = set()
        for line in section:
            if line.startswith("@@"):
                break
            if line.startswith(("--- ", "+++ ")):
                name = line[4:].split("\t")[0].strip()
                if name != "/dev/null":
                    paths.add(name.split("/", 1)[1] if name[:2] in ("a/", "b/") else name)
            elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
                paths.add(line.split(" ", 2)[2].strip())
            elif line.startswith("diff --git "):
                paths.update(word[2:] for word in line.split()[2:4] if word[:2] in ("a/", "b/"))
        result.append((sorted(paths), "".join(section)))
    return result


class Refused(Exception):
    """The evaluation cannot go on: the reason goes into the report's `error`."""


def _apply_patch(diff, what):
    done = subprocess.run(["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-r", "-"],
                          input=diff.encode(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise Refused(f"the {what} does not apply: {done.stdout.decode(errors='replace')[-2000:]}")


def _write(path, data):
    if os.path.lexists(path) and (os.path.isdir(path) and not os.path.islink(path)):
        raise Refused(f"{path!r} is a folder in the copy; an edit cannot make it a file")
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    if os.path.lexists(path):
        os.remove(path)
    with open(path, "wb") as out:
        out.write(data)


def apply_edits(edits, extra):
    """The agent's edits to non-test files; the test paths it touched are returned (not applied)."""
    dropped = set()
    patch = edits.get("patch") or ""
    if patch.strip():
        kept = []
        for paths, text in patch_sections(patch):
            tests = [path for path in paths if is_test_path(path, extra)]
            dropped.update(tests)
            if not tests:
                kept.append(text)
        if "".join(kept).strip():
            _apply_patch("".join(kept), "agent's patch")
    for path, encoded in sorted((edits.get("files") or {}).items()):
        if not safe_relative(path):
            raise Refused(f"the agent's edits name {path!r}, which is not a path inside the repository")
        if is_test_path(path, extra):
            dropped.add(path)
            continue
        try:
            _write(path, base64.b64decode(encoded, validate=True))
        except binascii.Error:
            raise Refused(f"the agent's edit of {path!r} is not base64") from None
    for path in sorted(edits.get("deleted") or ()):
        if not safe_relative(path):
            raise Refused(f"the agent's edits delete {path!r}, which is not a path inside the repository")
        if is_test_path(path, extra):
            dropped.add(path)
        elif os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
    return dropped


def restore_tests(originals, extra):
    """Every test file back as the snapshot had it; test files the snapshot had not are deleted."""
    changed = set()
    for path in walk_files():
        if is_test_path(path, extra) and path not in originals:
            os.remove(path)
            changed.add(path)
    for path, data in originals.items():
        current = None
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, "rb") as file:
                current = file.read()
        if current != data:
            _write(path, data)
            changed.add(path)
    for folder, dirs, _ in os.walk("."):
        if "__pycache__" in dirs:  # no bytecode of the agent's is loaded instead of a restored source
            dirs.remove("__pycache__")
            shutil.rmtree(os.path.join(folder, "__pycache__"), ignore_errors=True)
    return changed


def make_non_dumpable():
    """PR_SET_DUMPABLE 0: /proc/<judge>/{mem,fd,environ} become unreadable to the sandbox's other processes
    (they hold no capability); Refused when the interpreter cannot do it."""
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    except (ImportError, OSError, AttributeError) as error:
        raise Refused(f"the judge cannot make itself non-dumpable ({error}); the sandbox's python3 needs ctypes "
                      "on Linux") from None


# ---- the child: runs the tests (tested code runs here, never in the judge) ----

def _child_path_setup():
    """The repository root on sys.path after the standard library (before site-packages), so a module of
    the repository never shadows one of the standard library."""
    root = os.getcwd()
    site = [i for i, entry in enumerate(sys.path) if entry.endswith(("site-packages", "dist-packages"))]
    sys.path.insert(site[0] if site else len(sys.path), root)


def _framework_state(owners, modules):
    import builtins
    state = {}
    for label, owner in owners:
        if hasattr(owner, "__code__"):  # a function of the runner: its code and defaults
            state[(label, "__code__")], state[(label, "__defaults__")] = owner.__code__, owner.__defaults__
            continue
        for name, value in list(vars(owner).items()):
            state[(label, name)] = value
    for label, module in modules + [("builtins", builtins)]:
        for name, value in list(vars(module).items()):
            state[(label, name)] = value
    for label, function in [(k, v) for k, v in state.items() if callable(v) and hasattr(v, "__code__")]:
        state[label + ("__code__",)] = function.__code__
    return state


def _hooks():
    return {"sys.meta_path": list(sys.meta_path), "sys.path_hooks": list(sys.path_hooks),
            "sys.settrace": [sys.gettrace()], "sys.setprofile": [sys.getprofile()]}


def _hooks_changed(before):
    """Import hooks put in front of (or in place of) the ones the run started with; appended ones are allowed
    (a library such as six appends its own): they see no module an earlier finder finds."""
    now = _hooks()
    return [name for name, hooks in before.items() if now[name][:len(hooks)] != hooks]


def _framework_changes(before, owners, modules):
    after = _framework_state(owners, modules)
    class_labels = {label for label, _ in owners}
    changed = []
    for key, value in after.items():
        if key not in before:
            if key[0] in class_labels and len(key) == 2:  # a new attribute on a framework class
                changed.append(".".join(key))
        elif before[key] is not value:
            changed.append(".".join(key))
    changed += [".".join(key) for key in before if key not in after]
    return sorted(changed)


def _test_module_files(test_ids, root):
    """module name -> (file, is a package) of every listed test's module and the packages above it."""
    found = {}
    for test_id in test_ids:
        parts = test_id.split(".")
        for k in range(1, len(parts)):
            base = os.path.join(root, *parts[:k])
            if os.path.isfile(base + ".py"):
                found[".".join(parts[:k])] = (base + ".py", False)
            elif os.path.isfile(os.path.join(base, "__init__.py")):
                found[".".join(parts[:k])] = (os.path.join(base, "__init__.py"), True)
            else:
                break
    return found


SET_BY_UNITTEST = ("_classSetupFailed", "tearDown_exceptions")
"""Attributes unittest itself sets on a test class while it runs it."""


def _code_objects(code):
    found = {code}
    for constant in code.co_consts:
        if hasattr(constant, "co_consts"):
            found |= _code_objects(constant)
    return found


def preload_test_modules(test_ids, root):
    """Read and compile every listed test's module now, before any tested code runs, and put a finder first on
    sys.meta_path that serves them from that code: the tested code cannot rewrite a test module on disk (or
    through an import hook of its own) before it is imported. Returns (finder, the compiled code objects,
    the test classes' attributes as each module left them) for the integrity checks."""
    import importlib.util
    compiled, classes = {}, {}
    for name, (file, package) in _test_module_files(test_ids, root).items():
        with open(file, "rb") as source:
            compiled[name] = (file, package, compile(source.read(), file, "exec", dont_inherit=True))

    class PreloadedTests:
        def find_spec(self, name, path=None, target=None):
            if name not in compiled:
                return None
            file, package, _ = compiled[name]
            return importlib.util.spec_from_file_location(
                name, file, loader=self, submodule_search_locations=[os.path.dirname(file)] if package else None)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            exec(compiled[module.__spec__.name][2], module.__dict__)
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == module.__name__:
                    classes[value] = {k: v for k, v in vars(value).items() if k not in SET_BY_UNITTEST}

    finder = PreloadedTests()
    sys.meta_path.insert(0, finder)
    codes = set()
    for _, _, code in compiled.values():
        codes |= _code_objects(code)
    return finder, codes, classes


def test_binding_problems(test, finder, codes, classes):
    """Why `test` (a loaded TestCase) is not the restored test file's own test, or ''."""
    cls = type(test)
    module = sys.modules.get(cls.__module__)
    if module is None or getattr(getattr(module, "__spec__", None), "loader", None) is not finder:
        return f"{cls.__module__} was not loaded from the restored test file"
    now = {name: value for name, value in vars(cls).items() if name not in SET_BY_UNITTEST}
    if cls not in classes or now.keys() != classes[cls].keys() or \
            any(now[name] is not value for name, value in classes[cls].items()):
        return f"{cls.__qualname__} was changed after its module ran"
    method = getattr(cls, getattr(test, "_testMethodName", ""), None)
    if getattr(method, "__code__", None) not in codes:
        return f"{cls.__qualname__}.{getattr(test, '_testMethodName', '?')} is not the test file's code"
    return ""


def run_unittest_child(report_fd):
    test_ids = json.loads(sys.stdin.read())
    sys.stdin.close()
    report = os.fdopen(report_fd, "w", buffering=1)
    _child_path_setup()
    finder, codes, classes = preload_test_modules(test_ids, os.getcwd())
    import unittest
    import unittest.case
    import unittest.loader
    import unittest.result
    import unittest.suite
    import unittest.util

    class Recorder(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.successes = 0

        def addSuccess(self, test):
            super().addSuccess(test)
            self.successes += 1

    def outcome(result):
        if result.errors or result.testsRun > 1:
            return "error"
        if result.failures or result.unexpectedSuccesses:
            return "failed"
        if result.skipped:
            return "skipped"
        return "passed" if result.testsRun == 1 and result.successes + len(result.expectedFailures) == 1 else "missing"

    owners = [("unittest.TestCase", unittest.case.TestCase), ("unittest.case._Outcome", unittest.case._Outcome),
              ("unittest.TestResult", unittest.result.TestResult), ("unittest.TestSuite", unittest.suite.TestSuite),
              ("unittest.BaseTestSuite", unittest.suite.BaseTestSuite),
              ("unittest.TestLoader", unittest.loader.TestLoader), ("Recorder", Recorder)]
    modules = [("unittest.case", unittest.case), ("unittest.result", unittest.result),
               ("unittest.suite", unittest.suite), ("unittest.loader", unittest.loader),
               ("unittest.util", unittest.util), ("judge", sys.modules["__main__"])]
    state, hooks = _framework_state(owners, modules), _hooks()
    changes, hooks_changed, binding = _framework_changes, _hooks_changed, test_binding_problems
    failed_import = unittest.loader._FailedTest  # what a test module that does not import becomes: an error

    def flatten(test):
        if isinstance(test, unittest.suite.BaseTestSuite):
            return [case for inner in list(test._tests) for case in flatten(inner)]
        return [test]

    owners += [("runner.outcome", outcome), ("runner.flatten", flatten)]
    state = _framework_state(owners, modules)
    loader, write, dumps = unittest.TestLoader(), report.write, json.dumps
    for test_id in test_ids:
        result, problem = Recorder(), ""
        try:
            test = loader.loadTestsFromName(test_id)
            cases = [case for case in flatten(test) if type(case) is not failed_import]
            problem = next(filter(None, (binding(case, finder, codes, classes) for case in cases)), "")
            test.run(result)
            status = outcome(result)
            problem = problem or next(filter(None, (binding(case, finder, codes, classes) for case in cases)), "")
        except BaseException as error:  # noqa: BLE001 - a test that kills its loader is an error
            status = "error"
            if isinstance(error, KeyboardInterrupt):
                raise
        changed = changes(state, owners, modules) + hooks_changed(hooks) + ([problem] if problem else [])
        if changed:
            write(dumps({"tampered": changed[:20]}) + "\n")
            os._exit(0)
        write(dumps({"test": test_id, "status": status}) + "\n")
    write(dumps({"done": True}) + "\n")
    report.flush()
    os._exit(0)


def run_command_child(command):
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    os.execve("/bin/sh", ["sh", "-c", command], env)


# ---- the judge ----

def _read_all(stream, keep, limit):
    size = 0
    for chunk in iter(lambda: stream.read(65536), b""):
        keep.append(chunk)
        size += len(chunk)
        while size > 4 * limit and len(keep) > 1:
            size -= len(keep.pop(0))


def run_tests(job):
    """Start the child, feed it the test ids, collect its records and output: (records, log, exit status,
    whether it was killed for time)."""
    source = job["judge_source"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    read_end, write_end = os.pipe()
    if job["runner"] == "unittest":
        argv = [sys.executable, "-I", "-B", "-c", source, "unittest-child", str(write_end)]
    else:
        argv = [sys.executable, "-I", "-S", "-c", source, "command-child", job["test_command"]]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             pass_fds=(write_end,), env=env, start_new_session=True)
    os.close(write_end)
    log_chunks, records = [], []
    reader = threading.Thread(target=_read_all, args=(child.stdout, log_chunks, LOG_CHARS), daemon=True)
    reader.start()
    timer = threading.Timer(job["timeout_s"], lambda: os.killpg(child.pid, 9))
    timer.start()
    try:
        try:
            child.stdin.write(json.dumps(job["tests"]).encode())
            child.stdin.close()
        except BrokenPipeError:
            pass
        with os.fdopen(read_end, "rb") as stream:
            for line in stream:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    records.append({"garbled": line[:200].decode(errors="replace")})
        child.wait()
    finally:
        timed_out = not timer.is_alive() and child.returncode in (-9, None)
        timer.cancel()
        try:
            os.killpg(child.pid, 9)
        except OSError:
            pass
    reader.join(5)
    log = b"".join(log_chunks).decode(errors="replace")[-LOG_CHARS:]
    return records, log, child.returncode, timed_out


def export():
    """Run in the agent's session: the regular files that differ from the snapshot's (the manifest on stdin:
    {path: sha256}), base64, and the snapshot's files that are gone, as one JSON object on stdout."""
    import hashlib
    manifest = json.loads(sys.stdin.read())
    changed, seen = {}, set()
    for path in walk_files():
        with open(path, "rb") as file:
            data = file.read()
        seen.add(path)
        if manifest.get(path) != hashlib.sha256(data).hexdigest():
            changed[path] = base64.b64encode(data).decode()
    sys.stdout.write(json.dumps({"files": changed, "deleted": sorted(set(manifest) - seen)}))


def judge():
    job = json.loads(sys.stdin.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the job's pipe is gone; fd 0 stays taken
    secret = job.pop("secret")
    report = {"dropped": [], "restored": [], "statuses": {}, "error": None, "log": "", "runner": job["runner"]}
    try:
        make_non_dumpable()
        extra = set(job["test_files"])
        originals = {}
        for path in walk_files():
            if is_test_path(path, extra):
                with open(path, "rb") as file:
                    originals[path] = file.read()
        report["dropped"] = sorted(apply_edits(job["edits"], extra))
        report["restored"] = sorted(restore_tests(originals, extra))
        if job["test_patch"].strip():
            _apply_patch(job["test_patch"], "test patch")
        records, log, exit_code, timed_out = run_tests(job)
        report["log"], report["exit_code"] = log, exit_code
        if job["runner"] == "unittest":
            for record in records:
                if "test" in record and record.get("status") in ("passed", "failed", "error", "skipped", "missing"):
                    report["statuses"].setdefault(record["test"], record["status"])
            tampered = [record["tampered"] for record in records if "tampered" in record]
            if tampered:
                report["error"] = "the test framework was modified while the tests ran: " + ", ".join(tampered[0])
            elif timed_out:
                report["error"] = f"the tests ran past {job['timeout_s']} s and were killed"
            elif not any(record.get("done") for record in records):
                report["error"] = f"the test run ended before its last test (exit status {exit_code})"
            elif any("garbled" in record for record in records):
                report["error"] = "the test run's report holds lines that are not the runner's"
        elif timed_out:
            report["error"] = f"the tests ran past {job['timeout_s']} s and were killed"
    except Refused as refused:
        report["error"] = str(refused)
    sys.stdout.write(f"\n{REPORT_PREFIX} {secret} {json.dumps(report)}\n")
    sys.stdout.flush()


if __name__ == "__main__" and sys.argv[0] == "-c" and len(sys.argv) >= 2:
    if sys.argv[1] == "unittest-child":
        run_unittest_child(int(sys.argv[2]))
    elif sys.argv[1] == "command-child":
        run_command_child(sys.argv[2])
    elif sys.argv[1] == "judge":
        judge()
    elif sys.argv[1] == "export":
        export()
