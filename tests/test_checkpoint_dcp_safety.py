"""The safe reading layer of the DCP checkpoint format, in one process.

- :mod:`lightning_pp.checkpoint.dcp_safe`: a real ``dcp.save`` loads back equal; a ``.metadata``
  or a data file carrying a pickled ``os.system`` payload is refused and the payload never runs
  (and the same payload *does* run through stock DCP, so the files are live);
- :mod:`lightning_pp.checkpoint.meta_codec`: every metadata type round-trips, type for type,
  including a real Lightning ``dump_checkpoint``; another type is refused at save, by key path;
- :mod:`lightning_pp.checkpoint.manifest`: a missing, truncated, swapped, altered or extra file,
  and a save without its marker, are each refused naming the file.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import enum
import json
import math
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from lightning_pp.checkpoint.dcp_safe import (
    SafeFileSystemReader,
    TensorsOnlyLoadPlanner,
    read_dcp_metadata,
    safe_dcp_load,
)
from lightning_pp.checkpoint.errors import CheckpointError
from lightning_pp.checkpoint.manifest import verify_manifest, write_manifest
from lightning_pp.checkpoint.meta_codec import META_JSON, META_TENSORS, read_meta, write_meta

pytestmark = pytest.mark.quick


class _Payload:
    """Pickles as a call of ``os.system(cmd)``: what a hostile checkpoint would carry."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.cmd,))


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(3, 4),
        "nested": {"a": torch.arange(5), "b": {"c": torch.randn(2, 2).to(torch.bfloat16)}},
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "flag": torch.tensor([True, False]),
        "nc": torch.randn(4, 3).t(),  # non-contiguous
    }


def _zeros_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    return torch.zeros_like(state)


def _save(directory: Path, state: dict[str, Any]) -> Path:
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    return directory


# ------------------------------------------------------------------------------- dcp_safe
def test_safe_load_equals_the_saved_state(tmp_path: Path) -> None:
    state = _state()
    _save(tmp_path, state)
    target = _zeros_like(state)
    safe_dcp_load(target, tmp_path)
    flat = [("w",), ("nested", "a"), ("nested", "b", "c"), ("scalar",), ("flag",), ("nc",)]
    for keys in flat:
        got, want = target, state
        for k in keys:
            got, want = got[k], want[k]
        assert got.dtype == want.dtype and torch.equal(got, want), keys


def test_safe_load_names_a_missing_key(tmp_path: Path) -> None:
    _save(tmp_path, _state())
    with pytest.raises(CheckpointError, match="absent"):
        safe_dcp_load({"absent": torch.zeros(2)}, tmp_path)


