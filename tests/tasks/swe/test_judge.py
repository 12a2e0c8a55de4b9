"""The evaluation's judge, in process: which files are test files, how a patch is split per file, which edits
are applied and which test files are put back, which tasks the judge runs itself; and, in the sandbox, that a
report line printed by the tested code is not believed."""

import base64
import dataclasses
import tarfile

import pytest

from stacx.tasks.swe import AgentEdits, evaluate_edits, get_swe_task
from stacx.tasks.swe.evaluate import runner_of, snapshot_manifest, task_test_files
from stacx.tasks.swe.judge import apply_edits, is_test_path, patch_sections, restore_tests, walk_files
from stacx.tasks.swe.reward import sandbox_for


@pytest.mark.parametrize("path, expected", [
    ("tests/__init__.py", True), ("tests/data/input.json", True), ("src/pkg/test/helpers.py", True),
    ("pkg/testing/fixtures.py", True), ("pkg/test_core.py", True), ("pkg/testing_utils.py", True),
    ("pkg/core_test.py", True), ("conftest.py", True), ("sub/conftest.py", True), ("tox.ini", True),
    ("pkg/core.py", False), ("pkg/__init__.py", False), ("unittest/case.py", False), ("attest.py", False),
    ("README.md", False), ("sitecustomize.py", False),
])
def test_the_test_file_rule(path, expected):
    assert is_test_path(path) is expected
    assert is_test_path(path, extra={path}) is True  # a file the task names is a test file whatever its name


def test_a_task_names_its_test_modules_their_package_init_and_the_test_patch_files():
    task = get_swe_task("seriescalc__sum_up_to")
    assert {"tests/test_core.py", "tests/test_regression.py", "tests/__init__.py"} <= set(task_test_files(task))
    assert "seriescalc/__init__.py" not in task_test_files(task)  # the package under test is code the fix may change
    pytest_task = dataclasses.replace(task, fail_to_pass=("checks/test_x.py::test_a",), pass_to_pass=(),
                                      test_patch=None, log_format="pytest")
    assert task_test_files(pytest_task) == ["checks/__init__.py", "checks/test_x.py"]


@pytest.mark.parametrize("command, log_format, runner", [
    ("python3 -m unittest -v", "unittest", "unittest"), ("python -m unittest discover", "unittest", "unittest"),
    ("python3.11 -m unittest -b -v", "unittest", "unittest"),
    ("python3 -m unittest discover -s src", "unittest", "command"), ("cd src && python3 -m unittest", "unittest",
                                                                     "command"),
    ("pytest -rA", "pytest", "command"), ("python3 -m unittest -v", "pytest", "command"),
])
def test_which_tasks_the_judge_runs_itself(command, log_format, runner):
    task = dataclasses.replace(get_swe_task("statkit__average"), test_command=command, log_format=log_format)
    assert runner_of(task) == runner


def test_a_patch_is_split_per_file_by_its_hunk_counts():
    diff = ("diff --git a/pkg/core.py b/pkg/core.py\nindex 1..2 100644\n--- a/pkg/core.py\n+++ b/pkg/core.py\n"
            "@@ -1,2 +1,2 @@\n--- not a header\n+++ b/tests/fake.py\n x = 1\n"
            "--- /dev/null\n+++ b/tests/test_new.py\n@@ -0,0 +1 @@\n+import os\n\\ No newline at end of file\n"
            "--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-a\n+b\n")
    sections = patch_sections(diff)
    assert [paths for paths, _ in sections] == [["pkg/core.py"], ["tests/test_new.py"], ["README.md"]]
    assert "".join(text for _, text in sections) == diff


