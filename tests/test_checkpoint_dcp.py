"""The DCP checkpoint format (:mod:`lightning_pp.checkpoint.dcp_format`) at engine level.

Every rank of the shared 4-rank gloo world trains the same 8-layer model (an embedding tied to
the output head, blocks holding a buffer) for 3 Adam steps in full, in one process, then keeps
only the layers its pipeline rank holds under a given shape, with the optimizer state of those
parameters: exactly what a pipeline rank holds after those steps. It saves; a fresh model
(other initial weights) of another shape loads; every tensor and every optimizer moment must
equal the single-process reference bitwise, the tied weight's too, whichever rank holds which
copy. Shapes: 1F1B pp=2 x dp=2, pp=4, interleaved pp=2 x vpp=2 x dp=2, zbv (V placement, the
tie inside one rank), dp=4 (every rank everything); then one process without a process group.

Worlds of their own: a rank killed inside the DCP write, and rank 0 killed before the completion
marker; neither leaves a complete-looking directory, and the previous checkpoint still loads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import DistributedFailure
from torch import nn
from worlds import World, world

from lightning_pp.checkpoint.by_name import optimizer_state_by_name, tied_canonical_names
from lightning_pp.checkpoint.dcp_format import (
    consolidated_dcp_state_dict,
    is_dcp_checkpoint,
    load_dcp_checkpoint,
    read_dcp_checkpoint_meta,
    save_dcp_checkpoint,
)
from lightning_pp.checkpoint.errors import CheckpointError
from lightning_pp.layout.partition import partition_layers
from lightning_pp.schedules import build_schedule
from lightning_pp.strategy.model import PipelineLayers, select_layers

pytestmark = [pytest.mark.quick, pytest.mark.timeout(400)]

LAYERS, VOCAB, DIM, STEPS = 8, 12, 8, 3


class Block(nn.Module):
    """A residual block with a persistent buffer (buffers are stored by name too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * self.scale


class Model(nn.Module):
    """Embedding, 6 blocks, a head whose weight is the embedding's (tied across stages)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        builders = [lambda: nn.Embedding(VOCAB, DIM)]
        builders += [Block for _ in range(LAYERS - 2)]
        builders += [lambda: nn.Linear(DIM, VOCAB)]
        self.layers = PipelineLayers(builders, seed=seed, tied=[("0.weight", "7.weight")])


def _adam(module: nn.Module) -> torch.optim.Optimizer:
    params = list(module.parameters())
    return torch.optim.Adam(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def _reference() -> tuple[Model, torch.optim.Optimizer]:
    """The single-process run: 3 Adam steps of the whole model (the same on every rank)."""
    model = Model(seed=0)
    opt = _adam(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (4, 5), generator=g)
        opt.zero_grad()
        F.cross_entropy(model.layers(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
    return model, opt


def _held(shape: dict, rank: int) -> tuple[list[int], int]:
    """(the layers this rank holds, its dp rank) under ``shape``: pp outermost, then dp."""
    pp, dp = shape["pp"], shape.get("dp", 1)
    sched = build_schedule(shape["schedule"], pp, 2 * pp, shape.get("vpp"))
    ranges = partition_layers(LAYERS, pp, sched.vpp)
    pp_rank = rank // dp
    return sorted(i for s in sched.stages_of(pp_rank) for i in ranges[s]), rank % dp


def _pipeline_rank(shape: dict, rank: int) -> tuple[Model, torch.optim.Optimizer]:
    """What a pipeline rank holds after the reference's steps: its layers, their state."""
    model, full_opt = _reference()
    held, _ = _held(shape, rank)
    model.layers.keep_only(held)  # the kept parameters are the reference's own objects
    opt = _adam(model)
    for p in model.parameters():
        opt.state[p] = full_opt.state[p]
    return model, opt


def _canonical(model: Model) -> dict[str, str]:
    return tied_canonical_names(model, model.layers)


def _save(rank: int, size: int, path: str, shape: dict, step: int = STEPS) -> list[str]:
    model, opt = _pipeline_rank(shape, rank)
    canonical = _canonical(model)
    ckpt = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer_state_by_name(opt, model, canonical)],
        "global_step": step,
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 1}}}},
    }
    save_dcp_checkpoint(ckpt, path, canonical=canonical, layout={**shape, "world_size": size})
    return sorted(model.state_dict())


def _fresh(shape: dict, rank: int) -> tuple[Model, torch.optim.Optimizer]:
    """A new rank of ``shape``: other initial weights, an optimizer with no state yet."""
    held, _ = _held(shape, rank)
    with select_layers(held):
        model = Model(seed=1)
    return model, _adam(model)


