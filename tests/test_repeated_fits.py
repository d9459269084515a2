"""Several ``Trainer`` runs in one process leave nothing behind.

A notebook, a sweep, or ``fit`` followed by a new ``Trainer`` for ``test`` runs the strategy
several times in one process. Each run used to leave behind:

- its whole strategy, and through it the model and the optimizer: ``atexit`` kept the heartbeat
  watcher's ``stop``, and the watcher referred to the strategy;
- a new DeviceMesh and its gloo communicators. Each of these keeps a network thread that wakes
  every few milliseconds. 106 of them took 0.3 of a core in an idle test world, and the suite's
  shared worlds gathered hundreds;
- an idle thread for the collective monitor.

Three fits run in one 2-rank Trainer world. After each, the Trainer is dropped and the test
checks that its strategy is freed at once (one ``gc.collect()``: the watcher joins its threads
before ``fit`` returns; when it did not join its guard thread, that thread held the strategy a
moment longer, 2 fits in 64), and counts the process's gloo threads, its process groups and its
live heartbeat watchers (the objects ``atexit`` kept): after the third fit there are no more
than after the second.
"""

from __future__ import annotations

import os
import sys

import pytest
from worlds import world

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task"
)


def _fit_three_times(rank: int, size: int) -> tuple[list[bool], list[tuple[int, int, int]]]:
    import gc

    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineLayers, PipelineMixin, PipelineStrategy

    class Net(PipelineMixin, L.LightningModule):
        def configure_model(self) -> None:
            if getattr(self, "layers", None) is None:
                self.layers = PipelineLayers([lambda: torch.nn.Linear(8, 8) for _ in range(4)])

        def pipeline_input(self, batch):
            return batch[0]

        def pipeline_loss(self, output, batch):
            return F.mse_loss(output, batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 8))
    import time
    import weakref

    import torch.distributed as dist

    from lightning_pp.runtime.heartbeats import ProcessWatcher

    def threads() -> int:  # gloo's own: the ones that wake every few milliseconds
        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    names.append(f.read())
            except OSError:  # the thread ended meanwhile
                pass
        return sum("gloo" in name for name in names)

    after: list[tuple[int, int, int]] = []  # (gloo threads, process groups, live watchers)
    freed: list[bool] = []  # each fit's strategy, as soon as fit has returned
    for _ in range(3):
        strategy = PipelineStrategy(pp=size, microbatches=4)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=size,
            strategy=strategy,
            max_steps=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            use_distributed_sampler=False,
        )
        trainer.fit(Net(), DataLoader(data, batch_size=8))
        alive = weakref.ref(strategy)
        del trainer, strategy
        gc.collect()
        freed.append(alive() is None)
        deadline = time.monotonic() + 10.0
        while after and threads() > after[0][0] and time.monotonic() < deadline:
            time.sleep(0.1)  # a gloo thread of a group being destroyed is still ending
        groups = len(dist.distributed_c10d._world.pg_map)
        watchers = sum(isinstance(o, ProcessWatcher) for o in gc.get_objects())
        after.append((threads(), groups, watchers))
    return freed, after


def test_a_fit_leaves_neither_its_strategy_nor_threads_groups_or_watchers_behind():
    for rank, (freed, after) in enumerate(world("trainer", 2).run(_fit_three_times, timeout=300)):
        assert freed == [True, True, True], f"rank {rank}: each fit's strategy freed: {freed}"
        second, third = after[1], after[2]
        what = f"rank {rank}: (gloo threads, process groups, live watchers) after each fit {after}"
        assert third[0] <= second[0], what
        assert third[1:] == second[1:], what