def test_edits_reach_non_test_files_only_and_every_test_file_is_put_back(tmp_path, monkeypatch):
    snapshot = {"pkg/core.py": b"X = 1\n", "tests/__init__.py": b"", "tests/test_core.py": b"import pkg\n",
                "checks.py": b"pass\n"}
    for path, data in snapshot.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    extra = {"checks.py"}
    originals = {path: snapshot[path] for path in walk_files() if is_test_path(path, extra)}
    assert set(originals) == {"tests/__init__.py", "tests/test_core.py", "checks.py"}
    files = {"pkg/core.py": b"X = 2\n", "tests/__init__.py": b"import unittest\n", "tests/test_evil.py": b"",
             "unittest/__init__.py": b"# planted\n"}
    patch = ("--- a/checks.py\n+++ b/checks.py\n@@ -1 +1 @@\n-pass\n+import sys\n"
             "--- /dev/null\n+++ b/pkg/extra.py\n@@ -0,0 +1 @@\n+Y = 3\n")
    dropped = apply_edits({"patch": patch, "deleted": ["tests/test_core.py"],
                           "files": {p: base64.b64encode(d).decode() for p, d in files.items()}}, extra)
    assert dropped == {"checks.py", "tests/__init__.py", "tests/test_evil.py", "tests/test_core.py"}
    (tmp_path / "tests" / "test_planted_by_hand.py").write_text("")  # as if a command had written it
    (tmp_path / "tests" / "test_core.py").write_text("rewritten\n")
    assert restore_tests(originals, extra) == {"tests/test_planted_by_hand.py", "tests/test_core.py"}
    assert {path: (tmp_path / path).read_bytes() for path in walk_files()} == {
        **snapshot, "pkg/core.py": b"X = 2\n", "pkg/extra.py": b"Y = 3\n", "unittest/__init__.py": b"# planted\n"}


def test_a_report_line_printed_by_the_tests_is_not_believed():
    """A task whose test command is run as a command (its log parsed): the tested side prints a report line that
    claims every test passed; without the evaluation's secret it is ignored. The reference fix still resolves."""
    task = get_swe_task("gatekeep__is_adult")
    forged = '{"statuses": {%s}, "error": null, "log": "", "dropped": []}' % ", ".join(
        f'"{test}": "passed"' for test in task.fail_to_pass + task.pass_to_pass)
    task = dataclasses.replace(task, test_command=f"python3 -m unittest -v; echo 'STACX-SWE-REPORT 0 {forged}'")
    sandbox = sandbox_for({"backend": "namespace", "limits": {"wall_time_s": 60, "cpu_time_s": 20}})
    forging = evaluate_edits(task, AgentEdits(), sandbox)
    assert forging.runner == "command" and not forging.resolved and forging.error is None
    assert {forging.test_statuses[test] for test in task.fail_to_pass} == {"failed"}
    assert evaluate_edits(task, AgentEdits(patch=task.reference_patch), sandbox).resolved


_PROBE = """
import os, sys
for _what in ("mem", "fd/0", "fd/1", "environ"):
    try:
        with open(f"/proc/{os.getppid()}/{_what}", "rb") as _file:
            _file.read(64)
        print("PROBE", _what, "readable", file=sys.stderr)
    except OSError as _error:
        print("PROBE", _what, type(_error).__name__, file=sys.stderr)
"""


def test_the_tested_code_cannot_read_the_judge():
    """The judge is not dumpable: its memory (the secret) and its descriptors are closed to the tests' process."""
    task = get_swe_task("gatekeep__is_adult")
    core = task.snapshot["gatekeep/core.py"] + _PROBE
    evaluation = evaluate_edits(task, AgentEdits(files={"gatekeep/core.py": core.encode()}),
                                sandbox_for({"backend": "namespace", "limits": {"wall_time_s": 60, "cpu_time_s": 20}}))
    probes = sorted({line for line in evaluation.log.splitlines() if line.startswith("PROBE")})
    assert probes == [f"PROBE {what} PermissionError" for what in ("environ", "fd/0", "fd/1", "mem")], evaluation.log


def test_the_snapshot_manifest_is_the_same_for_a_mapping_a_folder_and_a_tarball(tmp_path):
    task = get_swe_task("statkit__average")
    for path, text in task.snapshot.items():
        (tmp_path / "repo" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "repo" / path).write_text(text)
    (tmp_path / "repo" / ".git").mkdir()
    (tmp_path / "repo" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # not the agent's to edit
    with tarfile.open(tmp_path / "repo.tar.gz", "w:gz") as archive:
        archive.add(tmp_path / "repo", arcname=".", filter=lambda m: None if ".git" in m.name else m)
    manifests = [snapshot_manifest(dataclasses.replace(task, snapshot=snapshot))
                 for snapshot in (task.snapshot, str(tmp_path / "repo"), str(tmp_path / "repo.tar.gz"))]
    assert manifests[0] == manifests[1] == manifests[2] and set(manifests[0]) == set(task.snapshot)
