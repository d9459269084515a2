"""Session-wide test set-up: the shared worlds' lifetime, the background jobs, the order of the
session, and the ``quick`` tier.

``pytest -m quick`` runs the quick tier (units, the schedule properties, one small world with
every schedule): the loop for working on the code. The README's full command runs everything.

The order (docs/testing.md): the files whose tests read background jobs' verdicts
(tests/background.py) run after the other files, so that the jobs, started at the first test,
run beside those; the files marked ``timing`` run last, after every background job finished,
so that nothing else shares the CPU with what they measure. Within each group, and within each
file, the order is pytest's own (a file's tests stay together: its module fixtures run once).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import background  # noqa: E402
import distributed  # noqa: E402
import worlds  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "quick: the quick tier (pytest -m quick): units and one small world"
    )
    config.addinivalue_line(
        "markers",
        "timing: asserts on time measured on this machine; runs after every background job",
    )
    # The session's forkserver starts with the first world, whichever test asks first. Set its
    # preload now, so that a test that first starts one through the planner's or the
    # benchmarks' world_context (which preloads only torch) does not leave every later Trainer
    # world's ranks importing Lightning themselves.
    distributed._context()


def _group(item: pytest.Item) -> int:
    """0: the in-process files; 1: files that read background jobs; 2: ``timing`` files."""
    if item.get_closest_marker("timing") is not None:
        return 2
    return 1 if hasattr(getattr(item, "module", None), "background_jobs") else 0


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(session: pytest.Session, config, items: list) -> None:
    # a file's group is that of its first test, so that no file is split across groups
    group_of_file: dict[Path, int] = {}
    for item in items:
        group_of_file.setdefault(item.path, _group(item))
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (group_of_file[item.path], order[id(item)]))


def _rebind_closed_log_streams() -> None:
    """Lightning, torchmetrics and transformers each give their logger a StreamHandler bound to
    the sys.stderr of the moment they are first imported. First imported inside a test that uses
    capsys, that stream is closed when the test ends, and every later log line of the session (a
    Trainer's "GPU available") printed "--- Logging error ---" and a traceback into whatever test
    ran then (`pytest tests/test_preflight.py` alone failed that way; the whole suite imported
    Lightning while collecting, under pytest's session-wide capture). Such a handler writes to
    the current sys.stderr instead. (Importing Lightning up front would cost every run of one
    pure file 6 s.)"""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):  # a PlaceHolder has none
            if type(handler) is logging.StreamHandler and getattr(handler.stream, "closed", False):
                handler.stream = sys.stderr  # setStream would flush the closed one first


def pytest_runtest_setup(item: pytest.Item) -> None:
    _rebind_closed_log_streams()
    if item.get_closest_marker("timing") is not None:
        background.drain()


def pytest_terminal_summary(terminalreporter) -> None:
    line = background.summary()
    if line:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def _background_jobs(request, tmp_path_factory):
    """Start the launched jobs that this session's selected tests read (tests/background.py)."""
    by_module: dict[object, list] = {}
    for item in request.session.items:
        if hasattr(getattr(item, "module", None), "background_jobs"):
            by_module.setdefault(item.module, []).append(item)
    for module, items in by_module.items():
        background.start(module.background_jobs(items, tmp_path_factory))
    yield
    background.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _close_worlds_at_the_end():
    yield
    worlds.close_all()