def test_metadata_reader_allows_what_dcp_writes(tmp_path: Path) -> None:
    """Every dtype and a bytes item: the allowed set covers a real save's metadata."""
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8]
    dtypes += [torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
    dtypes += [torch.float8_e4m3fn, torch.float8_e5m2]
    state: dict[str, Any] = {f"t{i}": torch.zeros(2, dtype=dt) for i, dt in enumerate(dtypes)}
    state["cl"] = torch.randn(1, 2, 3, 3).to(memory_format=torch.channels_last)
    state["p"] = torch.nn.Parameter(torch.ones(2))
    state["py"] = 3  # a bytes item: its metadata entry is allowed, reading it is not
    _save(tmp_path, state)
    metadata = read_dcp_metadata(tmp_path / ".metadata")
    assert metadata == pickle.loads((tmp_path / ".metadata").read_bytes())  # same object
    assert isinstance(metadata, Metadata) and set(metadata.state_dict_metadata) == set(state)


def test_dtensor_and_optimizer_state_load_through_a_process_group(tmp_path: Path) -> None:
    """DTensors (Shard, Replicate) and get_state_dict's optimizer state, saved and loaded over
    a one-rank gloo group: the collective path and the metadata such saves write."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        state = {
            "model": msd,
            # optimizer state only: param_groups are not tensors (they go to meta_codec)
            "optim": {"state": osd["state"]},
            "shard": distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]),
            "rep": distribute_tensor(torch.randn(4), mesh, [Replicate()]),
        }
        dcp.save(state, checkpoint_id=tmp_path / "ckpt")
        target = {
            "model": {k: torch.zeros_like(v) for k, v in msd.items()},
            "optim": {
                "state": {
                    n: {k: torch.zeros_like(v) for k, v in s.items()}
                    for n, s in osd["state"].items()
                },
            },
            "shard": distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]),
            "rep": distribute_tensor(torch.zeros(4), mesh, [Replicate()]),
        }
        safe_dcp_load(target, tmp_path / "ckpt")
        for k, v in msd.items():
            assert torch.equal(target["model"][k], v), k
        for n, s in osd["state"].items():
            for k, v in s.items():
                assert torch.equal(target["optim"]["state"][n][k], v), (n, k)
        assert torch.equal(target["shard"].full_tensor(), state["shard"].full_tensor())
        assert torch.equal(target["rep"].full_tensor(), state["rep"].full_tensor())
    finally:
        dist.destroy_process_group()


def _assert_payload_live(directory: Path, marker: Path, load: Any) -> None:
    """The stock reader runs the payload: the hostile file is real, so the refusals mean it."""
    with contextlib.suppress(Exception):  # it runs the payload, then fails on its result
        load()
    assert marker.exists(), "the payload did not run through stock DCP: the test proves nothing"
    marker.unlink()


def test_hostile_metadata_is_refused_and_never_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, _state())
    marker = tmp_path / "MARKER"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(f"touch {marker}")))
    _assert_payload_live(tmp_path, marker, dcp.FileSystemReader(tmp_path).read_metadata)
    with pytest.raises(
        CheckpointError, match=r"refusing to unpickle 'posix.system' from .*\.metadata"
    ):
        safe_dcp_load(_zeros_like(_state()), tmp_path)
    with pytest.raises(CheckpointError, match="posix.system"):
        SafeFileSystemReader(tmp_path).read_metadata()
    assert not marker.exists()
    assert "Falling back" not in caplog.text  # DCP's misleading warning is dropped


def test_metadata_pointing_outside_the_directory_is_refused(tmp_path: Path) -> None:
    ckpt = _save(tmp_path / "ckpt", {"w": torch.ones(2)})
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"'w'.*\.\./\.\./etc/passwd.*not a byte range"):
        safe_dcp_load({"w": torch.zeros(2)}, ckpt)


def _bytes_item_checkpoint(directory: Path) -> tuple[Path, dict[str, Any]]:
    """A DCP save whose non-tensor ("bytes") item is the payload, pickled by DCP's writer."""
    marker = directory / "MARKER"
    _save(directory, {"t": torch.ones(2), "evil": _Payload(f"touch {marker}")})
    return marker, {"t": torch.zeros(2), "evil": None}


def test_hostile_bytes_item_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker, target = _bytes_item_checkpoint(tmp_path)
    _assert_payload_live(
        tmp_path,
        marker,
        lambda: dcp.load({"t": torch.zeros(2), "evil": None}, checkpoint_id=tmp_path, no_dist=True),
    )
    with pytest.raises(CheckpointError, match=r"refusing to load non-tensor item\(s\) \['evil'\]"):
        safe_dcp_load(target, tmp_path)
    assert not marker.exists()
    assert torch.equal(target["t"], torch.zeros(2))  # refused before anything was read


@pytest.mark.parametrize("layer", ["reader", "planner"])
def test_each_layer_alone_refuses_a_bytes_item(tmp_path: Path, layer: str) -> None:
    """The reader with the stock planner, and the planner with the stock reader, each refuse."""
    marker, target = _bytes_item_checkpoint(tmp_path)
    if layer == "reader":
        kwargs = {"storage_reader": SafeFileSystemReader(tmp_path)}
        expected = r"refusing the non-tensor item 'evil' of .*__0_0\.distcp"
    else:
        kwargs = {"storage_reader": dcp.FileSystemReader(tmp_path)}
        kwargs["planner"] = TensorsOnlyLoadPlanner()
        expected = r"refusing to load non-tensor item\(s\) \['evil'\]"
    with pytest.raises(BaseException, match=expected):  # DCP wraps it in CheckpointException
        dcp.load(target, no_dist=True, **kwargs)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refusing to unpickle the non-tensor item 'evil'"):
        TensorsOnlyLoadPlanner().load_bytes(_read_item("evil"), None)


def _read_item(fqn: str) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    index = MetadataIndex(fqn)
    return ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), [0])


