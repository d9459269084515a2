"""The package's import graph: the layers, no cycle, and every module importing on its own.

Three checks read every module's imports (the AST, nothing is imported):

- **layers**: each sub-package may import only the layers listed in :data:`LAYERS` (the rooms
  of docs/architecture.md). Every import counts here, wherever it sits: module level,
  ``if TYPE_CHECKING:`` and inside functions; a lazy or type-only import is still an arrow.
- **cycles**: no cycle among modules, counting every import too (type-only and lazy ones).
- **order**: every module imports in a fresh interpreter in dependency order.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import background
import pytest

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_pp"


def _module_name(path: Path, repo: Path = REPO) -> str:
    parts = path.relative_to(repo).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Each layer (a sub-package, or a top-level module) and the layers it may import. The order
#: is the house's, lowest first (docs/architecture.md); a layer may import only layers above it
#: in this list, and only those named. ``lightning_pp`` itself (the root ``__init__``: lazy
#: public names) and ``__main__`` sit above everything.
_BELOW_STRATEGY = {"schedules", "layout", "runtime", "autosplit", "planner", "_lightning_compat"}
LAYERS: dict[str, set[str]] = {
    "schedules": set(),
    "layout": {"schedules"},
    "runtime": {"schedules", "layout"},
    "autosplit": {"schedules", "layout", "runtime"},
    "planner": {"schedules", "layout", "runtime"},
    "_lightning_compat": {"runtime"},
    "checkpoint": {"schedules", "layout", "runtime", "_lightning_compat"},
    "strategy": _BELOW_STRATEGY | {"checkpoint"},
    "callbacks": _BELOW_STRATEGY | {"checkpoint", "strategy"},
    "models": _BELOW_STRATEGY | {"strategy"},
    "commands": _BELOW_STRATEGY | {"checkpoint", "strategy", "callbacks", "models"},
    "__main__": {"commands"},
}


def layer_of(module: str) -> str:
    """``lightning_pp.runtime.engine`` -> ``runtime``; the root package -> ``lightning_pp``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of ``graph`` that crosses layers against :data:`LAYERS`."""
    found = []
    for name, deps in sorted(graph.items()):
        here = layer_of(name)
        if here == "lightning_pp":
            continue  # the root package: lazy public names of any layer
        if here not in LAYERS:
            found.append(f"{name}: in no layer (add {here!r} to LAYERS)")
            continue
        for dep in sorted(deps):
            there = layer_of(dep)
            if there not in (here, "lightning_pp") and there not in LAYERS[here]:
                found.append(f"{name} imports {dep} ({here} may import {sorted(LAYERS[here])})")
    return found


def _top_level_imports(
    tree: ast.Module, *, type_only: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run at import time: the module body and the blocks in it
    (if/try/with), but not functions or classes' methods; ``if TYPE_CHECKING:`` blocks too when
    ``type_only``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if type_only or test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody):
                    visit(block)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body)  # a class body runs at import time too

    visit(tree.body)
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it sits (functions and ``TYPE_CHECKING`` included)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def import_graph(scope: str = "runtime", package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the project modules it imports. ``scope``: ``"runtime"`` (what its import runs
    first), ``"types"`` (that and ``TYPE_CHECKING`` imports) or ``"all"`` (every import)."""
    repo = package.parent
    modules = {_module_name(p, repo): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        if scope == "all":
            nodes = _all_imports(tree)
        else:
            nodes = _top_level_imports(tree, type_only=scope == "types")
        for node in nodes:
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets.add(source)
            # `from pkg import sub` imports the submodule pkg.sub too
            targets.update(f"{source}.{alias.name}" for alias in node.names)
        for target in targets:
            if not target.startswith("lightning_pp"):
                continue
            # importing a.b.c runs the packages a and a.b first, unless the importer is
            # inside them (then they are already being imported: no new edge)
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                inside = name == dep or name.startswith(dep + ".")
                if dep in modules and dep != name and not inside:
                    graph[name].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def dependency_order(graph: dict[str, set[str]]) -> list[str]:
    """Every module after the modules it imports (the graph has no cycle)."""
    order: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> None:
        if node in done:
            return
        done.add(node)
        for dep in sorted(graph[node]):
            visit(dep)
        order.append(node)

    for node in sorted(graph):
        visit(node)
    return order


def test_the_scanner_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "if TYPE_CHECKING:\n    from .x import y\n"
        "try:\n    from .z import w\nexcept ImportError:\n    pass\n"
        "def f():\n    from .lazy import q\n"
    )
    found = [ast.unparse(n) for n in _top_level_imports(tree)]
    assert found == ["from typing import TYPE_CHECKING", "import os", "from .z import w"]


