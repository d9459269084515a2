"""Lightning's checkpoint metadata (loops, callbacks, schedulers, hparams...) without pickle.

``write_meta`` splits the dict Lightning's ``_CheckpointConnector.dump_checkpoint`` returns (less
what the strategy saves through DCP) into two files that hold data only:

- ``meta.json``: the structure, as tagged JSON. JSON strings, ints, finite floats, booleans,
  null and lists stand for themselves; every other value is an object whose ``"$type"`` names
  one of a fixed set of types (:data:`TAGS`): ``{"$type": "tuple", "v": [1, 2]}``.
- ``meta.safetensors``: every tensor (ModelCheckpoint's scores, a GradScaler's scale...),
  keyed by its JSON pointer in the structure (``/callbacks/ModelCheckpoint{...}/best_model_score``).

The types are those today's ``meta.pt`` reader allows (``sharded.META_SAFE_GLOBALS``) plus
torch's own: None, bool, int, float (inf and nan included), str, bytes, complex, list, tuple,
dict (any hashable encodable keys: ints, tuples ...), OrderedDict, defaultdict (of a builtin
factory), Lightning's AttributeDict, set, frozenset, range, slice, argparse.Namespace, pathlib
paths, datetime's date/datetime/time/timedelta/timezone, tensors (and Parameters), torch.dtype,
torch.Size, torch.device, OmegaConf DictConfig/ListConfig and those two classes themselves
(``hparams_type``). Subclasses are not these types: an IntEnum, a numpy scalar or a user's
class is refused **when saving**, with its key path and type; nothing is dropped silently.
Reading constructs only these types; it imports nothing named by the files.

Example::

    write_meta(tmp_dir, {"epoch": 3, "loops": {...}, "hyper_parameters": {"lr": 1e-3}})
    meta = read_meta(tmp_dir)     # equal, type for type
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import datetime
import json
import math
import os
import pathlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import CheckpointError

__all__ = ["META_JSON", "META_TENSORS", "TAGS", "read_meta", "write_meta"]

META_JSON = "meta.json"
META_TENSORS = "meta.safetensors"
FORMAT = "lightning_pp.meta"
VERSION = 1
_T = "$type"
_MAX_DEPTH = 200  # deeper than any real metadata; also stops self-referencing containers

# defaultdict factories that are builtin types (calling one builds an empty value, nothing else)
_FACTORIES: dict[str, Any] = {
    f.__name__: f for f in (list, dict, set, int, float, str, tuple, bool, frozenset)
}
_PATHS: dict[str, type] = {
    "PosixPath": pathlib.PosixPath if os.name != "nt" else pathlib.PurePosixPath,
    "WindowsPath": pathlib.WindowsPath if os.name == "nt" else pathlib.PureWindowsPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}


def _omegaconf() -> Any:
    try:
        import omegaconf
    except ImportError:  # optional: only OmegaConf hparams need it
        return None
    return omegaconf


def _attribute_dict() -> type | None:
    try:
        from lightning.fabric.utilities.data import AttributeDict
    except ImportError:
        return None
    return AttributeDict


def _show(path: tuple[Any, ...]) -> str:
    """A key path as Python subscripts, for messages: ``checkpoint['callbacks'][0]``."""
    return "checkpoint" + "".join(f"[{p!r}]" for p in path)


def _pointer(path: tuple[Any, ...]) -> str:
    """A key path as a JSON pointer (RFC 6901: ``~`` -> ``~0``, ``/`` -> ``~1``), the tensor's
    name in meta.safetensors; a non-string key is written as its repr."""
    parts = (p if isinstance(p, str) else repr(p) for p in path)
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


# ------------------------------------------------------------------------------- encoding
class _Encoder:
    """One save: builds the JSON structure and collects the tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._by_id: dict[int, str] = {}  # the same tensor object twice is stored once
        self._active: set[int] = set()  # containers being encoded: a cycle is refused

    def refuse(self, path: tuple[Any, ...], value: Any, why: str = "") -> CheckpointError:
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        return CheckpointError(
            f"cannot save {_show(path)}: a {kind}{why}. Checkpoint metadata is written as JSON "
            f"and safetensors (no pickle), which hold only plain data types, tensors, paths, "
            f"dates, namespaces and OmegaConf containers (lightning_pp.checkpoint.meta_codec); "
            f"store this value as one of those (e.g. a str or a dict) in on_save_checkpoint"
        )

    def __call__(self, value: Any, path: tuple[Any, ...] = ()) -> Any:
        if len(path) > _MAX_DEPTH:
            raise self.refuse(path, value, " nested deeper than the metadata limit")
        kind = type(value)
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return value if math.isfinite(value) else {_T: "float", "v": repr(value)}
        if kind is list or kind is tuple or kind in (set, frozenset):
            items = self._items(value, path)
            return items if kind is list else {_T: kind.__name__, "v": items}
        if isinstance(value, dict):
            return self._dict(value, path)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, type):  # Lightning's hparams_type: a class, as a value
            return _enc_class(self, value, path)
        encode = _ENCODERS.get(kind)
        if encode is None:
            encode = _late_encoder(kind)
        if encode is None:
            raise self.refuse(path, value)
        return encode(self, value, path)

    def _items(self, value: Any, path: tuple[Any, ...]) -> list[Any]:
        with self._visiting(value, path):
            return [self(v, (*path, i)) for i, v in enumerate(value)]

    @contextlib.contextmanager
    def _visiting(self, value: Any, path: tuple[Any, ...]) -> Iterator[None]:
        if id(value) in self._active:
            raise self.refuse(path, value, " that contains itself")
        self._active.add(id(value))
        try:
            yield
        finally:
            self._active.discard(id(value))

    def _dict(self, value: dict, path: tuple[Any, ...]) -> dict[str, Any]:
        kind = type(value)
        out: dict[str, Any]
        if kind is dict:
            out = {_T: "dict"}
        elif kind is collections.OrderedDict:
            out = {_T: "OrderedDict"}
        elif kind is collections.defaultdict:
            factory = value.default_factory
            if (
                factory is not None
                and _FACTORIES.get(getattr(factory, "__name__", "")) is not factory
            ):
                raise self.refuse(path, value, f" whose default_factory is {factory!r}")
            out = {_T: "defaultdict", "factory": None if factory is None else factory.__name__}
        elif kind is _attribute_dict():
            out = {_T: "AttributeDict"}
        else:
            raise self.refuse(path, value)
        with self._visiting(value, path):
            if all(type(k) is str for k in value):
                out["v"] = {k: self(v, (*path, k)) for k, v in value.items()}
            else:  # int, tuple, ... keys: a list of [key, value] pairs keeps their types
                out["items"] = [[self._key(k, path), self(v, (*path, k))] for k, v in value.items()]
        return out

    def _key(self, key: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(key, torch.Tensor):  # hashed by identity: cannot be a key after a reload
            raise self.refuse((*path, key), key, " used as a dict key")
        return self(key, (*path, key))

    def _tensor(self, value: torch.Tensor, path: tuple[Any, ...]) -> dict[str, Any]:
        kind = type(value)
        if kind not in (torch.Tensor, torch.nn.Parameter) or value.layout != torch.strided:
            raise self.refuse(path, value, f" (layout {value.layout})")
        if value.is_quantized or value.device.type == "meta":
            raise self.refuse(path, value, f" on {value.device} (quantized or meta)")
        out: dict[str, Any] = {_T: "Parameter" if kind is torch.nn.Parameter else "Tensor"}
        if value.requires_grad:
            out["requires_grad"] = True
        key = self._by_id.get(id(value))
        if key is None:
            key = _pointer(path)
            while key in self.tensors:  # an int key 1 and a str key "1" have one pointer
                key += "#"
            # a copy: safetensors refuses tensors sharing storage, and a view saves its whole
            # storage under torch.save but only its elements here
            self.tensors[key] = value.detach().to("cpu", copy=True).contiguous()
            self._by_id[id(value)] = key
        out["key"] = key
        return out


def _enc_tz(enc: _Encoder, value: Any, path: tuple[Any, ...]) -> Any:
    if value is None:
        return None
    if type(value) is not datetime.timezone:  # zoneinfo, pytz, dateutil: refused by name
        raise enc.refuse((*path, "tzinfo"), value, " (only datetime.timezone is kept)")
    # (offset,) or (offset, name): the arguments timezone's own pickling uses
    return {_T: "timezone", "v": [enc(a, path) for a in value.__getinitargs__()]}


_DT_FIELDS: dict[type, tuple[str, ...]] = {
    datetime.date: ("year", "month", "day"),
    datetime.datetime: ("year", "month", "day", "hour", "minute", "second", "microsecond"),
    datetime.time: ("hour", "minute", "second", "microsecond"),
}


def _enc_date(enc: _Encoder, value: Any, path: tuple[Any, ...]) -> Any:
    out = {_T: type(value).__name__, "v": [getattr(value, a) for a in _DT_FIELDS[type(value)]]}
    if type(value) is not datetime.date:
        out["fold"] = value.fold
        out["tz"] = _enc_tz(enc, value.tzinfo, path)
    return out


_ENCODERS: dict[type, Callable[[_Encoder, Any, tuple[Any, ...]], Any]] = {
    bytes: lambda e, v, p: {_T: "bytes", "v": base64.b64encode(v).decode("ascii")},
    complex: lambda e, v, p: {_T: "complex", "v": [e(v.real, p), e(v.imag, p)]},
    range: lambda e, v, p: {_T: "range", "v": [v.start, v.stop, v.step]},
    slice: lambda e, v, p: {_T: "slice", "v": e._items([v.start, v.stop, v.step], p)},
    argparse.Namespace: lambda e, v, p: {_T: "Namespace", "v": e(vars(v), p)},
    datetime.date: _enc_date,
    datetime.datetime: _enc_date,
    datetime.time: _enc_date,
    datetime.timedelta: lambda e, v, p: {_T: "timedelta", "v": [v.days, v.seconds, v.microseconds]},
    datetime.timezone: _enc_tz,
    torch.dtype: lambda e, v, p: {_T: "dtype", "v": str(v).removeprefix("torch.")},
    torch.Size: lambda e, v, p: {_T: "Size", "v": list(v)},
    torch.device: lambda e, v, p: {_T: "device", "v": str(v)},
    **{
        cls: (lambda e, v, p: {_T: type(v).__name__, "v": str(v)})
        for cls in (
            pathlib.PosixPath,
            pathlib.WindowsPath,
            pathlib.PurePosixPath,
            pathlib.PureWindowsPath,
        )
    },
}


def _late_encoder(kind: type) -> Callable[[_Encoder, Any, tuple[Any, ...]], Any] | None:
    """Encoders of optional libraries' types (OmegaConf), looked up only when one is met."""
    oc = _omegaconf()
    if oc is None:
        return None
    if kind in (oc.DictConfig, oc.ListConfig):
        return _enc_omegaconf
    return None


def _enc_omegaconf(enc: _Encoder, value: Any, path: tuple[Any, ...]) -> Any:
    oc = _omegaconf()
    # resolve=False keeps interpolations ("${lr}") and "???" as written; a structured config's
    # dataclass becomes a dict (rebuilding it would import a user class)
    content = oc.OmegaConf.to_container(value, resolve=False, enum_to_str=False)
    flags = {
        "struct": oc.OmegaConf.is_struct(value),
        "readonly": oc.OmegaConf.is_readonly(value),
    }
    return {_T: type(value).__name__, "v": enc(content, path), "flags": flags}


def _enc_class(enc: _Encoder, value: Any, path: tuple[Any, ...]) -> Any:
    oc = _omegaconf()
    if oc is not None and value in (oc.DictConfig, oc.ListConfig):
        return {_T: "class", "v": value.__name__}  # Lightning's hparams_type
    raise enc.refuse(path, value, f" ({value!r}: a class is code, only OmegaConf's are kept)")


# ------------------------------------------------------------------------------- decoding
class _Decoder:
    """One read: rebuilds the structure, taking tensors from meta.safetensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], json_path: Path) -> None:
        self.tensors = tensors
        self.used: set[str] = set()
        self.json_path = json_path

    def __call__(self, node: Any) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if type(node) is list:
            return [self(v) for v in node]
        if type(node) is not dict:
            raise ValueError(f"a {type(node).__name__} node")
        tag = node.get(_T)
        decode = _DECODERS.get(tag) if isinstance(tag, str) else None
        if decode is None:
            raise CheckpointError(
                f"{self.json_path}: unknown type tag {tag!r}: this reader builds only "
                f"{sorted(_DECODERS)}; the file was altered or written by a newer lightning_pp"
            )
        return decode(self, node)

    def mapping(self, node: dict[str, Any], kind: Callable[[], Any]) -> Any:
        out = kind()
        if "v" in node:
            for k, v in node["v"].items():
                out[k] = self(v)
        else:
            for k, v in node["items"]:
                out[_hashable(self(k))] = self(v)
        return out

    def tensor(self, node: dict[str, Any]) -> torch.Tensor:
        key = node["key"]
        if key not in self.tensors:
            raise CheckpointError(
                f"{self.json_path.with_name(META_TENSORS)} lacks the tensor {key!r} that "
                f"{self.json_path.name} refers to (a file from another checkpoint?)"
            )
        self.used.add(key)
        value = self.tensors[key]
        if node[_T] == "Parameter":
            value = torch.nn.Parameter(value, requires_grad=bool(node.get("requires_grad")))
        elif node.get("requires_grad"):
            value.requires_grad_(True)
        return value


def _hashable(key: Any) -> Any:
    hash(key)  # a list key (altered file) is a TypeError -> reported naming meta.json
    return key


def _dec_float(d: _Decoder, n: dict[str, Any]) -> float:
    if n["v"] not in ("inf", "-inf", "nan"):
        raise ValueError(f"float {n['v']!r}")
    return float(n["v"])


def _dec_datetime(kind: type) -> Callable[[_Decoder, dict[str, Any]], Any]:
    def decode(d: _Decoder, n: dict[str, Any]) -> Any:
        parts = [int(x) if type(x) is int else _bad(x) for x in n["v"]]
        if kind is datetime.date:
            return datetime.date(*parts)
        return kind(*parts, tzinfo=d(n["tz"]), fold=int(n["fold"]))

    return decode


def _bad(x: Any) -> Any:
    raise ValueError(f"{x!r} is not an int")


def _dec_timezone(d: _Decoder, n: dict[str, Any]) -> datetime.timezone:
    args = [d(a) for a in n["v"]]
    if not (type(args[0]) is datetime.timedelta and all(type(a) is str for a in args[1:])):
        raise ValueError("timezone arguments")
    return datetime.timezone(*args)


def _dec_dtype(d: _Decoder, n: dict[str, Any]) -> torch.dtype:
    name = n["v"]
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {name!r}")
    return value


def _dec_omegaconf(d: _Decoder, n: dict[str, Any]) -> Any:
    oc = _omegaconf()
    if oc is None:
        raise CheckpointError(f"{d.json_path}: holds an OmegaConf {n[_T]}; install omegaconf")
    content = d(n["v"])
    expected = dict if n[_T] == "DictConfig" else list
    if type(content) is not expected:
        raise ValueError(f"{n[_T]} of a {type(content).__name__}")
    cfg = oc.OmegaConf.create(content)
    # None: never set (inherited); set explicitly only what the saved container had in force
    for flag, setter in (
        ("struct", oc.OmegaConf.set_struct),
        ("readonly", oc.OmegaConf.set_readonly),
    ):
        if n["flags"][flag] is not None:
            setter(cfg, bool(n["flags"][flag]))
    return cfg


def _dec_class(d: _Decoder, n: dict[str, Any]) -> type:
    oc = _omegaconf()
    if oc is None or n["v"] not in ("DictConfig", "ListConfig"):
        raise ValueError(f"class {n['v']!r}")
    return getattr(oc, n["v"])


def _dec_attribute_dict(d: _Decoder, n: dict[str, Any]) -> Any:
    cls = _attribute_dict()
    if cls is None:
        raise CheckpointError(f"{d.json_path}: holds a Lightning AttributeDict; install lightning")
    return d.mapping(n, cls)


def _dec_path(kind: type) -> Callable[[_Decoder, dict[str, Any]], Any]:
    def decode(d: _Decoder, n: dict[str, Any]) -> Any:
        if type(n["v"]) is not str:
            raise ValueError("path")
        return kind(n["v"])

    return decode


def _dec_defaultdict(d: _Decoder, n: dict[str, Any]) -> Any:
    factory = None if n["factory"] is None else _FACTORIES[n["factory"]]
    return d.mapping(n, lambda: collections.defaultdict(factory))


def _ints(n: dict[str, Any], count: int) -> list[int]:
    v = n["v"]
    if type(v) is not list or len(v) != count or not all(type(x) is int for x in v):
        raise ValueError(f"{n[_T]} fields")
    return v


_DECODERS: dict[str, Callable[[_Decoder, dict[str, Any]], Any]] = {
    "float": _dec_float,
    "tuple": lambda d, n: tuple(d(v) for v in n["v"]),
    "set": lambda d, n: {_hashable(d(v)) for v in n["v"]},
    "frozenset": lambda d, n: frozenset(_hashable(d(v)) for v in n["v"]),
    "dict": lambda d, n: d.mapping(n, dict),
    "OrderedDict": lambda d, n: d.mapping(n, collections.OrderedDict),
    "defaultdict": _dec_defaultdict,
    "AttributeDict": _dec_attribute_dict,
    "Tensor": lambda d, n: d.tensor(n),
    "Parameter": lambda d, n: d.tensor(n),
    "bytes": lambda d, n: base64.b64decode(n["v"].encode("ascii"), validate=True),
    "complex": lambda d, n: complex(*(float(d(x)) for x in n["v"][:2])),
    "range": lambda d, n: range(*_ints(n, 3)),
    "slice": lambda d, n: slice(*(d(x) for x in n["v"][:3])),
    "Namespace": lambda d, n: argparse.Namespace(**_str_keys(d(n["v"]))),
    "date": _dec_datetime(datetime.date),
    "datetime": _dec_datetime(datetime.datetime),
    "time": _dec_datetime(datetime.time),
    "timedelta": lambda d, n: datetime.timedelta(*_ints(n, 3)),
    "timezone": _dec_timezone,
    "dtype": _dec_dtype,
    "Size": lambda d, n: torch.Size(_ints(n, len(n["v"]))),
    "device": lambda d, n: torch.device(str(n["v"])),
    "DictConfig": _dec_omegaconf,
    "ListConfig": _dec_omegaconf,
    "class": _dec_class,
    **{name: _dec_path(cls) for name, cls in _PATHS.items()},
}

#: every ``$type`` a meta.json may hold
TAGS: frozenset[str] = frozenset(_DECODERS)


def _str_keys(value: Any) -> dict[str, Any]:
    if type(value) is not dict or not all(type(k) is str for k in value):
        raise ValueError("Namespace of non-str keys")
    return value


# ------------------------------------------------------------------------------- files
def write_meta(directory: str | os.PathLike, meta: dict[str, Any]) -> None:
    """Write ``meta`` as ``meta.json`` + ``meta.safetensors`` in ``directory``. Every value is
    checked before anything is written: one of another type raises :class:`CheckpointError`
    naming its key path and type. (Completion is the caller's marker, written after.)"""
    if type(meta) is not dict:
        raise CheckpointError(f"checkpoint metadata must be a dict, not {type(meta).__name__}")
    encoder = _Encoder()
    structure = encoder(meta)
    text = json.dumps(
        {"format": FORMAT, "version": VERSION, "meta": structure}, allow_nan=False, indent=1
    )
    directory = Path(directory)
    # safetensors wants at least a header; an empty dict is fine
    save_file(encoder.tensors, str(directory / META_TENSORS), metadata={"format": FORMAT})
    (directory / META_JSON).write_text(text, encoding="utf-8")


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """Rebuild the metadata :func:`write_meta` wrote; raise :class:`CheckpointError` naming the
    file for a missing or damaged one, an unknown type tag, or tensors that do not match."""
    directory = Path(directory)
    json_path, tensor_path = directory / META_JSON, directory / META_TENSORS
    try:
        doc = json.loads(json_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{json_path} is missing: not a complete checkpoint") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{json_path}: cannot be read as JSON ({exc})") from None
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT and "meta" in doc):
        raise CheckpointError(f"{json_path} is not a {FORMAT} file")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{json_path}: version {doc.get('version')!r}, this reader reads 1")
    try:
        tensors = load_file(str(tensor_path), device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{tensor_path} is missing: not a complete checkpoint") from None
    except (OSError, SafetensorError, ValueError) as exc:
        raise CheckpointError(f"{tensor_path}: cannot be read as safetensors ({exc})") from None
    decoder = _Decoder(tensors, json_path)
    try:
        meta = decoder(doc["meta"])
    except CheckpointError:
        raise
    except (
        KeyError,
        TypeError,
        ValueError,
        IndexError,
        AttributeError,
        OverflowError,
        RecursionError,
    ) as exc:
        raise CheckpointError(
            f"{json_path}: a malformed value ({type(exc).__name__}: {exc}); the file was altered"
        ) from None
    unused = sorted(set(tensors) - decoder.used)
    if unused:
        raise CheckpointError(
            f"{tensor_path} holds tensor(s) {unused[:5]} that {META_JSON} does not refer to "
            f"(a file from another checkpoint?)"
        )
    if type(meta) is not dict:
        raise CheckpointError(f"{json_path}: holds a {type(meta).__name__}, not a dict")
    return meta
