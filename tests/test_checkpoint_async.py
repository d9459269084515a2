"""The background checkpoint writer (:mod:`lightning_pp.checkpoint.async_save`) on real gloo.

Each case runs in the shared 2-rank gloo world. The DCP writer is held at a gate until the main
thread has changed every tensor in place (what the next optimizer steps do), so the test is
deterministic: what was written must be the values at the moment the save started.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from worlds import world

from lightning_pp.checkpoint.async_save import (
    PendingSave,
    checkpoint_group,
    start_async_save,
)
from lightning_pp.checkpoint.sharded import CheckpointError

pytestmark = [pytest.mark.quick, pytest.mark.timeout(300)]


def _gated_writer(gate: threading.Event):
    """Patch FileSystemWriter.write_data to wait for ``gate``; returns the undo."""
    real = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        assert gate.wait(60), "the test never opened the gate"
        return real(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_data
    return lambda: setattr(dcp.FileSystemWriter, "write_data", real)


def _clone(value):
    return {k: v.clone() for k, v in value.items()} if isinstance(value, dict) else value.clone()


def _save_while_training(rank: int, size: int, root: str) -> dict:
    directory = Path(root) / "ckpt"
    group = checkpoint_group()
    weights = torch.full((64, 8), float(rank + 1))
    moments = {"exp_avg": torch.arange(16.0) * (rank + 1)}
    state = {"state_dict": {f"w{rank}": weights}, "optimizer_0": {f"w{rank}": moments}}
    before = {k: {n: _clone(v) for n, v in d.items()} for k, d in state.items()}
    gate = threading.Event()
    undo = _gated_writer(gate)
    seen: dict[str, bool] = {}

    def finish() -> None:  # rank 0: every rank's data must already be on disk
        seen["all_files"] = len(list(directory.glob("*.distcp"))) == size
        seen["metadata"] = (directory / ".metadata").exists()

    try:
        pending = start_async_save(state, directory, group, finish=finish if rank == 0 else None)
        for _ in range(3):  # "optimizer steps" while the writer waits
            weights.mul_(-2.0).add_(1.0)
            moments["exp_avg"].add_(100.0)
        assert not pending.done()
        gate.set()
        pending.wait(120)
    finally:
        undo()
    dist.barrier()
    back = {
        "state_dict": {f"w{r}": torch.zeros(64, 8) for r in range(size)},
        "optimizer_0": {f"w{r}": {"exp_avg": torch.zeros(16)} for r in range(size)},
    }
    dcp.load(back, checkpoint_id=str(directory), process_group=group)
    return {
        "own_equal": torch.equal(back["state_dict"][f"w{rank}"], before["state_dict"][f"w{rank}"])
        and torch.equal(
            back["optimizer_0"][f"w{rank}"]["exp_avg"], before["optimizer_0"][f"w{rank}"]["exp_avg"]
        ),
        "other": back["state_dict"][f"w{1 - rank}"][0, 0].item(),
        "changed": weights[0, 0].item(),
        "finish": seen,
    }


def test_the_written_values_are_those_of_the_moment_the_save_started(tmp_path):
    r0, r1 = world("gloo", 2).run(_save_while_training, str(tmp_path), timeout=240)
    assert r0["own_equal"] and r1["own_equal"]
    assert (r0["other"], r1["other"]) == (2.0, 1.0)  # each rank reads the other's shard
    assert r0["changed"] != 1.0  # the live tensor did change meanwhile
    assert r0["finish"] == {"all_files": True, "metadata": True}
    assert r1["finish"] == {}  # only the publishing rank runs finish


def test_a_failed_write_is_raised_by_wait_naming_the_path(tmp_path):
    from concurrent.futures import Future

    future: Future = Future()
    pending = PendingSave(future, tmp_path / "step=4.ckpt", finish=None)
    future.set_exception(OSError("No space left on device"))
    assert pending.done()
    with pytest.raises(CheckpointError, match=r"step=4.ckpt' failed: OSError: No space left"):
        pending.wait()


def test_finish_errors_and_timeouts_are_raised_by_wait(tmp_path):
    from concurrent.futures import Future

    def finish() -> None:
        raise RuntimeError("rename failed")

    written: Future = Future()
    pending = PendingSave(written, tmp_path / "a", finish=finish)
    with pytest.raises(CheckpointError, match="did not finish within 0.01 s"):
        pending.wait(0.01)
    written.set_result(None)
    with pytest.raises(CheckpointError, match="RuntimeError: rename failed"):
        pending.wait()


def test_replicas_split_their_tensors_evenly_and_alike_on_every_rank():
    """dcp_save.split_replicas: each replicated tensor goes to exactly one holder, the bytes
    split evenly, a tensor only one rank holds stays with it; the same on every rank."""
    from lightning_pp.checkpoint.dcp_save import split_replicas

    both = {("state_dict", f"w{i}"): 4 * (i + 1) for i in range(6)}
    sizes = [{**both, ("state_dict", "tied"): 8}, dict(both)]
    owned = split_replicas(sizes)
    assert owned == split_replicas([dict(s) for s in sizes])  # deterministic
    assert owned[0] & owned[1] == set() and owned[0] | owned[1] == set(sizes[0])
    assert ("state_dict", "tied") in owned[0]
    load = [sum(sizes[0][k] for k in o) for o in owned]
    assert abs(load[0] - load[1]) <= 8, load


def test_staging_buffers_copy_into_the_same_memory_and_refuse_while_busy():
    """StagingBuffers: a copy (not the live tensor), the same buffer at the next save, none
    while the previous copy is still being written; a tensor gone from the state is freed."""
    from lightning_pp.checkpoint.async_save import StagingBuffers

    w, b = torch.arange(6.0).view(2, 3).t(), torch.ones(3)  # a non-contiguous source too
    buffers = StagingBuffers()
    first = buffers.stage({"m": {"w": w, "b": b}}, fallback=lambda sd: sd)
    assert first is not None and torch.equal(first["m"]["w"], w)
    assert first["m"]["w"].data_ptr() != w.data_ptr()
    assert buffers.stage({"m": {"w": w}}, fallback=lambda sd: sd) is None  # busy
    buffers.release()
    w.add_(1.0)
    second = buffers.stage({"m": {"w": w}}, fallback=lambda sd: sd)
    assert second["m"]["w"].data_ptr() == first["m"]["w"].data_ptr()
    assert torch.equal(second["m"]["w"], w)
    assert buffers.nbytes == w.numel() * 4  # b's buffer was dropped
