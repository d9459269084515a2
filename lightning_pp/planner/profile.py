"""What the planner knows about a model: measured per-layer costs and the machine's links.

A :class:`ModelProfile` holds one :class:`LayerCost` per pipeline layer, measured at one or
more microbatch sizes (:mod:`lightning_pp.planner.profiler` measures them), plus the numbers the
links and the engine add: point-to-point latency and bandwidth, and the engine's fixed overhead
per action. It is plain data, saved and loaded as JSON, so that a search can be rerun (and
tested) without measuring again.

**Scaling assumption.** A candidate whose microbatch size was not measured gets the costs of
the nearest measured size scaled linearly in the number of samples (time and bytes alike). That
holds for dense layers whose work is proportional to the batch; it overestimates small sizes on
devices that are not saturated by them, which is why the profiler measures every size the
search will ask for when that is cheap.

Example:
    >>> layer = LayerCost(t_f=1e-3, t_i=1e-3, t_w=1e-3, saved_bytes=4096, param_bytes=400,
    ...                   params=100, boundary_bytes=256, input_bytes=256)
    >>> prof = ModelProfile({8: [layer, layer]}, model_hash="demo")
    >>> prof.layers(16)[0].t_f   # not measured at 16: scaled from 8
    0.002
    >>> ModelProfile.from_json(prof.to_json()) == prof
    True
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_LATENCY_S",
    "DEFAULT_BANDWIDTH",
    "DEFAULT_OVERHEAD_S",
    "LayerCost",
    "ModelProfile",
]

#: Defaults for what the profiler does not measure (see docs/planner.md): one gloo hop between
#: two processes of this machine, its copy bandwidth, and the engine's fixed cost per action
#: (docs/benchmarks.md fits about 1 ms per action on the 2-core CPU machine).
DEFAULT_LATENCY_S = 2e-4
DEFAULT_BANDWIDTH = 2e9
DEFAULT_OVERHEAD_S = 1e-3


@dataclass(frozen=True)
class LayerCost:
    """One pipeline layer on one microbatch: seconds and bytes.

    ``t_f`` forward; ``t_i`` backward to the layer's input only (the engine's ``I``); ``t_w``
    the weight gradients (``W``); ``t_fused`` one fused backward (``B``), measured, since a
    split backward costs more than a fused one (``None``, a profile from before it was
    measured: ``t_i + t_w``). ``saved_bytes``:
    what autograd saves for the layer's backward (as the engine's saved-bytes meter counts it:
    parameters excluded); ``shared_bytes``: the part of it that the previous layer saves too
    (e.g. a tensor both keep), counted once when both layers sit in one chunk.
    ``input_bytes`` / ``boundary_bytes``: the layer's input / output activation (the latter is
    what a stage boundary after it sends); ``input_shared_bytes``: the part of the input that
    is the previous layer's input passed through unchanged (e.g. an attention mask), held
    once by a chunk that checkpoints both. ``input_saved_bytes``: the part of the input that
    this layer or the previous one also saves (``input_self_saved_bytes``: this layer alone,
    which is what counts when the layer starts a chunk), so that a microbatch holding both
    the inputs and the saved tensors (a split backward's recompute, from ``I`` to ``W``) counts
    each storage once. ``params`` / ``param_bytes``: its parameters.
    ``w_saved_bytes`` (and ``w_shared_bytes``, ``input_w_saved_bytes``,
    ``input_self_w_saved_bytes``, the same corrections): the part of ``saved_bytes`` that a
    split backward keeps from ``I`` to ``W`` outside the first stage (what ``W``'s nodes read
    again: a Linear's input, not a GELU's; :mod:`lightning_pp.runtime.saved_for_w`). ``None`` (a
    profile from before they were measured): all of it. ``tied``: ``(group, elements)`` of each
    member of a tied group (``PipelineLayers.tied``) among ``params``: a rank holding two
    members of one group holds one tensor (V placement's embedding and head).

    Example:
        >>> LayerCost(t_f=1.0, t_i=1.0, t_w=2.0).scaled(2).t_w
        4.0
    """

    t_f: float
    t_i: float
    t_w: float
    saved_bytes: int = 0
    param_bytes: int = 0
    params: int = 0
    boundary_bytes: int = 0
    input_bytes: int = 0
    shared_bytes: int = 0
    input_shared_bytes: int = 0
    input_saved_bytes: int = 0
    input_self_saved_bytes: int = 0
    w_saved_bytes: int | None = None
    w_shared_bytes: int | None = None
    input_w_saved_bytes: int | None = None
    input_self_w_saved_bytes: int | None = None
    t_fused: float | None = None
    tied: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        # JSON gives lists; the normal form is tuples (hashable, comparable)
        object.__setattr__(self, "tied", tuple((int(g), int(n)) for g, n in self.tied))

    @property
    def t_b(self) -> float:
        """Fused backward: ``t_fused`` where measured, else ``t_i + t_w``."""
        return self.t_i + self.t_w if self.t_fused is None else self.t_fused

    def scaled(self, factor: float) -> LayerCost:
        """Activation costs (times, saved/boundary/input bytes) times ``factor``; parameters
        unchanged (they do not depend on the microbatch)."""
        return dataclasses.replace(
            self,
            t_f=self.t_f * factor,
            t_i=self.t_i * factor,
            t_w=self.t_w * factor,
            t_fused=None if self.t_fused is None else self.t_fused * factor,
            saved_bytes=round(self.saved_bytes * factor),
            boundary_bytes=round(self.boundary_bytes * factor),
            input_bytes=round(self.input_bytes * factor),
            shared_bytes=round(self.shared_bytes * factor),
            input_shared_bytes=round(self.input_shared_bytes * factor),
            input_saved_bytes=round(self.input_saved_bytes * factor),
            input_self_saved_bytes=round(self.input_self_saved_bytes * factor),
            **{
                name: None if getattr(self, name) is None else round(getattr(self, name) * factor)
                for name in (
                    "w_saved_bytes",
                    "w_shared_bytes",
                    "input_w_saved_bytes",
                    "input_self_w_saved_bytes",
                )
            },
        )

    @property
    def w_kept(self) -> tuple[int, int, int, int]:
        """(saved, shared, input-saved, input-self-saved) bytes for the span from ``I`` to
        ``W``: the ``w_*`` fields, or the whole-forward ones where not measured."""
        return (
            self.saved_bytes if self.w_saved_bytes is None else self.w_saved_bytes,
            self.shared_bytes if self.w_shared_bytes is None else self.w_shared_bytes,
            self.input_saved_bytes
            if self.input_w_saved_bytes is None
            else self.input_w_saved_bytes,
            self.input_self_saved_bytes
            if self.input_self_w_saved_bytes is None
            else self.input_self_w_saved_bytes,
        )


@dataclass(frozen=True)
class ModelProfile:
    """Per-layer costs at each measured microbatch size, and the link and engine numbers.

    ``by_size[n]``: one :class:`LayerCost` per layer at microbatch size ``n`` (samples).
    ``latency_s`` / ``bandwidth``: one point-to-point message's fixed cost and bytes per
    second. ``overhead_s``: the engine's fixed cost per action (F, B, I or W) beyond the layers'
    own time. ``compute_scale``: how much slower (``> 1``) the layers run inside the pipeline
    than when profiled alone (other processes sharing the cores, colder caches), fitted by
    ``--calibrate``; every layer time is multiplied by it. ``receive_s``: what a receive costs
    although its data was sent before it asked (reading the header, the transfer, waking the
    receiver), charged to every receiving action; ``latency_s`` then counts the rest of a hop
    (fitted by ``--calibrate``; on a 2-core machine whose gloo threads wait for a core it was
    0.3-1.6 ms per receive). ``tokens_per_sample``: for tokens/s
    (``None``: samples/s only). ``model_hash``:
    the model and config the profile belongs to (the profiler's cache key).
    """

    by_size: Mapping[int, Sequence[LayerCost]]
    latency_s: float = DEFAULT_LATENCY_S
    bandwidth: float = DEFAULT_BANDWIDTH
    overhead_s: float = DEFAULT_OVERHEAD_S
    compute_scale: float = 1.0
    receive_s: float = 0.0
    device: str = "cpu"
    model_hash: str = ""
    tokens_per_sample: int | None = None
    layer_names: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.by_size:
            raise ValueError("a ModelProfile needs the layer costs of at least one microbatch size")
        counts = {len(v) for v in self.by_size.values()}
        if len(counts) != 1:
            raise ValueError(
                f"every measured size needs the same layer count, got {sorted(counts)}"
            )
        # Normal form: int keys, tuples (JSON gives str keys and lists)
        normal = {
            int(k): tuple(v) for k, v in sorted(self.by_size.items(), key=lambda kv: int(kv[0]))
        }
        object.__setattr__(self, "by_size", normal)
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def num_layers(self) -> int:
        return len(next(iter(self.by_size.values())))

    @property
    def sizes(self) -> list[int]:
        """The measured microbatch sizes."""
        return sorted(self.by_size)

    def layers(self, microbatch_size: float) -> list[LayerCost]:
        """Layer costs at ``microbatch_size`` samples: measured, or scaled linearly from the
        nearest measured size (ties: the larger one, whose per-sample time is the less
        overhead-dominated)."""
        if microbatch_size in self.by_size:
            return list(self.by_size[int(microbatch_size)])
        near = min(self.sizes, key=lambda n: (abs(n - microbatch_size), -n))
        factor = microbatch_size / near
        return [c.scaled(factor) for c in self.by_size[near]]

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["by_size"] = {
            str(k): [dataclasses.asdict(c) for c in v] for k, v in self.by_size.items()
        }
        out["layer_names"] = list(self.layer_names)
        out["notes"] = list(self.notes)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelProfile:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelProfile field(s) {unknown}; known: {sorted(known)}")
        kwargs = dict(data)
        kwargs["by_size"] = {
            int(k): [LayerCost(**c) for c in v] for k, v in data.get("by_size", {}).items()
        }
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON (parent directories created)."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file

    @classmethod
    def load(cls, path: str | os.PathLike) -> ModelProfile:
        with open(path) as f:
            try:
                return cls.from_json(f.read())
            except (ValueError, TypeError) as err:
                raise ValueError(f"{os.fspath(path)}: not a lightning-pp profile: {err}") from None

    def with_links(
        self,
        *,
        latency_s: float | None = None,
        bandwidth: float | None = None,
        overhead_s: float | None = None,
        compute_scale: float | None = None,
        receive_s: float | None = None,
    ) -> ModelProfile:
        """The same layers with other link/engine numbers (``None``: keep)."""
        return dataclasses.replace(
            self,
            latency_s=self.latency_s if latency_s is None else latency_s,
            bandwidth=self.bandwidth if bandwidth is None else bandwidth,
            overhead_s=self.overhead_s if overhead_s is None else overhead_s,
            compute_scale=self.compute_scale if compute_scale is None else compute_scale,
            receive_s=self.receive_s if receive_s is None else receive_s,
        )
