"""The package table of docs/architecture.md holds for every import in stacx/, and no import cycle exists.

Imports are read from the source (ast), function-local ones included: an import deferred into a
function still ties the two modules together. Imports under `if TYPE_CHECKING:` count for the table
too (a type named in a signature is still a dependency on its package: the rollout once annotated
with the trainer's run config); only the cycle check skips them, since they never run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "stacx"
ANYTHING = "anything"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(name: str, path: Path, *, with_type_checking: bool = False) -> list[tuple[str, int, bool]]:
    """(imported stacx module, line, function-local) for every import of `name`'s source; imports under
    `if TYPE_CHECKING:` only with `with_type_checking`."""
    return [(module, line, local) for module, line, local, annotation in every_import(name, path)
            if with_type_checking or not annotation]


def every_import(name: str, path: Path) -> list[tuple[str, int, bool, bool]]:
    """(imported stacx module, line, function-local, under `if TYPE_CHECKING:`) for every import of `name`'s source."""
    found: list[tuple[str, int, bool, bool]] = []
    is_package = path.name == "__init__.py"

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, local: bool, annotation: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, local, True)
            for child in node.orelse:
                visit(child, local, annotation)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno, local, annotation) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node)
            for alias in node.names:  # `from stacx.trainer import checkpoint` imports a module
                submodule = f"{module}.{alias.name}"
                found.append((submodule if submodule in MODULES else module, node.lineno, local, annotation))
        local = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, local, annotation)

    visit(ast.parse(path.read_text(encoding="utf-8")), False, False)
    return [entry for entry in found if entry[0] == "stacx" or entry[0].startswith("stacx.")]


def owning_module(module: str) -> str:
    """The module file `module` names (an attribute path resolves to its module)."""
    while module not in MODULES and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def read_table() -> list[tuple[list[str], list[str] | None]]:
    """Rows of the package table: (packages, allowed imports or None for anything), names under stacx."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Who owns what", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("package", "---"):
            continue
        packages = re.findall(r"`([\w.]+)`", cells[0])
        allowed = None if cells[2] == ANYTHING else re.findall(r"`([\w.]+)`", cells[2])
        rows.append((["stacx" if p == "stacx" else f"stacx.{p}" for p in packages],
                     None if allowed is None else [f"stacx.{a}" for a in allowed]))
    return rows


TABLE = read_table()


def row_of(module: str) -> tuple[str, list[str] | None]:
    """(the table package owning `module`: the longest that contains it, its allowed imports)."""
    best = None
    for packages, allowed in TABLE:
        for package in packages:
            if package == "stacx":
                matches = module == "stacx"
            else:
                matches = within(module, package)
            if matches and (best is None or len(package) > len(best[0])):
                best = (package, allowed)
    if best is None:
        raise AssertionError(f"{module} is in no row of the package table in docs/architecture.md; add it to a row")
    return best


EVERY_IMPORT = {name: every_import(name, path) for name, path in MODULES.items()}
"""Every module's imports, `TYPE_CHECKING` ones marked (read once)."""
IMPORTS = {name: [(module, line, local) for module, line, local, annotation in imports if not annotation]
           for name, imports in EVERY_IMPORT.items()}
"""Every module's imports that run (what an import cycle is made of)."""


def test_the_table_names_real_packages_and_covers_every_module():
    assert len(TABLE) >= 10, "the package table in docs/architecture.md was not found"
    for packages, allowed in TABLE:
        for name in packages + (allowed or []):
            assert any(within(m, name) for m in MODULES), f"docs/architecture.md names `{name}`, which is not in stacx/"
    for module in MODULES:
        row_of(module)


def test_every_import_follows_the_package_table():
    """Function-local and `TYPE_CHECKING` imports included."""
    violations = []
    for module, imports in EVERY_IMPORT.items():
        own, allowed = row_of(module)
        if allowed is None:
            continue
        for imported, line, local, _ in imports:
            target = owning_module(imported)
            if row_of(target)[0] == own or any(within(target, a) for a in allowed):
                continue
            where = "function-local " if local else ""
            violations.append(f"{MODULES[module].relative_to(REPO)}:{line}: {where}import of {target} "
                              f"({own[6:] or 'stacx'} may import {', '.join(a[6:] for a in allowed) or 'no stacx package'})")
    assert not violations, "imports outside docs/architecture.md's package table:\n" + "\n".join(violations)


NEVER_IMPORTS = (
    ("stacx.trainer", "stacx.diffusion"),
    ("stacx.rollout", "stacx.diffusion"),
    ("stacx.diffusion", "stacx.launch"),
    ("stacx.rollout", "stacx.trainer"),
    ("stacx.rollout", "stacx.launch"),
    ("stacx.serving", "stacx.rollout"),
    ("stacx.rollout", "stacx.serving"),
    ("stacx.trainer", "stacx.serving"),
)
"""(importer, imported) pairs forbidden outright: the core never names a workload's package, a
workload never reaches into the command line, the rollout never reaches up into the trainer
(it receives the sections and the plan it reads: `stacx.rollout.sections`, `stacx.rollout.plan`), and
the server process and the driver meet only in `stacx.wire` (serving never imports rollout, nor rollout or the trainer
serving: the recorder an agent run starts in front of vLLM gets `stacx serve`'s HTTP server from `stacx.launch`).
Counted with function-local and `TYPE_CHECKING` imports, as the table test counts them."""