def _compare(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """What differs from the reference (bitwise): tensors, moments, step counts, groups."""
    ref, ref_opt = _reference()
    ref_sd, ref_params = ref.state_dict(), dict(ref.named_parameters(remove_duplicate=False))
    diffs = [k for k, v in model.state_dict().items() if not torch.equal(v, ref_sd[k])]
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, n)
    for group in opt.param_groups:
        for p in group["params"]:
            name = names[p]
            ref_p = ref_params[name]
            want = ref_opt.state[ref_p]
            got = opt.state.get(p, {})
            if set(got) != set(want) or not all(torch.equal(got[k], want[k]) for k in want):
                diffs.append(f"optimizer state of {name}")
            ref_group = next(
                g for g in ref_opt.param_groups if any(q is ref_p for q in g["params"])
            )
            if group["weight_decay"] != ref_group["weight_decay"]:
                diffs.append(f"weight_decay of {name}")
    return diffs


def _load(rank: int, size: int, path: str, shape: dict) -> dict:
    model, opt = _fresh(shape, rank)
    meta = load_dcp_checkpoint(path, model, canonical=_canonical(model), optimizers=[opt])
    return {
        "diffs": _compare(model, opt),
        "step": meta["global_step"],
        "held": model.layers.built_indices,
        "tied_local": "layers.7.weight" in model.state_dict(),
    }


def _save_then_load_everywhere(rank: int, size: int, root: str) -> dict:
    saved = {
        "pp2dp2": {"schedule": "1f1b", "pp": 2, "dp": 2},
        "zbv_pp4": {"schedule": "zbv", "pp": 4},
    }
    loads = {
        "pp4": {"schedule": "1f1b", "pp": 4},
        "pp2vpp2dp2": {"schedule": "interleaved", "pp": 2, "vpp": 2, "dp": 2},
        "zbv_pp2dp2": {"schedule": "zbv", "pp": 2, "dp": 2},
        "dp4": {"schedule": "1f1b", "pp": 1, "dp": 4},
        "pp2dp2": saved["pp2dp2"],
    }
    out: dict = {}
    for sname, shape in saved.items():
        path = str(Path(root) / f"{sname}.ckpt")
        _save(rank, size, path, shape)
        for lname, lshape in loads.items():
            out[f"{sname}->{lname}"] = _load(rank, size, path, lshape)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("dcp")
    return root, world("gloo", 4).run(_save_then_load_everywhere, str(root), timeout=300)


def test_any_shape_loads_any_other_bitwise(saved):
    _, ranks = saved
    for r, result in enumerate(ranks):
        for case, got in result.items():
            assert got["diffs"] == [], (r, case, got)
            assert got["step"] == STEPS
    # the cases are what they claim: V placement holds both tied layers on one rank
    assert ranks[0]["pp2dp2->zbv_pp2dp2"]["held"] == [0, 1, 6, 7]
    assert ranks[0]["pp2dp2->zbv_pp2dp2"]["tied_local"]
    assert ranks[0]["zbv_pp4->pp4"]["held"] == [0, 1] and ranks[3]["zbv_pp4->pp4"]["held"] == [6, 7]


def test_tied_weights_are_stored_once_with_their_optimizer_state(saved):
    root, _ = saved
    for name in ("pp2dp2", "zbv_pp4"):
        meta = read_dcp_checkpoint_meta(root / f"{name}.ckpt")
        assert "layers.7.weight" not in meta["model"] and "layers.0.weight" in meta["model"]
        assert meta["tied"] == [["layers.0.weight", "layers.7.weight"]]
        opt = meta["optimizers"][0]
        assert "layers.0.weight" in opt["tensors"] and "layers.7.weight" not in opt["tensors"]
        assert sorted(opt["tensors"]["layers.0.weight"]) == ["exp_avg", "exp_avg_sq", "step"]


def test_data_parallel_replicas_write_each_tensor_once(saved):
    """DCP's save planner deduplicates the replicas' identical names: the data files hold
    exactly the bytes the metadata indexes, no second copy."""
    from lightning_pp.checkpoint.dcp_safe import read_dcp_metadata

    root, _ = saved
    path = root / "pp2dp2.ckpt"
    md = read_dcp_metadata(path / ".metadata")
    indexed = sum(info.length for info in md.storage_data.values())
    written = sum(f.stat().st_size for f in path.glob("*.distcp"))
    assert written == indexed
    fqns = [index.fqn for index in md.storage_data]
    assert len(fqns) == len(set(fqns))
    assert "state_dict.layers.0.weight" in fqns


