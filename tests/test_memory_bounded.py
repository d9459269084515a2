"""What a training step leaves behind is freed by reference counting and stays bounded.

Issue 35 (item 6): resident memory grew step after step under zbv at pp=2 x dp=2 and never
levelled off. These tests measure the objects themselves, not the process's memory:

- a step's :class:`~lightning_pp.runtime.engine_step.StepRun` (and the microbatches, receive
  buffers and sends it holds) is dead as soon as the step returns, with the cyclic garbage
  collector disabled, and a step creates no reference cycle at all (``gc.collect()`` after many
  steps with the collector off finds nothing);
- ``DeferredGradSync.events`` holds the latest step's launches, not every step's;
- ``RunSummary``'s loss history holds floats, at most ``max_points`` of them.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from engine_grid import chunks_of
from engine_models import make_chunks, mlp_batch, mlp_layers, mse_loss
from worlds import world

from lightning_pp.callbacks.summary import LossHistory
from lightning_pp.layout.topology import PipelineTopology, build_process_groups
from lightning_pp.runtime import engine as engine_mod
from lightning_pp.runtime.engine import PipelineEngine
from lightning_pp.runtime.engine_step import StepRun
from lightning_pp.runtime.grad_sync import DeferredGradSync
from lightning_pp.schedules import build_schedule

SCHEDULES = ["1f1b", "zb-h1", "zbv"]
STEPS = 6


@contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic collector off (what refcounting alone frees), back on after."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _TrackedRun(StepRun):
    """A StepRun that leaves a weak reference to itself in ``made``."""

    made: list[weakref.ReferenceType[StepRun]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _TrackedRun.made.append(weakref.ref(self))


def _steps_leave(engine: PipelineEngine, batches: list[Any], after_step: Any = None) -> dict:
    """Run ``batches`` with the collector off: how many step runs are still alive after the
    last step, and how many objects ``gc.collect()`` then finds unreachable (cycles)."""
    previous = engine_mod.StepRun
    engine_mod.StepRun = _TrackedRun  # the engine builds its runs from this name
    _TrackedRun.made = []
    try:
        engine.train_step(batches[0])  # warm-up: one-off caches (plans, shapes) fill here
        if after_step is not None:
            after_step()
        with collector_off():
            _TrackedRun.made = []
            for batch in batches[1:]:
                engine.train_step(batch)
                if after_step is not None:
                    after_step()
            alive = sum(ref() is not None for ref in _TrackedRun.made)
            made = len(_TrackedRun.made)
            unreachable = gc.collect()
    finally:
        engine_mod.StepRun = previous
    return {"made": made, "alive": alive, "unreachable": unreachable}


@pytest.mark.quick
@pytest.mark.parametrize("name", SCHEDULES)
def test_one_process_steps_free_their_run_without_the_cycle_collector(name):
    schedule = build_schedule(name, pp=1, microbatches=4)
    topo = PipelineTopology(world_size=1, pp=1, dp=1, rank=0)
    chunks = make_chunks(mlp_layers(0), 1, schedule.vpp, 0)
    engine = PipelineEngine(chunks, schedule, topo, None, loss_fn=mse_loss("mean"))
    got = _steps_leave(engine, [mlp_batch(s, 8) for s in range(STEPS)])
    assert got == {"made": STEPS - 1, "alive": 0, "unreachable": 0}


def _pp2_dp2(rank: int, size: int, names: list[str]) -> dict:
    """Per schedule, on this rank of pp=2 x dp=2: what the steps left behind, and the length of
    the data-parallel sync's event list after them."""
    topo = PipelineTopology.from_world(size, rank, 2)
    groups = build_process_groups(topo)
    out = {}
    for name in names:
        schedule = build_schedule(name, pp=2, microbatches=4)
        torch.manual_seed(0)
        chunks = chunks_of(mlp_layers(0), schedule, topo.pp_rank)
        # small buckets: several launches per chunk and step
        sync = DeferredGradSync(
            [list(c.parameters()) for c in chunks], groups.dp_group, topo.dp, bucket_cap_mb=1e-4
        )
        engine = PipelineEngine(
            chunks,
            schedule,
            topo,
            groups,
            loss_fn=mse_loss("mean"),
            on_chunk_grads_ready=sync.on_chunk_grads_ready,
            abort_on_failure=False,
        )
        batches = [mlp_batch(10 * topo.dp_rank + s, 8) for s in range(STEPS)]
        got = _steps_leave(engine, batches, after_step=sync.wait)
        got["events"] = len(sync.events)
        got["buckets"] = sync.num_buckets
        out[name] = got
    return out


def test_pp2_dp2_steps_free_their_run_and_the_sync_keeps_one_steps_events():
    results = world("gloo", 4).run(_pp2_dp2, SCHEDULES, timeout=240)
    for rank, per_schedule in enumerate(results):
        for name, got in per_schedule.items():
            where = f"rank {rank}, {name}"
            assert got["made"] == STEPS - 1, where
            assert got["alive"] == 0, f"{where}: step runs outlived their step: {got}"
            assert got["unreachable"] == 0, f"{where}: the steps made reference cycles: {got}"
            # one launch per bucket of the latest step, not one per bucket per step
            assert got["buckets"] > 1, where
            assert got["events"] == got["buckets"], f"{where}: {got}"


@pytest.mark.quick
def test_loss_history_keeps_floats_and_at_most_max_points():
    history = LossHistory(max_points=100, flush_every=8)
    refs = []
    for step in range(1, 5001):
        loss = torch.tensor(1.0 / step)
        refs.append(weakref.ref(loss))
        history.add(step, loss)
        del loss
        assert len(history) <= 100 + 8 + 1
    points = history.points()
    # no step's tensor is kept: only what still waits to be read (fewer than flush_every)
    assert sum(r() is not None for r in refs) < 8
    assert all(type(v) is float for _, v in points)
    assert 50 <= len(points) <= 101
    # evenly spread over the whole run, from the first step to the latest
    steps = [s for s, _ in points]
    assert steps[0] == 1 and steps[-1] == 5000
    gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1])}
    assert gaps == {history.stride}
    assert all(v == pytest.approx(1.0 / s) for s, v in points)


@pytest.mark.quick
def test_loss_history_keeps_every_step_of_a_short_run():
    history = LossHistory()
    for step in range(1, 221):
        history.add(step, torch.tensor(float(step)))
    assert history.points() == [(s, float(s)) for s in range(1, 221)]
