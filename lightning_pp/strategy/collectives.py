"""What the strategy's steps need of its process group: two watched collectives.

:class:`~lightning_pp.strategy.process_group.ProcessGroupStrategy` provides them (every wait
honours the watchdog and the abort channel); the steps take any object that has them.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

__all__ = ["Collectives"]


class Collectives(Protocol):
    """A watched ``all_reduce`` and ``broadcast_object`` (``what`` names the transfer in a hang
    report)."""

    def all_reduce(
        self, tensor: Tensor, op: Any = ..., group: Any = None, what: str = ""
    ) -> Tensor:
        """In-place all-reduce of ``tensor`` over ``group``; returns ``tensor``."""
        ...

    def broadcast_object(self, obj: Any, src: int, group: Any = None, what: str = "") -> Any:
        """``obj`` of global rank ``src`` on every rank of ``group``."""
        ...
