"""The package's import graph: no cycle among project modules, and every module imports on its
own in dependency order.

Only module-level imports count (what runs when a module is imported); an import inside a
function is a deliberate lazy edge and may point anywhere. ``if TYPE_CHECKING:`` blocks never
run and are skipped.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_pp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run at import time: the module body and the blocks in it
    (if/try/with), but not functions, classes' methods, or ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
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


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules its import runs first."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
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


def test_no_import_cycle_among_project_modules():
    graph = import_graph()
    assert "lightning_pp.plan" in graph and "lightning_pp.commands._common" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_in_dependency_order():
    # A fresh interpreter: modules already imported by other tests would hide an order problem.
    order = dependency_order(import_graph())
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


def test_schedule_command_and_plan_start_without_torch():
    # `lightning-pp schedule` and the plan's rules are pure Python: torch loads only on use.
    script = (
        "import sys\n"
        "import lightning_pp.commands.schedule, lightning_pp.plan\n"
        "heavy = [m for m in ('torch', 'lightning') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
