"""Built-in SWE tasks: small Python repositories with a real bug, real tests and the reference fix.

Each family is a bug pattern written once as a template; its variants fill the template with
another function, so every task is its own repository:

    <package>/__init__.py  <package>/core.py (the bug)  tests/__init__.py  tests/test_core.py (PASS_TO_PASS)
    README.md              test patch: tests/test_regression.py (FAIL_TO_PASS, hidden from the agent)

`builtin_swe_tasks()` builds them (30: six families of five); the reference patch is the diff from
the buggy `core.py` to the fixed one, and the problem statement quotes what the buggy code really
returns (it is run once, in process, when the statement is written).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

from stacx.tasks.swe.row import SweTask

TEST_COMMAND = "python3 -m unittest -v"


@dataclass(frozen=True)
class Variant:
    """One function with a bug: its buggy and fixed bodies and the calls that tell them apart."""

    name: str
    signature: str
    """Parameters, as in `def name(<signature>):`."""
    doc: str
    buggy: str
    """The function's body (indented 4 spaces) with the bug."""
    fixed: str
    """The body with the fix."""
    keeps: tuple[tuple[str, Any], ...]
    """(call, expected result) pairs both versions get right: PASS_TO_PASS."""
    breaks: tuple[tuple[str, Any], ...]
    """(call, expected result) pairs only the fixed version gets right: FAIL_TO_PASS. A call may be
    several statements separated by ';' (the last one's value is compared)."""
    buggy_signature: Optional[str] = None
    """The buggy version's parameters, when the bug is in them (default: `signature`)."""


@dataclass(frozen=True)
class Family:
    name: str
    package: str
    summary: str
    """What the bug is, in the problem statement's words ('{name}' is replaced)."""
    variants: tuple[Variant, ...]


def _loop(name, doc, init, op, term, reference):
    body = "    result = {init}\n    for k in range({stop}):\n        result = result {op} {term}\n    return result\n"
    return Variant(name, "n", doc, body.format(init=init, stop="1, n", op=op, term=term),
                   body.format(init=init, stop="1, n + 1", op=op, term=term),
                   keeps=((f"{name}(0)", reference(0)),),
                   breaks=((f"{name}(2)", reference(2)), (f"{name}(4)", reference(4))))


