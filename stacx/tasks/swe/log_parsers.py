"""Reading a test run's output: test id -> status ('passed', 'failed', 'error', 'skipped').

    unittest  `python -m unittest -v`: "test_x (tests.test_core.TestCore.test_x) ... ok" (Python 3.11+;
              older versions print "(tests.test_core.TestCore)", the method name is appended)
    pytest    `pytest -rA`: the short summary's "PASSED tests/test_core.py::test_x" lines
"""

from __future__ import annotations

import re
from typing import Callable

_UNITTEST = re.compile(r"^(?P<name>\w+) \((?P<where>[\w.]+)\)(?:\n[^\n]*?)?(?:[^\n]*?) \.\.\. "
                       r"(?P<status>ok|FAIL|ERROR|skipped|expected failure|unexpected success)", re.MULTILINE)
_UNITTEST_STATUS = {"ok": "passed", "FAIL": "failed", "ERROR": "error", "skipped": "skipped",
                    "expected failure": "passed", "unexpected success": "failed"}
_PYTEST = re.compile(r"^(?P<status>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?P<test>\S+)", re.MULTILINE)
_PYTEST_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "passed",
                  "XPASS": "failed"}


def parse_unittest(log: str) -> dict[str, str]:
    statuses = {}
    for match in _UNITTEST.finditer(log):
        name, where = match["name"], match["where"]
        test_id = where if where.endswith("." + name) else f"{where}.{name}"
        statuses[test_id] = _UNITTEST_STATUS[match["status"]]
    return statuses


def parse_pytest(log: str) -> dict[str, str]:
    return {match["test"]: _PYTEST_STATUS[match["status"]] for match in _PYTEST.finditer(log)}


LOG_PARSERS: dict[str, Callable[[str], dict[str, str]]] = {"unittest": parse_unittest, "pytest": parse_pytest}
"""log_format -> parser of the test command's output (stdout and stderr together)."""