def test_hostile_tensor_data_is_refused_naming_the_file(tmp_path: Path) -> None:
    """A data file whose tensor item is the payload: torch's weights_only reader refuses it."""
    _save(tmp_path, {"w": torch.ones(2)})
    marker = tmp_path / "MARKER"
    blob = tmp_path / "blob"
    torch.save(_Payload(f"touch {marker}"), blob)
    data = blob.read_bytes()
    blob.unlink()
    (tmp_path / "__0_0.distcp").write_bytes(data)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.offset, info.length = 0, len(data)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"refusing to unpickle 'posix.system' from .*distcp"):
        safe_dcp_load({"w": torch.zeros(2)}, tmp_path)
    assert not marker.exists()


def test_truncated_data_file_is_refused_naming_it(tmp_path: Path) -> None:
    _save(tmp_path, {"w": torch.ones(1000)})
    data = tmp_path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:500])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: a tensor cannot be read"):
        safe_dcp_load({"w": torch.zeros(1000)}, tmp_path)


# ------------------------------------------------------------------------------- meta_codec
class _Color(enum.Enum):
    RED = 1


def _same(a: Any, b: Any, path: str = "") -> None:
    """Equal, type for type, all the way down (a tuple is not a list, 1 is not 1.0)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.requires_grad == b.requires_grad, path
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, float):
        same_sign = math.copysign(1, a) == math.copysign(1, b)
        assert (math.isnan(a) and math.isnan(b)) or (a == b and same_sign), path
    elif isinstance(a, complex):
        _same(a.real, b.real, path)
        _same(a.imag, b.imag, path)
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory, path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, argparse.Namespace):
        _same(vars(a), vars(b), path)
    elif isinstance(a, (datetime.datetime, datetime.time)):
        assert a == b and a.fold == b.fold and a.tzinfo == b.tzinfo, path
        if a.tzinfo is not None:
            assert a.tzinfo.tzname(None) == b.tzinfo.tzname(None), path
    elif type(a).__name__ in ("DictConfig", "ListConfig"):
        from omegaconf import OmegaConf

        assert a == b, path
        assert OmegaConf.to_container(a) == OmegaConf.to_container(b), path
        assert OmegaConf.is_struct(a) == OmegaConf.is_struct(b), path
    else:
        assert a == b, path


def _meta_values() -> dict[str, Any]:
    from lightning.fabric.utilities.data import AttributeDict
    from omegaconf import DictConfig, ListConfig, OmegaConf

    cfg = OmegaConf.create({"lr": 0.1, "model": {"dim": 8, "act": "gelu"}, "alias": "${lr}"})
    OmegaConf.set_struct(cfg, True)
    utc1 = datetime.timezone(datetime.timedelta(hours=1), "CET")
    shared = torch.tensor(0.25)
    return {
        "none": None,
        "bool": True,
        "int": 12345678901234567890,
        "float": 0.1,
        "negzero": -0.0,
        "inf": float("inf"),
        "-inf": float("-inf"),
        "nan": float("nan"),
        "str": "héllo / ~ ${x} \u2603",
        "bytes": b"\x00\xffabc",
        "complex": complex(1.5, float("inf")),
        "list": [1, 2.0, "3"],
        "tuple": (1, (2, 3), []),
        "empty_tuple": (),
        "int_keys": {1: "a", 2: "b"},
        "mixed_keys": {1: "int", "1": "str", (1, 2): "tuple", None: "none", 1.5: "float"},
        "odict": collections.OrderedDict([("b", 1), ("a", 2)]),
        "ddict": collections.defaultdict(list, {"x": [1]}),
        "attrdict": AttributeDict(a=1, b={"c": 2}),
        "set": {1, 2, 3},
        "frozenset": frozenset({"a", "b"}),
        "range": range(1, 10, 3),
        "slice": slice(1, None, 2),
        "namespace": argparse.Namespace(lr=0.1, layers=[1, 2], path=Path("/data")),
        "path": Path("/tmp/some dir/file.ckpt"),
        "purepath": pathlib.PurePosixPath("a/b"),
        "winpath": pathlib.PureWindowsPath("C:\\data\\x"),
        "date": datetime.date(2026, 12, 3),
        "datetime": datetime.datetime(2026, 12, 3, 7, 30, 1, 123456),
        "datetime_tz": datetime.datetime(2026, 12, 3, 7, 30, tzinfo=utc1),
        "datetime_utc": datetime.datetime(2026, 12, 3, tzinfo=datetime.timezone.utc),
        "time": datetime.time(7, 30, 1, 5, fold=1),
        "timedelta": datetime.timedelta(days=-1, seconds=5, microseconds=7),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cuda", 1),
        "tensor": torch.randn(3, 2),
        "tensor0d": torch.tensor(float("inf")),
        "tensor_empty": torch.empty(0, 4),
        "tensor_int": torch.arange(4, dtype=torch.int64),
        "tensor_view": torch.arange(10.0)[::3],
        "tensor_grad": torch.ones(2, requires_grad=True),
        "parameter": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "shared": [shared, shared],
        "dictconfig": cfg,
        "listconfig": OmegaConf.create([1, {"a": None}, "???"]),
        "hparams_type": DictConfig,
        "hparams_type_list": ListConfig,
        "nested": {"a": [{"b": (torch.zeros(1), {2: [float("nan")]})}]},
        "a/b~c": {"x/y": torch.ones(1)},  # pointer escaping of tensor names
    }


def test_meta_round_trips_every_type(tmp_path: Path) -> None:
    meta = _meta_values()
    write_meta(tmp_path, meta)
    back = read_meta(tmp_path)
    _same(meta, back)
    assert back["shared"][0] is back["shared"][1]  # one tensor object stays one
    assert json.loads((tmp_path / META_JSON).read_text())["format"] == "lightning_pp.meta"


def test_meta_round_trips_a_real_lightning_checkpoint(tmp_path: Path) -> None:
    """What Lightning 2.6's dump_checkpoint writes after a short fit: loops, ModelCheckpoint and
    EarlyStopping state (tensor scores, paths), optimizer and scheduler state dicts, the
    precision plugin, OmegaConf hparams and their type."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from omegaconf import OmegaConf

    class Model(BoringModel):
        def __init__(self, cfg: Any) -> None:
            super().__init__()
            self.save_hyperparameters(cfg)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log("train_loss", out["loss"])
            return out

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.1, betas=(0.9, 0.95))
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    cfg = OmegaConf.create({"lr": 0.1, "layers": [4, 4], "name": "${lr}"})
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=tmp_path / "ck", monitor="train_loss", save_top_k=2),
            EarlyStopping(monitor="train_loss", patience=5),
        ],
    )
    trainer.fit(Model(cfg))
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    scores = [v for k, v in checkpoint["callbacks"].items() if k.startswith("ModelCheckpoint")][0][
        "best_k_models"
    ]
    assert scores and all(isinstance(v, torch.Tensor) for v in scores.values())  # real state
    out = tmp_path / "meta"
    out.mkdir()
    write_meta(out, checkpoint)
    _same(checkpoint, read_meta(out))