def test_one_process_consolidates_and_loads(saved):
    root, _ = saved
    ref, _ = _reference()
    for name in ("pp2dp2", "zbv_pp4"):
        state = consolidated_dcp_state_dict(root / f"{name}.ckpt")
        assert sorted(state) == sorted(ref.state_dict())  # every name, tied members too
        assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
        assert state["layers.7.weight"] is state["layers.0.weight"]
        # the unpipelined module and its optimizer, without a process group
        model, opt = _fresh({"schedule": "1f1b", "pp": 1}, 0)
        meta = load_dcp_checkpoint(
            root / f"{name}.ckpt", model, canonical=_canonical(model), optimizers=[opt]
        )
        assert _compare(model, opt) == [] and meta["global_step"] == STEPS
        assert model.layers[0].weight is model.layers[7].weight  # still one tensor


def test_checkpoint_layout_files(saved):
    root, _ = saved
    path = root / "pp2dp2.ckpt"
    assert is_dcp_checkpoint(path)
    names = sorted(p.name for p in path.iterdir())
    assert {".metadata", "complete.json"} <= set(names)
    assert not any(p.suffix in (".pt", ".pkl") for p in path.iterdir())
    assert not list(root.glob(".*partial*"))


# ------------------------------------------------------------------------- failures
def _failing_write(rank: int, size: int, path: str) -> str:
    """Rank 1's data write raises: every rank raises, nothing is published."""
    import torch.distributed.checkpoint as dcp

    real = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("No space left on device")
        return real(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_data
    try:
        _save(rank, size, path, {"schedule": "1f1b", "pp": 2}, step=99)
    except CheckpointError as exc:
        return str(exc)
    finally:
        dcp.FileSystemWriter.write_data = real
    return "no error"


def test_a_failed_write_raises_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    w = world("gloo", 2)
    w.run(_save, str(path), {"schedule": "1f1b", "pp": 2})
    errors = w.run(_failing_write, str(path))
    for e in errors:
        assert "saving checkpoint" in e and "No space left on device" in e, e
    assert not list(tmp_path.glob(".*partial*"))
    assert read_dcp_checkpoint_meta(path)["lightning"]["global_step"] == STEPS


def _die_during(rank: int, size: int, path: str, where: str) -> None:
    """Save once (complete), then die inside the second save: rank 1 in its DCP data write, or
    rank 0 after the metadata, before the completion marker."""
    import torch.distributed.checkpoint as dcp

    import lightning_pp.checkpoint.dcp_save as save_mod

    _save(rank, size, path, {"schedule": "1f1b", "pp": 2})
    if where == "data" and rank == 1:
        real = dcp.FileSystemWriter.write_data

        def write_data(self, plan, planner):
            real(self, plan, planner)  # the file is written, the result never reported
            os._exit(17)

        dcp.FileSystemWriter.write_data = write_data
    if where == "marker" and rank == 0:

        def write_manifest(directory, extra=None):
            os._exit(17)

        save_mod.write_manifest = write_manifest
    _save(rank, size, path, {"schedule": "1f1b", "pp": 2}, step=99)


@pytest.mark.parametrize("where", ["data", "marker"])
def test_a_killed_save_never_looks_complete(tmp_path, where):
    path = tmp_path / "last.ckpt"
    doomed = World("gloo", 2)
    try:
        with pytest.raises(DistributedFailure):
            doomed.run(_die_during, str(path), where, timeout=60)
    finally:
        doomed.close()
    partial = list(tmp_path.glob(".last.ckpt.partial-*"))
    assert len(partial) == 1 and not is_dcp_checkpoint(partial[0])
    if where == "marker":
        assert (partial[0] / "meta.json").exists()  # written, but no marker after it
    with pytest.raises(CheckpointError):
        read_dcp_checkpoint_meta(partial[0])
    # the previous checkpoint is intact and loads
    assert read_dcp_checkpoint_meta(path)["lightning"]["global_step"] == STEPS
    ref, _ = _reference()
    state = consolidated_dcp_state_dict(path)
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())


