"""Private Lightning names appear only in lightning_pp/_lightning_compat.py.

Every contact with Lightning internals lives in one module that says which Lightning version it
was written against and why each contact is needed, so an upgrade has one place to look. These
checks read the source (text and AST) of every other module of the package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pp"
COMPAT = PACKAGE / "_lightning_compat.py"
FILES = sorted(p for p in PACKAGE.rglob("*.py") if p != COMPAT)

# A dotted path into Lightning that reaches a private name: lightning.fabric.utilities._x,
# lightning.pytorch.trainer.call._call_hook, lightning.pytorch.strategies.launchers._Foo, ...
PRIVATE_PATH = re.compile(r"\blightning(?:_utilities)?\.\S*?\._[A-Za-z]")

# Private attributes of Lightning objects (Trainer, loops, LightningModule, LightningOptimizer,
# Strategy) that the package has needed; reaching them elsewhere bypasses the compat module.
PRIVATE_ATTRIBUTES = {
    "_skip_backward",
    "_should_accumulate",
    "_batches_that_stepped",
    "_optimizer",
    "_trainer",
    "_results",
    "_logger_connector",
    "_reset_optimizers_and_schedulers",
    "_call_callback_hooks",
    "_call_lightning_module_hook",
    "_call_strategy_hook",
    "_current_fx_name",
    "_lightning_optimizers",
}
# Names that are Lightning objects wherever the package uses them: a private attribute on any of
# them is a Lightning internal.
LIGHTNING_OBJECTS = {
    "trainer",
    "fit_loop",
    "epoch_loop",
    "pl_module",
    "lightning_module",
    "precision_plugin",
    "call",
}
# Overrides, not calls: the accelerator connector calls this private hook of Strategy to get a
# launcher, and every Lightning strategy overrides it and sets ``_launcher`` (listed in the
# compat module's docstring).
ALLOWED = {
    ("process_group.py", "_configure_launcher"),
    ("process_group.py", "_launcher"),
}


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE)) if path.is_relative_to(PACKAGE) else path.name


def _terminal_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _terminal_name(node.func)
    return None


def _violations(path: Path) -> list[str]:
    text = path.read_text()
    found = [
        f"{_rel(path)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for m in PRIVATE_PATH.finditer(text)
    ]
    for node in ast.walk(ast.parse(text)):
        where = f"{_rel(path)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "lightning",
            "lightning_utilities",
            "pytorch_lightning",
        ):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{where}: from {node.module} import ...")
            found += [
                f"{where}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_")
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"{where}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] in ("lightning", "pytorch_lightning")
                and any(part.startswith("_") for part in a.name.split("."))
            ]
        elif isinstance(node, (ast.Attribute, ast.FunctionDef)):
            name = node.attr if isinstance(node, ast.Attribute) else node.name
            if not name.startswith("_") or name.startswith("__"):
                continue
            if (path.name, name) in ALLOWED:
                continue
            on_lightning = (
                isinstance(node, ast.Attribute) and _terminal_name(node.value) in LIGHTNING_OBJECTS
            )
            if name in PRIVATE_ATTRIBUTES or on_lightning:
                kind = "defines" if isinstance(node, ast.FunctionDef) else "uses"
                found.append(f"{where}: {kind} {name}")
        elif isinstance(node, ast.Call) and _terminal_name(node.func) in ("getattr", "setattr"):
            args = node.args
            if len(args) >= 2 and isinstance(args[1], ast.Constant):
                name = args[1].value
                if isinstance(name, str) and name in PRIVATE_ATTRIBUTES:
                    found.append(f"{where}: {_terminal_name(node.func)}(..., {name!r})")
    return found


def test_the_scan_sees_the_package():
    names = {_rel(p) for p in FILES}
    assert {"strategy/pipeline_strategy.py", "checkpoint/sharded.py", "callbacks/base.py"} <= names
    assert "_lightning_compat.py" not in names


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_no_private_lightning_name_outside_the_compat_module(path):
    found = _violations(path)
    assert not found, (
        "private Lightning names outside lightning_pp/_lightning_compat.py (add a helper there, "
        "with the Lightning version and why it is needed):\n  " + "\n  ".join(found)
    )


def test_the_scan_catches_every_form(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from lightning.fabric.utilities.distributed import _init_dist_connection\n"
        "from lightning.pytorch.strategies.launchers import (\n"
        "    DDPStrategy,\n"
        "    _MultiProcessingLauncher,\n"
        ")\n"
        "import lightning.fabric.utilities._private\n"
        "x = lightning.pytorch.trainer.call._call_lightning_module_hook\n"
        "trainer.fit_loop._skip_backward = True\n"
        "n = getattr(loop, '_batches_that_stepped', 0)\n"
        "opt = optimizer._optimizer\n"
        "trainer._anything\n"
    )
    found = _violations(bad)
    text = "\n".join(found)
    for needle in (
        "import _init_dist_connection",
        "import _MultiProcessingLauncher",
        "import lightning.fabric.utilities._private",
        "lightning.pytorch.trainer.call._c",
        "uses _skip_backward",
        "'_batches_that_stepped'",
        "uses _optimizer",
        "uses _anything",
    ):
        assert needle in text, (needle, found)
    # the project's own private names are not Lightning's
    ok = tmp_path / "ok.py"
    ok.write_text("self._pp = 1\nlayers._builders[0]\nfrom .model import _split_name\n")
    assert _violations(ok) == []


def test_the_compat_module_names_the_version_and_the_reason():
    text = COMPAT.read_text()
    assert "Lightning 2.6" in text
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node) or ""
            assert "Why" in doc, f"{node.name}: say why the private contact is needed"


def test_every_overridden_lightning_hook_carries_override():
    """A renamed Lightning hook must fail loudly in type checking, not be silently never called."""
    import inspect

    from lightning_pp.strategy.model_summary import PipelineSummary
    from lightning_pp.strategy.pipeline_strategy import PipelineStrategy
    from lightning_pp.strategy.precision import GlobalNormClipping
    from lightning_pp.strategy.process_group import ProcessGroupStrategy

    missing = []
    for cls in (PipelineStrategy, ProcessGroupStrategy, GlobalNormClipping, PipelineSummary):
        lightning_bases = [b for b in cls.__mro__ if b.__module__.startswith("lightning.")]
        for name, value in vars(cls).items():
            if name.startswith(("__", "_abc_")) or not any(
                hasattr(b, name) for b in lightning_bases
            ):
                continue
            func = value.fget if isinstance(value, property) else inspect.unwrap(value)
            func = getattr(func, "__func__", func)  # classmethod
            if not getattr(func, "__override__", False):
                missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"overrides without @override: {missing}"