@pytest.mark.parametrize(
    ("value", "shown", "kind"),
    [
        ({"hyper_parameters": {"act": torch.nn.GELU()}}, "['hyper_parameters']['act']", "GELU"),
        ({"cb": [1, _Color.RED]}, "['cb'][1]", "_Color"),
        ({"f": {"fn": print}}, "['f']['fn']", "builtin_function_or_method"),
        ({"cls": {"c": dict}}, "['cls']['c']", "type"),
        ({"d": collections.defaultdict(lambda: 0)}, "['d']", "defaultdict"),
        ({"t": torch.zeros(2).to_sparse()}, "['t']", "Tensor"),
        (
            {"tz": datetime.datetime(2026, 1, 1, tzinfo=__import__("zoneinfo").ZoneInfo("UTC"))},
            "['tz']['tzinfo']",
            "ZoneInfo",
        ),
    ],
)
def test_meta_refuses_other_types_at_save_naming_the_key(
    tmp_path: Path, value: dict[str, Any], shown: str, kind: str
) -> None:
    with pytest.raises(CheckpointError, match=r"cannot save checkpoint" + _re(shown) + f".*{kind}"):
        write_meta(tmp_path, value)
    assert not (tmp_path / META_JSON).exists() and not (tmp_path / META_TENSORS).exists()


