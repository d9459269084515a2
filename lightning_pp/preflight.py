"""Deprecated home of the pipeline checks: everything moved to :mod:`lightning_pp.plan`.

A re-export kept only until ``lightning_pp.strategy`` imports from ``lightning_pp.plan``; delete
this file then (nothing else imports it).
"""

from __future__ import annotations

from .plan import (
    PipelinePlan,
    PipelineWarning,
    PreflightError,
    bubble_warning,
    check_batch,
    check_layers,
    check_module,
    check_schedule_args,
    check_world,
)

__all__ = [
    "PipelinePlan",
    "PipelineWarning",
    "PreflightError",
    "bubble_warning",
    "check_batch",
    "check_layers",
    "check_module",
    "check_schedule_args",
    "check_world",
]
