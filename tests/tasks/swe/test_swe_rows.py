"""The SWE row format (SWE-bench's keys, JSON-encoded test lists, folder and tarball snapshots), the log
parsers, and the diff helpers; in process, no sandbox."""

import json
import tarfile

import pytest

from stacx.rollout.rewards import REWARD_FUNCTIONS, resolve_reward_fn
from stacx.tasks.swe import SweTask, builtin_swe_tasks, extract_patch, files_touched, get_swe_task, swe_prompt_rows
from stacx.tasks.swe.log_parsers import parse_pytest, parse_unittest
from stacx.tasks.swe.reward import swe_tests_reward


def _row(**overrides):
    row = {"instance_id": "demo__1", "problem_statement": "x is wrong", "snapshot": {"pkg/x.py": "X = 1\n"},
           "test_command": "python3 -m unittest -v", "FAIL_TO_PASS": json.dumps(["tests.t.T.test_a"]),
           "PASS_TO_PASS": [], "patch": "--- a/pkg/x.py\n+++ b/pkg/x.py\n", "repo": "demo/demo"}
    row.update(overrides)
    return row


def test_a_swe_bench_style_row_round_trips():
    task = SweTask.from_row(_row())
    assert task.fail_to_pass == ("tests.t.T.test_a",) and task.metadata == {"repo": "demo/demo"}
    assert SweTask.from_row(task.to_row()) == task


@pytest.mark.parametrize("overrides, message", [
    ({"FAIL_TO_PASS": "[not json"}, "FAIL_TO_PASS is a string but not a JSON list"),
    ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
    ({"log_format": "nose"}, "log_format 'nose' is not one of pytest, unittest"),
    ({"snapshot": "no/such/folder"}, "neither a folder nor a tarball"),
    ({"snapshot": {"../escape.py": ""}}, "must be relative"),
    ({"snapshot": 5}, "snapshot must be a repository folder, a .tar/.tar.gz file or a {path: text} mapping, got int 5"),
    ({"snapshot": {"x.py": 5}}, "snapshot entries must be {relative path: file text} strings"),
    ({"snapshot": "/etc"}, r"snapshot '/etc' \(/etc\) is outside the folders snapshots may come from .*STACX_SWE_SNAPSHOT_ROOTS"),
])
def test_bad_rows_are_refused_with_the_field_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        SweTask.from_row(_row(**overrides))
    with pytest.raises(ValueError, match="lacks snapshot, test_command"):
        SweTask.from_row({"instance_id": "a", "problem_statement": "b", "FAIL_TO_PASS": ["t"]})


def test_folder_and_tarball_snapshots_give_the_original_files(tmp_path):
    (tmp_path / "repo" / "pkg").mkdir(parents=True)
    (tmp_path / "repo" / "pkg" / "x.py").write_text("X = 1\n")
    with tarfile.open(tmp_path / "repo.tar.gz", "w:gz") as archive:
        archive.add(tmp_path / "repo", arcname=".")
    for snapshot in (str(tmp_path / "repo"), str(tmp_path / "repo.tar.gz")):
        task = SweTask.from_row(_row(snapshot=snapshot))
        assert task.original_file("pkg/x.py") == "X = 1\n" and task.original_file("pkg/y.py") is None


def test_the_unittest_parser_reads_both_python_formats_and_docstrings():
    log = ("test_a (tests.t.T.test_a) ... ok\n"
           "test_b (tests.t.T)\nThe docstring line. ... FAIL\n"
           "test_c (tests.t.T.test_c) ... ERROR\n"
           "test_d (tests.t.T.test_d) ... skipped 'no'\n")
    assert parse_unittest(log) == {"tests.t.T.test_a": "passed", "tests.t.T.test_b": "failed",
                                   "tests.t.T.test_c": "error", "tests.t.T.test_d": "skipped"}


def test_the_pytest_parser_reads_the_short_summary():
    log = ("=== short test summary info ===\nPASSED tests/test_x.py::test_a\n"
           "FAILED tests/test_x.py::test_b - AssertionError: 1 != 2\nERROR tests/test_x.py::test_c\n")
    assert parse_pytest(log) == {"tests/test_x.py::test_a": "passed", "tests/test_x.py::test_b": "failed",
                                 "tests/test_x.py::test_c": "error"}


def test_diff_helpers():
    task = builtin_swe_tasks()[0]
    assert files_touched(task.test_patch) == ["tests/test_regression.py"]
    assert extract_patch(f"text\n```diff\n{task.reference_patch}```\nmore") == task.reference_patch
    assert extract_patch(task.reference_patch) == task.reference_patch


def test_prompt_rows_carry_the_task_and_unknown_builtins_are_named():
    task = get_swe_task("statkit__average")
    (row,) = swe_prompt_rows([task], sandbox={"backend": "bubblewrap"})
    assert task.problem_statement in row["prompt"] and "statkit/core.py" in row["prompt"]
    assert SweTask.from_row(row["metadata"]["swe_task"]) == task and row["metadata"]["sandbox"]["backend"] == "bubblewrap"
    assert "test_regression" not in row["prompt"]  # the hidden tests stay hidden
    with pytest.raises(ValueError, match="did you mean 'statkit__average'"):
        get_swe_task("statkit__averag")


def test_the_reward_is_found_by_import_path_and_then_by_name():
    assert resolve_reward_fn("stacx.tasks.swe.reward:swe_tests_reward") is swe_tests_reward
    assert REWARD_FUNCTIONS["swe_tests"] is swe_tests_reward


def test_snapshot_roots_come_from_the_environment(tmp_path, monkeypatch):
    (tmp_path / "repos" / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("STACX_SWE_SNAPSHOT_ROOTS", str(tmp_path / "repos"))
    assert SweTask.from_row(_row(snapshot=str(tmp_path / "repos" / "a"))).snapshot == str(tmp_path / "repos" / "a")
    with pytest.raises(ValueError, match="is outside the folders snapshots may come from"):
        SweTask.from_row(_row(snapshot=str(tmp_path / "elsewhere")))
    (tmp_path / "repos" / "link").symlink_to(tmp_path / "elsewhere")  # a link out of the root is followed
    with pytest.raises(ValueError, match="is outside the folders snapshots may come from"):
        SweTask.from_row(_row(snapshot=str(tmp_path / "repos" / "link")))