def test_meta_refuses_a_container_holding_itself(tmp_path: Path) -> None:
    loop: dict[str, Any] = {"a": [1]}
    loop["a"].append(loop)
    with pytest.raises(CheckpointError, match=r"checkpoint\['x'\]\['a'\]\[1\].*contains itself"):
        write_meta(tmp_path, {"x": loop})


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_meta_refuses_an_unknown_tag_naming_meta_json(tmp_path: Path) -> None:
    write_meta(tmp_path, {"a": (1, 2)})
    path = tmp_path / META_JSON
    doc = json.loads(path.read_text())
    doc["meta"]["v"]["a"] = {"$type": "os.system", "v": ["touch x"]}
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"meta\.json: unknown type tag 'os.system'"):
        read_meta(tmp_path)


def test_meta_refuses_a_tensor_file_from_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_meta(tmp_path / "a", {"x": torch.ones(1)})
    write_meta(tmp_path / "b", {"y": torch.ones(1)})
    (tmp_path / "b" / META_TENSORS).replace(tmp_path / "a" / META_TENSORS)
    with pytest.raises(CheckpointError, match=r"meta\.safetensors lacks the tensor '/x'"):
        read_meta(tmp_path / "a")


# ------------------------------------------------------------------------------- manifest
def _checkpoint_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    _save(directory, _state())
    write_meta(directory, {"epoch": 1})
    (directory / "sub").mkdir()
    (directory / "sub" / "x.bin").write_bytes(b"abc" * 1000)
    write_manifest(directory, extra={"pp": 2})
    return directory


def test_manifest_lists_every_file_and_verifies(tmp_path: Path) -> None:
    directory = _checkpoint_dir(tmp_path)
    manifest = verify_manifest(directory)
    assert set(manifest["files"]) == {
        ".metadata",
        "__0_0.distcp",
        META_JSON,
        META_TENSORS,
        "sub/x.bin",
    }
    assert manifest["extra"] == {"pp": 2}
    assert manifest["files"]["sub/x.bin"]["size"] == 3000


def test_manifest_missing_marker_is_an_incomplete_save(tmp_path: Path) -> None:
    directory = _checkpoint_dir(tmp_path)
    (directory / "complete.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"complete\.json is missing: the save did not finish"
    ):
        verify_manifest(directory)


def test_manifest_refuses_a_missing_file(tmp_path: Path) -> None:
    directory = _checkpoint_dir(tmp_path)
    (directory / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        verify_manifest(directory)


def test_manifest_refuses_a_truncated_file(tmp_path: Path) -> None:
    directory = _checkpoint_dir(tmp_path)
    path = directory / "sub" / "x.bin"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"sub/x\.bin has 2999 bytes where .* lists 3000"):
        verify_manifest(directory)


def test_manifest_refuses_a_swapped_file_of_the_same_size(tmp_path: Path) -> None:
    directory = _checkpoint_dir(tmp_path)
    path = directory / "sub" / "x.bin"
    path.write_bytes(b"abd" * 1000)  # same size, other bytes
    with pytest.raises(CheckpointError, match=r"sub/x\.bin: its sha256 differs"):
        verify_manifest(directory)
    verify_manifest(directory, hashes=False)  # sizes and names alone do not see it


def test_manifest_refuses_a_swapped_shard_between_checkpoints(tmp_path: Path) -> None:
    first = _checkpoint_dir(tmp_path)
    second = tmp_path / "second"
    _save(second, {k: v + 1 if v.dtype != torch.bool else ~v for k, v in _flat(_state())})
    (second / "__0_0.distcp").replace(first / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp"):
        verify_manifest(first)


def _flat(state: dict[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    out = []
    for k, v in state.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]
    return out


def test_manifest_refuses_an_extra_file(tmp_path: Path) -> None:
    directory = _checkpoint_dir(tmp_path)
    (directory / "sub" / "planted.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"sub/planted\.distcp is not listed in"):
        verify_manifest(directory)


def test_manifest_refuses_a_tampered_marker(tmp_path: Path) -> None:
    directory = _checkpoint_dir(tmp_path)
    marker = directory / "complete.json"
    doc = json.loads(marker.read_text())
    doc["files"]["../outside"] = {"size": 0, "sha256": ""}
    marker.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"complete\.json is not a lightning_pp\.manifest"):
        verify_manifest(directory)


def test_manifest_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    directory = _checkpoint_dir(tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [".metadata", "__0_0.distcp", META_JSON, META_TENSORS, "sub", "complete.json"]
    )
