"""Every built-in SWE task is a real bug with real tests: on the snapshot its FAIL_TO_PASS tests fail and its
PASS_TO_PASS tests pass; with the reference patch applied (by `patch`, in the sandbox) all of them pass.
The reward path (test patch, test command, log parsing) is run for one task of every family."""

import dataclasses
import json

import pytest

from stacx.rollout.rewards import compute_rewards
from stacx.sandbox import SandboxConfig, SandboxLimits, build_sandbox
from stacx.tasks.swe import FAMILIES, builtin_swe_tasks, evaluate_patch, evaluate_session
from stacx.tasks.swe.evaluate import files_tarball
from stacx.tasks.swe.log_parsers import parse_unittest
from stacx.tasks.swe.reward import sandbox_for, swe_tests_reward

LIMITS = SandboxLimits(wall_time_s=60, cpu_time_s=20, memory_bytes=512 << 20)
"""The wall time is a guard only: a loaded machine slows the sandbox's start-up, never the checks."""

# Runs inside the sandbox: for every task and both states, materialise the repository, apply the test patch
# (and, for 'fixed', the reference patch) with `patch`, and run its unittest suite in this one interpreter.
_CHECK_ALL = r"""
import io, json, os, subprocess, sys, unittest
for task in json.load(sys.stdin):
    for state in ("buggy", "fixed"):
        root = os.path.join("/tmp", task["id"], state)
        for path, text in task["files"].items():
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            open(os.path.join(root, path), "w").write(text)
        for diff in [task["test_patch"]] + ([task["patch"]] if state == "fixed" else []):
            subprocess.run(["patch", "-p1", "--batch", "--quiet", "-d", root], input=diff.encode(), check=True)
        sys.path.insert(0, root)
        stream = io.StringIO()
        unittest.TextTestRunner(stream=stream, verbosity=2).run(unittest.TestLoader().discover(root, top_level_dir=root))
        sys.path.remove(root)
        for name in [m for m in sys.modules if m.split(".")[0] in ("tests", task["package"])]:
            del sys.modules[name]
        print(f"=== {task['id']} {state}\n{stream.getvalue()}")
"""


@pytest.fixture(scope="module")
def sandbox():
    return build_sandbox(SandboxConfig(backend="namespace", limits=LIMITS))


def test_every_task_fails_on_its_snapshot_and_its_reference_fix_resolves_it(sandbox):
    tasks = builtin_swe_tasks()
    assert len(tasks) >= 30 and len({t.instance_id for t in tasks}) == len(tasks)
    assert {t.metadata["family"] for t in tasks} == {f.name for f in FAMILIES} and len(FAMILIES) >= 6
    job = [{"id": t.instance_id, "files": t.snapshot, "test_patch": t.test_patch, "patch": t.reference_patch,
            "package": t.instance_id.split("__")[0]} for t in tasks]
    with sandbox.create(files_tarball({"README": "every built-in task, checked in /tmp\n"})) as session:
        result = session.run(["python3", "-c", _CHECK_ALL], stdin=json.dumps(job).encode())
    assert result.ok, result.stderr[-3000:]
    logs = {}
    for block in result.stdout.split("=== ")[1:]:
        header, log = block.split("\n", 1)
        instance_id, state = header.split(" ")
        logs[(instance_id, state)] = log
    for task in tasks:
        buggy, fixed = parse_unittest(logs[(task.instance_id, "buggy")]), parse_unittest(logs[(task.instance_id, "fixed")])
        for test in task.fail_to_pass:
            assert buggy.get(test) in ("failed", "error"), (task.instance_id, test, buggy)
            assert fixed.get(test) == "passed", (task.instance_id, test, fixed)
        for test in task.pass_to_pass:
            assert buggy.get(test) == "passed" and fixed.get(test) == "passed", (task.instance_id, test, buggy, fixed)


def test_edits_to_the_hidden_tests_are_not_rewarded(sandbox, tmp_path):
    """Through a folder snapshot and a session (the multi-turn path: edits made by commands)."""
    task = builtin_swe_tasks()[0]
    for path, text in task.snapshot.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    task = dataclasses.replace(task, snapshot=str(tmp_path))
    with sandbox.create(task.snapshot) as session:
        # The agent writes its own "regression" tests that pass on the buggy code: they are replaced.
        fake = "import unittest\nclass TestRegression(unittest.TestCase):\n" + "".join(
            f"    def {test.rsplit('.', 1)[1]}(self):\n        pass\n" for test in task.fail_to_pass)
        assert session.run("cat > tests/test_regression.py", stdin=fake.encode()).ok
        evaluation = evaluate_session(task, session, sandbox, limits=LIMITS)
    assert not evaluation.resolved and evaluation.error is None and evaluation.dropped == ("tests/test_regression.py",)
    assert {evaluation.test_statuses[t] for t in task.fail_to_pass} <= {"failed", "error"}
    assert all(evaluation.test_statuses[t] == "passed" for t in task.pass_to_pass)


def test_the_reward_resolves_one_task_of_every_family_and_zeroes_a_patch_that_does_not_apply():
    """The registered reward, through compute_rewards (concurrent calls, bounded by max_concurrent_runs)."""
    by_family = {}
    for task in builtin_swe_tasks():
        by_family.setdefault(task.metadata["family"], task)
    tasks = list(by_family.values()) + [builtin_swe_tasks()[-1]]
    setting = {"backend": "namespace", "max_concurrent_runs": 2, "limits": LIMITS.to_dict()}
    responses = [f"Here is the fix:\n```diff\n{task.reference_patch}```\n" for task in tasks[:-1]]
    responses.append("```diff\n--- a/nowhere.py\n+++ b/nowhere.py\n@@ -1 +1 @@\n-x\n+y\n```")
    results = compute_rewards(swe_tests_reward, responses, [t.instance_id for t in tasks],
                              [{"swe_task": t.to_row(), "sandbox": setting} for t in tasks])
    assert [r.error for r in results] == [None] * len(tasks)
    assert [r.reward for r in results] == [1.0] * len(FAMILIES) + [0.0]
    assert sandbox_for(setting).slots.peak_running <= 2
    evaluation = evaluate_patch(tasks[-1], responses[-1], sandbox_for(setting))  # why the last one got 0.0
    assert not evaluation.resolved and "does not apply" in evaluation.error