def test_the_core_never_imports_a_workload_and_a_workload_never_imports_launch():
    violations = []
    for module, path in MODULES.items():
        for importer, imported in NEVER_IMPORTS:
            if not within(module, importer):
                continue
            for target, line, _, _ in EVERY_IMPORT[module]:
                if within(target, imported):
                    violations.append(f"{path.relative_to(REPO)}:{line}: import of {target} ({importer} never imports "
                                      f"{imported})")
    assert not violations, "\n".join(violations)


def test_the_forbidden_pairs_are_also_forbidden_by_the_package_table():
    for importer, imported in NEVER_IMPORTS:
        own, allowed = row_of(importer)
        assert allowed is not None and not any(within(imported, a) for a in allowed), (
            f"docs/architecture.md lets {own[6:]} import {imported[6:]}; the layering rule forbids it")


def test_importing_the_server_loads_no_driver_module_and_no_loss_kernel():
    """`stacx serve`'s process imports the server, the endpoints and what both ends speak, never the
    driver (rollout), the trainer or the loss math (objectives). Run in a process of its own, forked from the
    rank forkserver: what it preloaded counts as loaded too, so the check is at least as strict as a fresh
    interpreter's."""
    from stacx.testing.distributed import run_forked
    from tests.import_probe import stacx_modules_after_importing

    loaded = run_forked(stacx_modules_after_importing, "stacx.serving.server")
    assert "stacx.serving.server" in loaded
    driver = [m for m in loaded if any(within(m, p) for p in ("stacx.rollout", "stacx.trainer", "stacx.objectives"))]
    assert not driver, f"importing stacx.serving.server loads {driver}"


COMMENTED_LOCAL_IMPORTS = ("stacx.trainer", "stacx.rollout", "stacx.serving")
"""Packages whose function-local imports must each say why they are there (start-up time)."""


def test_function_local_imports_say_why_they_are_function_local():
    """A function-local import stays only where it saves start-up time (Ray, megatron-core, transformers,
    SGLang are slow to import), with a comment on its line or on the line above its import block."""
    uncommented = []
    for module, path in MODULES.items():
        if not any(within(module, package) for package in COMMENTED_LOCAL_IMPORTS):
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for _, line, local in IMPORTS[module]:
            if not local:
                continue
            above = line - 2
            while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
                above -= 1  # one comment covers a block of imports
            if "#" not in lines[line - 1] and not (above >= 0 and lines[above].strip().startswith("#")):
                uncommented.append(f"{path.relative_to(REPO)}:{line}: {lines[line - 1].strip()}")
    assert not uncommented, ("function-local imports without a comment saying why (move them to the top of the "
                             "module unless they save start-up time):\n" + "\n".join(uncommented))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(edges):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(edges[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


def test_there_are_no_import_cycles_not_even_through_function_local_imports():
    edges = {module: set() for module in MODULES}
    for module, imports in IMPORTS.items():
        for imported, _, _ in imports:
            target = owning_module(imported)
            if target != module:
                edges[module].add(target)
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


@pytest.mark.parametrize("source, expected", [
    ("from stacx.trainer import checkpoint\n", [("stacx.trainer.checkpoint", 1, False)]),
    ("def f():\n    import stacx.models\n", [("stacx.models", 2, True)]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import stacx.launch\n", []),
])
def test_imports_are_read_with_function_local_ones(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert imported_modules("stacx.probe", path) == expected


def test_type_checking_imports_are_read_when_asked(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stacx.diffusion import loop\n")
    assert imported_modules("stacx.probe", path, with_type_checking=True) == [("stacx.diffusion.loop", 3, False)]


TYPED_GROUPS_PACKAGES = ("stacx.models", "stacx.checkpointing", "stacx.parallel")
"""Packages whose functions take this rank's process groups as `groups: ProcessGroups` (or `| None`)."""


def test_every_groups_parameter_of_the_rank_packages_is_typed_process_groups():
    untyped = []
    for module, path in MODULES.items():
        source = path.read_text(encoding="utf-8")
        if not any(within(module, package) for package in TYPED_GROUPS_PACKAGES) or "groups" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg == "groups" and annotation not in ("ProcessGroups", "ProcessGroups | None"):
                    untyped.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.name}({arg.arg}: {annotation or '?'})")
    assert not untyped, "`groups` parameters not typed `ProcessGroups`:\n" + "\n".join(untyped)


def test_plugins_is_a_ground_floor_package_that_every_plugin_kind_builds_on():
    """`stacx.plugins` (discovery and the one Registry) imports no other Stacx package, and the registries of
    kernels, engines, environments, tools, rewards, workloads, tasks and recipes are all its `Registry`."""
    assert row_of("stacx.plugins.registry") == ("stacx.plugins", [])
    for module in MODULES:
        if within(module, "stacx.plugins"):
            assert all(within(target, "stacx.plugins") for target, *_ in EVERY_IMPORT[module]), module
    from stacx.plugins.registry import Registry
    from stacx.objectives.registry import POLICY_LOSSES
    from stacx.rollout.engines.registry import ENGINE_KINDS
    from stacx.rollout.agents.environments import ENVIRONMENTS
    from stacx.rollout.rewards import REWARD_FUNCTIONS
    from stacx.rollout.agents.tools import TOOLS
    from stacx.tasks.builtin import TASKS
    from stacx.trainer.config.recipe import TRAINING_CONFIGS
    from stacx.trainer.config.workload import WORKLOADS

    for registry in (POLICY_LOSSES, ENGINE_KINDS, ENVIRONMENTS, REWARD_FUNCTIONS, TOOLS, TASKS, TRAINING_CONFIGS,
                     WORKLOADS):
        assert isinstance(registry, Registry), registry