# ------------------------------------------------------------------------- async
def _async_save_while_training(rank: int, size: int, path: str) -> dict:
    """The write held at a gate while the "next steps" change every tensor in place: the
    checkpoint must hold the values of the moment the save started, and appear only when done."""
    import threading

    import torch.distributed.checkpoint as dcp

    from lightning_pp.checkpoint.async_save import checkpoint_group
    from lightning_pp.checkpoint.dcp_save import start_async_dcp_checkpoint

    shape = {"schedule": "1f1b", "pp": 2}
    group = checkpoint_group()
    model, opt = _pipeline_rank(shape, rank)
    canonical = _canonical(model)
    ckpt = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer_state_by_name(opt, model, canonical)],
        "global_step": STEPS,
    }
    gate = threading.Event()
    real = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        assert gate.wait(60), "the test never opened the gate"
        return real(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_data
    try:
        pending = start_async_dcp_checkpoint(
            ckpt, path, canonical=canonical, layout=shape, writer_group=group
        )
        with torch.no_grad():  # what the next optimizer steps do, in place
            for p in model.parameters():
                p.add_(1.0)
            for st in opt.state.values():
                st["exp_avg"].mul_(-3.0)
        seen_early = {"done": pending.done(), "published": Path(path).exists()}
        gate.set()
        pending.wait(120)
    finally:
        dcp.FileSystemWriter.write_data = real
    dist.barrier()  # rank 0 published before anyone loads
    fresh, fresh_opt = _fresh({"schedule": "1f1b", "pp": 1, "dp": 2}, rank)
    load_dcp_checkpoint(path, fresh, canonical=_canonical(fresh), optimizers=[fresh_opt])
    return {**seen_early, "diffs": _compare(fresh, fresh_opt)}


def test_an_async_save_writes_the_values_of_its_start_and_publishes_when_done(tmp_path):
    path = tmp_path / "async.ckpt"
    for r in world("gloo", 2).run(_async_save_while_training, str(path), timeout=240):
        assert r == {"done": False, "published": False, "diffs": []}, r
    assert is_dcp_checkpoint(path) and not list(tmp_path.glob(".*partial*"))


# ------------------------------------------------------------------------- refusals, one process
@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The reference saved by one process (no process group): the unpipelined module."""
    path = tmp_path_factory.mktemp("one") / "whole.ckpt"
    _save(0, 1, str(path), {"schedule": "1f1b", "pp": 1})
    return path


def _refused(path: Path, model: nn.Module, opt: torch.optim.Optimizer, match: str) -> None:
    """The load raises ``match`` and leaves the module and its optimizer untouched."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        load_dcp_checkpoint(path, model, canonical=_canonical(model), optimizers=[opt])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state


def test_refused_before_anything_changes(whole, tmp_path):
    model, opt = _fresh({"schedule": "1f1b", "pp": 1}, 0)
    one_group = torch.optim.Adam([{"params": list(model.parameters()), "weight_decay": 0.1}])
    _refused(whole, model, one_group, r"weight_decay: 0.1 vs 0.0")
    with select_layers([0, 1, 2]):
        part = Model(seed=1)
    with pytest.raises(CheckpointError, match="belong to no rank"):
        load_dcp_checkpoint(whole, part, canonical=_canonical(part))  # strict: the rest unused
    meta = load_dcp_checkpoint(whole, part, canonical=_canonical(part), strict=False)
    assert meta["global_step"] == STEPS
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(whole, damaged)
    data = sorted(damaged.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-10])
    _refused(damaged, model, opt, data.name)
    assert not is_dcp_checkpoint(tmp_path / "nothing.ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_dcp_checkpoint_meta(tmp_path / "nothing.ckpt")


def test_a_shape_mismatch_names_the_tensor(whole):
    model, opt = _fresh({"schedule": "1f1b", "pp": 1}, 0)
    model.layers[3].lin = nn.Linear(DIM, DIM + 1)
    _refused(whole, model, opt, r"layers.3.lin.weight: saved \(8, 8\), here \(9, 8\)")


def test_one_process_round_trip_keeps_hyperparameter_types(whole):
    meta = read_dcp_checkpoint_meta(whole)
    groups = meta["optimizers"][0]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert groups[0]["betas"] == (0.9, 0.999)  # a tuple stays a tuple (no pickle, no loss)
    assert meta["layout"] == {"schedule": "1f1b", "pp": 1, "world_size": 1}
    assert meta["lightning"]["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1


def _edited(whole: Path, tmp_path: Path, edit) -> Path:
    """A copy of ``whole`` whose metadata ``edit`` changed, its manifest rewritten to match
    (what a careless tool or an attacker does): only the metadata's own checks remain."""
    from lightning_pp.checkpoint.manifest import MANIFEST, write_manifest
    from lightning_pp.checkpoint.meta_codec import read_meta, write_meta

    path = tmp_path / "edited.ckpt"
    shutil.copytree(whole, path)
    meta = read_meta(path)
    edit(meta)
    write_meta(path, meta)
    (path / MANIFEST).unlink()
    write_manifest(path, {})
    return path


def test_edited_metadata_is_refused_naming_the_file(whole, tmp_path):
    def drop_shapes(meta):
        meta["model"]["layers.1.lin.weight"] = "float32"

    path = _edited(whole, tmp_path, drop_shapes)
    with pytest.raises(CheckpointError, match=r"meta\.json: 'model' is not"):
        read_dcp_checkpoint_meta(path)


def test_an_oversized_optimizer_state_is_refused_before_allocation(whole, tmp_path):
    def huge(meta):
        meta["optimizers"][0]["tensors"]["layers.1.lin.weight"]["exp_avg"] = ["float32", [10**9]]

    path = _edited(whole, tmp_path, huge)
    model, opt = _fresh({"schedule": "1f1b", "pp": 1}, 0)
    _refused(path, model, opt, r"'exp_avg' of 'layers.1.lin.weight' was saved with shape")