def test_no_import_runs_back_up_a_layer():
    graph = import_graph("all")
    assert {layer_of(m) for m in graph} - {"lightning_pp"} == set(LAYERS)
    found = layer_violations(graph)
    assert not found, "imports against the layers:\n  " + "\n  ".join(found)


def test_a_planted_back_import_fails_the_layer_check(tmp_path):
    """The check is not vacuous: a copy of the package with one type-only import from the
    runtime back up into the strategy, and one lazy import from the layout into the runtime,
    fails with both named."""
    import shutil

    copy = tmp_path / "lightning_pp"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    engine = copy / "runtime" / "engine.py"
    engine.write_text(
        engine.read_text()
        + "\nif TYPE_CHECKING:\n    from ..strategy.pipeline_strategy import PipelineStrategy\n"
    )
    plan = copy / "layout" / "plan.py"
    plan.write_text(plan.read_text() + "\n\ndef _late():\n    from ..runtime import engine\n")
    found = layer_violations(import_graph("all", copy))
    assert any(
        v.startswith("lightning_pp.runtime.engine imports lightning_pp.strategy.pipeline_strategy")
        for v in found
    ), found
    assert any(
        v.startswith("lightning_pp.layout.plan imports lightning_pp.runtime.engine") for v in found
    ), found
    offenders = {v.split(" imports ")[0] for v in found}
    assert offenders == {"lightning_pp.runtime.engine", "lightning_pp.layout.plan"}, found


def test_no_import_cycle_among_project_modules():
    graph = import_graph("all")
    assert "lightning_pp.layout.plan" in graph and "lightning_pp.commands._common" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _imports_in_dependency_order(order: list[str]) -> str:
    # A fresh interpreter: modules already imported by other tests would hide an order problem.
    script = (
        "import importlib, sys\n"
        f"for name in {order!r}:\n"
        "    importlib.import_module(name)\n"
        "print('imported', len(sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def background_jobs(items, tmp_path_factory) -> dict:
    """The fresh interpreter (it imports every module, Lightning included) runs in the
    background while the in-process tests run (tests/background.py). The order is computed
    here, in the main thread: CPython 3.11's ast constructor is not safe to run in a second
    thread while pytest's assertion rewriting parses modules (``SystemError: AST constructor
    recursion depth mismatch``)."""
    name = "test_every_module_imports_in_dependency_order"
    if not any(getattr(item, "originalname", "") == name for item in items):
        return {}
    order = dependency_order(import_graph())
    return {name: functools.partial(_imports_in_dependency_order, order)}


@pytest.mark.timeout(background.WAIT)
def test_every_module_imports_in_dependency_order():
    print(background.check("test_every_module_imports_in_dependency_order"))


def test_schedule_command_and_plan_start_without_torch():
    # `lightning-pp schedule` and the plan's rules are pure Python: torch loads only on use.
    # The console script registers every subcommand before it runs one (build_parser), so
    # none of the command modules may import torch or Lightning at the top (9 s, not 0.3 s).
    script = (
        "import sys\n"
        "import lightning_pp.commands.schedule, lightning_pp.layout.plan\n"
        "from lightning_pp.commands.cli import build_parser\n"
        "build_parser()\n"
        "heavy = [m for m in ('torch', 'lightning') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