INCLUSIVE_RANGE = Family("inclusive_range", "seriescalc", "`{name}(n)` leaves out the last term, n itself.", (
    _loop("sum_up_to", "1 + 2 + ... + n.", 0, "+", "k", lambda n: n * (n + 1) // 2),
    _loop("sum_of_squares", "1 + 4 + ... + n * n.", 0, "+", "k * k", lambda n: sum(k * k for k in range(n + 1))),
    _loop("factorial", "1 * 2 * ... * n.", 1, "*", "k", lambda n: [1, 1, 2, 6, 24][n]),
    _loop("sum_of_odds", "1 + 3 + ... + (2n - 1).", 0, "+", "(2 * k - 1)", lambda n: n * n),
    _loop("sum_of_cubes", "1 + 8 + ... + n ** 3.", 0, "+", "k ** 3", lambda n: (n * (n + 1) // 2) ** 2),
))


def _threshold(name, limit, what):
    return Variant(name, "value", f"True when value is at least {limit} ({what}).", f"    return value > {limit}\n",
                   f"    return value >= {limit}\n",
                   keeps=((f"{name}({limit + 10})", True), (f"{name}({limit - 1})", False)),
                   breaks=((f"{name}({limit})", True),))


BOUNDARY = Family("boundary_comparison", "gatekeep", "`{name}` gets the boundary value itself wrong.", (
    _threshold("is_adult", 18, "age in years"), _threshold("can_vote", 16, "age in years"),
    _threshold("passes_exam", 50, "score out of 100"), _threshold("is_senior", 65, "age in years"),
    _threshold("has_quorum", 3, "members present"),
))

def _default_when_empty(name, expression, default, doc, keep):
    """`return <expression>` over `values`, fixed by returning `default` when there are none."""
    return Variant(name, "values", doc, f"    return {expression}\n",
                   f"    return {expression} if values else {default!r}\n",
                   keeps=(keep,), breaks=((f"{name}([])", default),))


EMPTY_INPUT = Family("empty_input", "statkit", "`{name}` fails on empty input instead of returning its default.", (
    _default_when_empty("average", "sum(values) / len(values)", 0.0, "The mean of values; 0.0 when there are none.",
                        ("average([2, 4])", 3.0)),
    Variant("largest", "values", "The largest of values; None when there are none.",
            "    return max(values)\n", "    return max(values, default=None)\n",
            keeps=(("largest([3, 9, 2])", 9),), breaks=(("largest([])", None),)),
    Variant("first_word", "text", "The first word of text; '' when it has none.",
            "    return text.split()[0]\n", "    words = text.split()\n    return words[0] if words else ''\n",
            keeps=(("first_word('hello world')", "hello"),), breaks=(("first_word('')", ""), ("first_word('   ')", ""))),
    _default_when_empty("spread", "max(values) - min(values)", 0, "max - min of values; 0 when there are none.",
                        ("spread([4, 1, 7])", 6)),
    _default_when_empty("middle", "sorted(values)[len(values) // 2]", None,
                        "The middle element of the sorted values; None when there are none.", ("middle([5, 1, 3])", 3)),
))


def _accumulator(name, item, bucket):
    buggy = f"    {bucket}.append({item})\n    return {bucket}\n"
    fixed = f"    if {bucket} is None:\n        {bucket} = []\n    {bucket}.append({item})\n    return {bucket}\n"
    return Variant(name, f"{item}, {bucket}=None", f"{bucket} (a new list when not given) with {item} appended.",
                   buggy, fixed, keeps=((f"{name}('x', ['a'])", ["a", "x"]),),
                   breaks=((f"{name}('a'); {name}('b')", ["b"]),),
                   buggy_signature=f"{item}, {bucket}=[]")  # the bug: one list shared by every call


MUTABLE_DEFAULT = Family("mutable_default", "collector",
                         "`{name}` keeps items from earlier calls when called without a list.", (
    _accumulator("add_tag", "tag", "tags"), _accumulator("add_note", "note", "notes"),
    _accumulator("push_event", "event", "events"), _accumulator("collect_error", "error", "errors"),
    _accumulator("enqueue", "job", "queue"),
))


def _division(name, signature, doc, expression, keeps, breaks):
    return Variant(name, signature, doc, f"    return {expression.replace('/', '//')}\n", f"    return {expression}\n",
                   keeps=keeps, breaks=breaks)


INTEGER_DIVISION = Family("integer_division", "ratios", "`{name}` rounds down: it uses integer division.", (
    _division("ratio", "a, b", "a divided by b.", "a / b", (("ratio(6, 3)", 2),), (("ratio(1, 4)", 0.25),)),
    _division("percent", "part, whole", "part as a percentage of whole.", "100 * part / whole",
              (("percent(1, 4)", 25),), (("percent(1, 3)", 100 / 3),)),
    _division("mean_speed", "distance, hours", "distance per hour.", "distance / hours",
              (("mean_speed(120, 2)", 60),), (("mean_speed(100, 8)", 12.5),)),
    _division("share", "total, people", "each person's share of total.", "total / people",
              (("share(9, 3)", 3),), (("share(10, 4)", 2.5),)),
    _division("scale", "x, factor", "x shrunk by factor.", "x / factor", (("scale(8, 2)", 4),), (("scale(3, 2)", 1.5),)),
))

TEXT_CASE = Family("text_normalisation", "textnorm", "`{name}` treats upper and lower case (or spacing) as different.", (
    Variant("slugify", "title", "The title in lower case with words joined by '-'.",
            "    return '-'.join(title.split())\n", "    return '-'.join(title.lower().split())\n",
            keeps=(("slugify('hello big world')", "hello-big-world"),), breaks=(("slugify('Hello World')", "hello-world"),)),
    Variant("normalize_email", "email", "The address without surrounding spaces, in lower case.",
            "    return email.strip()\n", "    return email.strip().lower()\n",
            keeps=(("normalize_email(' a@b.org ')", "a@b.org"),), breaks=(("normalize_email('Ann@B.org')", "ann@b.org"),)),
    Variant("same_word", "a, b", "True when a and b are the same word, ignoring case.",
            "    return a == b\n", "    return a.casefold() == b.casefold()\n",
            keeps=(("same_word('cat', 'cat')", True), ("same_word('cat', 'dog')", False)),
            breaks=(("same_word('Cat', 'cAT')", True),)),
    Variant("count_word", "text, word", "How often word occurs in text, ignoring case.",
            "    return text.split().count(word)\n", "    return text.lower().split().count(word.lower())\n",
            keeps=(("count_word('a b a', 'a')", 2),), breaks=(("count_word('A b a', 'a')", 2),)),
    Variant("is_palindrome", "text", "True when text reads the same backwards, ignoring case and spaces.",
            "    return text == text[::-1]\n",
            "    letters = [c.lower() for c in text if c.isalnum()]\n    return letters == letters[::-1]\n",
            keeps=(("is_palindrome('level')", True), ("is_palindrome('abc')", False)),
            breaks=(("is_palindrome('Never odd or even')", True),)),
))

FAMILIES = (INCLUSIVE_RANGE, BOUNDARY, EMPTY_INPUT, MUTABLE_DEFAULT, INTEGER_DIVISION, TEXT_CASE)


def _module(variant: Variant, fixed: bool) -> str:
    signature = variant.signature if fixed else (variant.buggy_signature or variant.signature)
    body = variant.fixed if fixed else variant.buggy
    return f'def {variant.name}({signature}):\n    """{variant.doc}"""\n{body}'


def _call_expression(call: str) -> str:
    """'f(1); f(2)' -> a lambda-free expression whose value is the last call's: '[f(1), f(2)][-1]'."""
    parts = [part.strip() for part in call.split(";")]
    return parts[0] if len(parts) == 1 else f"[{', '.join(parts)}][-1]"


_CHECK_HELPERS = '''

def plain(value):
    """The kind of a plain value ('number', 'bool', 'str', 'None', or a list of kinds); None for anything else,
    so an object that only claims to equal the expected value does not pass."""
    kind = type(value)
    if kind is int or kind is float:
        return "number"
    if kind is bool or kind is str:
        return kind.__name__
    if value is None:
        return "None"
    if kind is list:
        return [plain(item) for item in value]
    return None


def check(test, actual, expected):
    test.assertEqual(plain(actual), plain(expected))
    if type(expected) is float:
        test.assertAlmostEqual(actual, expected)
    else:
        test.assertEqual(actual, expected)
'''


def _test_file(variant: Variant, package: str, cases, class_name: str, prefix: str) -> str:
    """A unittest module: one test per (call, expected) case, each checking the value's type before its
    equality (`check`), so an always-equal object is not taken for the right answer."""
    lines = ["import unittest", "", f"from {package}.core import {variant.name}", _CHECK_HELPERS, "",
             f"class {class_name}(unittest.TestCase):"]
    for index, (call, expected) in enumerate(cases):
        lines += [f"    def test_{prefix}_{index}(self):",
                  f"        check(self, {_call_expression(call)}, {expected!r})", ""]
    return "\n".join(lines)


def _actual(module_text: str, call: str) -> str:
    """What `call` gives with this module: repr of the value, or the exception it raises."""
    namespace: dict = {}
    exec(compile(module_text, "core.py", "exec"), namespace)  # the task's own generated code, nothing else
    try:
        return f"returns {eval(_call_expression(call), namespace)!r}"  # noqa: S307 - generated expression
    except Exception as err:  # noqa: BLE001 - the bug being described
        return f"raises {type(err).__name__}: {err}"


def _diff(path: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}"))


def _test_ids(module: str, class_name: str, prefix: str, cases) -> tuple[str, ...]:
    return tuple(f"tests.{module}.{class_name}.test_{prefix}_{index}" for index in range(len(cases)))


def _task(family: Family, variant: Variant) -> SweTask:
    package = family.package
    buggy, fixed = _module(variant, False), _module(variant, True)
    keeps_test = _test_file(variant, package, variant.keeps, "TestCore", variant.name)
    new_test = _test_file(variant, package, variant.breaks, "TestRegression", f"{variant.name}_regression")
    snapshot = {
        "README.md": f"# {package}\n\nSmall helpers. Run the tests with `{TEST_COMMAND}`.\n",
        f"{package}/__init__.py": f"from {package}.core import {variant.name}\n",
        f"{package}/core.py": buggy,
        "tests/__init__.py": "",
        "tests/test_core.py": keeps_test,
    }
    call, expected = variant.breaks[0]
    statement = (f"{family.summary.format(name=variant.name)}\n\n`{call}` {_actual(buggy, call)}; "
                 f"expected {expected!r}.\n\nDocumented behaviour: {variant.doc}")
    return SweTask(
        instance_id=f"{package}__{variant.name}", problem_statement=statement, snapshot=snapshot,
        test_command=TEST_COMMAND,
        fail_to_pass=_test_ids("test_regression", "TestRegression", f"{variant.name}_regression", variant.breaks),
        pass_to_pass=_test_ids("test_core", "TestCore", variant.name, variant.keeps),
        test_patch=_diff("tests/test_regression.py", "", new_test).replace("--- a/tests/test_regression.py",
                                                                              "--- /dev/null", 1),
        reference_patch=_diff(f"{package}/core.py", buggy, fixed), metadata={"family": family.name})


@lru_cache(maxsize=None)
def builtin_swe_tasks() -> tuple[SweTask, ...]:
    """Every built-in SWE task, family by family."""
    return tuple(_task(family, variant) for family in FAMILIES for variant in family.variants)


def get_swe_task(instance_id: str) -> SweTask:
    tasks = {task.instance_id: task for task in builtin_swe_tasks()}
    if instance_id not in tasks:
        close = difflib.get_close_matches(instance_id, list(tasks), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown built-in SWE task {instance_id!r}; {hint}known: {', '.join(sorted(tasks))}")
    return tasks[instance_id]
