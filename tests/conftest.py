"""Session-wide test set-up: the shared worlds' lifetime and the ``quick`` tier.

``pytest -m quick`` runs the quick tier (units, the schedule properties, one small world with
every schedule): the loop for working on the code. The README's full command runs everything.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import worlds  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "quick: the quick tier (pytest -m quick): units and one small world"
    )


@pytest.fixture(scope="session", autouse=True)
def _close_worlds_at_the_end():
    yield
    worlds.close_all()
