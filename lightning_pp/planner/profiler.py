"""Measure a model's pipeline layers on this process's device: the planner's inputs.

Per layer and microbatch size: forward time, the engine's ``I`` (input gradient) and ``W``
(weight gradients) times, measured with the engine's own split backward
(:func:`~lightning_pp.runtime.split_backward.backward_input`, then :meth:`WeightWork.run
<lightning_pp.runtime.split_backward.WeightWork.run>`), so the profile times what the engine runs,
and
one fused backward (``B``; the fused schedules run it, and it costs less than ``I`` + ``W``); the
bytes autograd saves (the engine's saved-bytes meter's rule, through
:func:`~lightning_pp.runtime.recompute_probe.measure_chunk`); parameter, input and output bytes.
Each
time is the fastest of ``repeats`` runs after one warm-up, the runs spread over ``repeats``
passes through the whole model (see :func:`profile_layers` for why the fastest and why
passes).

On a CPU host with one torch thread per process the times are process CPU time, not wall
time (see :func:`profile_config`). Link latency, bandwidth and the engine's per-action
overhead are not measured here: they come from options (defaults in
:mod:`lightning_pp.planner.profile`, see docs/planner.md).

Profiles are cached on disk by a hash of the model section, the input's shape, the device and
the torch version (:func:`profile_config`); a later run that needs other microbatch sizes
measures only those.

Example::

    layers = [nn.Linear(8, 8) for _ in range(4)]
    costs = profile_layers(layers, lambda n: torch.randn(n, 8), sizes=[2, 4])
    costs[4][0].t_f, costs[4][0].saved_bytes
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..layout.partition import PipelineChunk
from ..layout.placement import split_layer_name
from ..runtime.recompute_probe import measure_chunk
from ..runtime.split_backward import backward_input, fused_backward
from .profile import LayerCost, ModelProfile

__all__ = [
    "config_hash",
    "default_cache_dir",
    "profile_config",
    "profile_layers",
    "profile_model",
    "profile_threads",
]

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_cache_dir() -> str:
    """``$LIGHTNING_PP_CACHE`` or ``~/.cache/lightning_pp``."""
    return os.environ.get("LIGHTNING_PP_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "lightning_pp"
    )


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _fresh(x: Any) -> Any:
    """A detached copy with its own storage (as a received stage input is), floating tensors
    requiring grad (so ``I`` has an input to differentiate)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        return t.requires_grad_(True) if t.is_floating_point() else t

    if isinstance(x, torch.Tensor):
        return one(x)
    if isinstance(x, (tuple, list)):
        return type(x)(one(t) if isinstance(t, torch.Tensor) else t for t in x)
    return x


def _saved_per_layer(layers: Sequence[nn.Module], x: Any) -> tuple[list[int], list[int], list[Any]]:
    """(saved bytes, bytes shared with the previous layer, each layer's input) for one forward
    of the whole stack, keyed as the engine's meter keys storages (parameters excluded, a
    storage counted once per layer)."""
    params = {p.untyped_storage().data_ptr() for m in layers for p in m.parameters()}
    # Every storage keyed here stays allocated until the end: the split pass measures one layer
    # at a time and frees its graph, and a later layer's tensor at a freed address would count
    # as shared with the layer before it (w_shared_bytes came out 0, 768 or 1536 bytes on the
    # same layer from one run to the next, and the memory test failed on it now and then).
    alive: list[Any] = []

    def key(t: torch.Tensor) -> tuple[Any, int] | None:
        st = t.untyped_storage()
        if st.data_ptr() in params:
            return None
        alive.append(st)
        return st.data_ptr(), st.nbytes()

    inputs: list[Any] = []
    hooks = [m.register_forward_pre_hook(lambda _m, a: inputs.append(a[0])) for m in layers]
    try:
        with torch.enable_grad():
            _, probes = measure_chunk(PipelineChunk(list(layers)), (_fresh(x),), key)
    finally:
        for h in hooks:
            h.remove()
    held = [{t.untyped_storage().data_ptr(): _nbytes(t) for t in _tensors(a)} for a in inputs]
    w_keys, w_held = _kept_for_w_per_layer(layers, inputs, probes, key)
    out = []
    for i, p in enumerate(probes):
        prev_saved = probes[i - 1].saved if i else {}
        prev_held = held[i - 1] if i else {}
        out.append(
            {
                "saved_bytes": sum(p.saved.values()),
                "shared_bytes": sum(b for k, b in p.saved.items() if k in prev_saved),
                "input_shared_bytes": sum(b for k, b in held[i].items() if k in prev_held),
                "input_saved_bytes": sum(
                    b for k, b in held[i].items() if k in p.saved or k in prev_saved
                ),
                "input_self_saved_bytes": sum(b for k, b in held[i].items() if k in p.saved),
            }
        )
        prev_w = w_keys[i - 1] if i else {}
        out[-1].update(
            w_saved_bytes=sum(w_keys[i].values()),
            w_shared_bytes=sum(b for k, b in w_keys[i].items() if k in prev_w),
            input_w_saved_bytes=sum(
                b for k, b in w_held[i].items() if k in w_keys[i] or k in prev_w
            ),
            input_self_w_saved_bytes=sum(b for k, b in w_held[i].items() if k in w_keys[i]),
        )
    return out


def _kept_for_w_per_layer(
    layers: Sequence[nn.Module], inputs: list[Any], probes: list[Any], key: Any
) -> tuple[list[dict[Any, int]], list[dict[Any, int]]]:
    """Per layer, the storages a split backward keeps from ``I`` to ``W`` outside the first
    stage, and the layer's input storages, keyed alike. Layer 0 always sits in the first
    stage (its ``I`` is a no-op: it keeps all it saved). Layers 1.. run again one at a time,
    each on the previous one's output (detached: the same storage, requiring grad as a
    received stage input does), with the probe's split analysis (``measure_chunk(split=
    True)``). One at a time because what ``W`` reads depends on the weights the chunk shares:
    a weight tied between two layers of one chunk makes ``W`` run the input path between
    them, and the model cannot know the chunks here. A tie inside one chunk therefore keeps
    more than predicted (the engine's meter shows it)."""
    first = dict(probes[0].saved) if probes else {}
    w_keys: list[dict[Any, int]] = [first]
    w_held: list[dict[Any, int]] = [{}]

    def detached(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            d = a.detach()
            return d.requires_grad_(True) if d.is_floating_point() else d
        if isinstance(a, (tuple, list)):
            return type(a)(detached(t) for t in a)
        return a

    cur = inputs[1] if len(inputs) > 1 else None
    fed: list[Any] = []  # every layer's input stays allocated (its key must stay unique)
    for layer in layers[1:]:
        x = detached(cur)
        fed.append(x)
        with torch.enable_grad():
            cur, (probe,) = measure_chunk(PipelineChunk([layer]), (x,), key, split=True)
        w_keys.append(dict(probe.kept_for_w))
        w_held.append({t.untyped_storage().data_ptr(): _nbytes(t) for t in _tensors(x)})
    return w_keys, w_held


def _time_layer(
    layer: nn.Module,
    x: Any,
    clock: Callable[[], float] = time.perf_counter,
    *,
    warmup: bool = True,
) -> tuple[float, float, float, float, Any]:
    """One timed run's (t_f, t_i, t_w, t_fused), after one untimed warm-up run unless
    ``warmup=False`` (it warms caches and the allocator); and its output. ``t_fused``: a second
    forward, then one fused backward, timed (the backward alone)."""
    for _ in range(int(warmup) + 1):
        inp = _fresh(x)
        t0 = clock()
        with torch.enable_grad():
            out = layer(inp)
        t1 = clock()
        outs = [t for t in _tensors(out) if t.requires_grad]
        grads = [torch.ones_like(t) for t in outs]
        t2 = clock()
        _, work = backward_input(outs, grads, _tensors(inp))
        t3 = clock()
        work.run()
        t4 = clock()
        inp = _fresh(x)
        with torch.enable_grad():
            again = [t for t in _tensors(layer(inp)) if t.requires_grad]
        t5 = clock()
        fused_backward(again, [torch.ones_like(t) for t in again])
        t6 = clock()
        for p in layer.parameters():
            p.grad = None
    return t1 - t0, t3 - t2, t4 - t3, t6 - t5, out


@contextlib.contextmanager
def profiling_threads(threads: int) -> Iterator[Callable[[], float]]:
    """Torch on ``threads`` threads inside the block (the previous count restored after), as
    each pipeline process runs; yields the clock to time layers with: this process's CPU time
    on one thread, which other processes' load does not inflate, else wall time.

    Example:
        >>> with profiling_threads(1) as clock:
        ...     clock is time.process_time and torch.get_num_threads() == 1
        True
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield time.process_time if threads == 1 else time.perf_counter
    finally:
        torch.set_num_threads(before)


def profile_layers(
    layers: Sequence[nn.Module],
    make_input: Callable[[int], Any],
    sizes: Sequence[int],
    *,
    repeats: int = 3,
    log: Log | None = _stderr,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[int, list[LayerCost]]:
    """Measure every layer at every microbatch size in ``sizes``.

    ``make_input(n)``: the first layer's input for ``n`` samples. Each later layer gets the
    previous layer's output (detached, a fresh storage, as a received stage input is).
    ``log``: progress lines (``None``: quiet). ``clock``: wall time by default;
    ``time.process_time`` (CPU time) when torch runs one thread, which other processes'
    load does not inflate (see :func:`profile_config`).

    The ``repeats`` timed runs of a layer are spread over the whole profile: one per pass over
    every size and layer (the first pass warms each layer up first), each time the fastest of
    its passes. The minimum, not the median: on a shared machine the noise is one-sided
    (another process takes the core, a layer never runs faster than its work), and a median of
    three is still the stalled value when two of the three runs were preempted, as measured at
    ``nice 19`` next to a busy process (a 20x outlier at one size, the sizes around it normal).
    Passes: a slow stretch of a shared machine, seconds long, then costs a layer one pass, not
    all its runs: four profiles of the same transformer layers back to back summed their
    forwards to 7.8-11.9 ms at one sample with the repeats run back to back, 7.9-9.5 ms as
    passes (benchmarks: the planner's transformer workload, 2-vCPU guest).
    """
    sizes = sorted(set(sizes))
    total = repeats * len(sizes) * len(layers)
    fastest: dict[tuple[int, int], tuple[float, ...]] = {}  # (t_f, t_i, t_w, t_fused)
    first: dict[tuple[int, int], dict[str, Any]] = {}  # bytes and counts: measured once
    done = 0
    started = time.perf_counter()
    for p in range(repeats):
        for n in sizes:
            x = make_input(n)
            storages = _saved_per_layer(layers, x) if p == 0 else None
            for i, layer in enumerate(layers):
                *times, y = _time_layer(layer, x, clock, warmup=p == 0)
                key = (n, i)
                if storages is not None:
                    first[key] = dict(
                        **storages[i],
                        params=sum(q.numel() for q in layer.parameters()),
                        param_bytes=sum(q.numel() * q.element_size() for q in layer.parameters()),
                        input_bytes=_nbytes(x),
                        boundary_bytes=_nbytes(y),
                    )
                best = fastest.get(key)
                fastest[key] = tuple(times) if best is None else tuple(map(min, best, times))
                x = _fresh(y)
                done += 1
                if log is not None:
                    t_f, t_i, t_w, _ = fastest[key]
                    bar = "#" * (20 * done // total)
                    log(
                        f"profile [{bar:<20}] {done}/{total} pass {p + 1}/{repeats} layer {i} at "
                        f"microbatch {n}: F {t_f * 1e3:.2f} ms, I {t_i * 1e3:.2f} ms, W "
                        f"{t_w * 1e3:.2f} ms ({time.perf_counter() - started:.1f} s)"
                    )
    out: dict[int, list[LayerCost]] = {}
    for n in sizes:
        out[n] = []
        for i in range(len(layers)):
            t_f, t_i, t_w, t_fused = fastest[(n, i)]
            out[n].append(LayerCost(t_f=t_f, t_i=t_i, t_w=t_w, t_fused=t_fused, **first[(n, i)]))
    return out


def _repeat_to(x: Any, n: int) -> Any:
    """``x`` (a batch of samples along dim 0) repeated and cut to ``n`` samples."""

    def one(t: torch.Tensor) -> torch.Tensor:
        reps = -(-n // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:n].contiguous()

    if isinstance(x, torch.Tensor):
        return one(x)
    if isinstance(x, (tuple, list)):
        return type(x)(one(t) if isinstance(t, torch.Tensor) else t for t in x)
    raise TypeError(f"cannot profile a first-layer input of type {type(x).__name__}")


def tied_group_of(tied: Sequence[Sequence[str]]) -> dict[tuple[int, str], int]:
    """``(layer index, parameter name) -> group index`` of ``tied`` (``PipelineLayers.tied``
    names, ``"0.wte.weight"``).

    Example:
        >>> tied_group_of([("0.wte.weight", "5.head.weight")])
        {(0, 'wte.weight'): 0, (5, 'head.weight'): 0}
    """
    return {split_layer_name(name): g for g, names in enumerate(tied) for name in names}


def tied_members(
    layers: Sequence[nn.Module], tied: Sequence[Sequence[str]]
) -> dict[int, tuple[tuple[int, int], ...]]:
    """Per layer index, ``(group, elements)`` of each member of a ``tied`` group
    (:func:`tied_group_of`) it holds: the layer's trainable parameter of that name, on whatever
    device (meta included) and cut (a tp-local layer: its local elements).

    Example:
        >>> layers = [nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)]
        >>> tied_members(layers, [("0.weight", "1.weight")])
        {0: ((0, 8),), 1: ((0, 8),)}
    """
    group_of = tied_group_of(tied)
    out: dict[int, tuple[tuple[int, int], ...]] = {}
    for i, layer in enumerate(layers):
        members = tuple(
            (group_of[(i, name)], p.numel())
            for name, p in layer.named_parameters()
            if p.requires_grad and (i, name) in group_of
        )
        if members:
            out[i] = members
    return out


def profile_model(
    model: nn.Module,
    example_batch: Any,
    sizes: Sequence[int],
    *,
    repeats: int = 3,
    model_hash: str = "",
    log: Log | None = _stderr,
    clock: Callable[[], float] = time.perf_counter,
) -> ModelProfile:
    """Profile a built :class:`~lightning_pp.strategy.model.PipelineMixin` module: its
    ``pipeline_layers()`` fed ``pipeline_input(example_batch)`` repeated to each size."""
    layers_container = model.pipeline_layers()  # type: ignore[operator]
    layers = [layers_container[i] for i in range(layers_container.num_layers)]
    model.train()
    x0 = model.pipeline_input(example_batch)  # type: ignore[operator]
    first = _tensors(x0)[0]
    tokens = int(first[0].numel()) if not first.is_floating_point() and first.dim() >= 2 else None
    by_size = profile_layers(
        layers, lambda n: _repeat_to(x0, n), sizes, repeats=repeats, log=log, clock=clock
    )
    tied = tied_members(layers, getattr(layers_container, "tied", ()))
    if tied:
        by_size = {
            n: [dataclasses.replace(c, tied=tied.get(i, ())) for i, c in enumerate(costs)]
            for n, costs in by_size.items()
        }
    device = first.device.type
    return ModelProfile(
        by_size,
        device=device,
        model_hash=model_hash,
        tokens_per_sample=tokens,
        layer_names=tuple(type(m).__name__ for m in layers),
    )


def profile_threads(world: int) -> int:
    """The torch threads each of ``world`` processes gets on this machine: Lightning gives
    ``cpu_count // processes`` (at least 1) to each process it starts on a CPU host."""
    return max(1, (os.cpu_count() or 1) // max(1, world))


def config_hash(cfg: Any, threads: int = 0) -> str:
    """Hash of what the layer costs depend on: the model and data sections (the model, the
    input's shape), the accelerator, the torch version and the machine's CPU count (a proxy
    for the device). Computed without building anything, so a cache hit costs nothing."""
    key = json.dumps(
        {
            "model": cfg.get("model"),
            "data": cfg.get("data"),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "accelerator": (cfg.get("trainer") or {}).get("accelerator"),
            "threads": threads,
            # 2: per-layer bytes kept from I to W (LayerCost.w_*); older caches lack them
            "profile_format": 4,  # 3: t_fused measured; 4: LayerCost.tied
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def profile_config(
    cfg: Any,
    sizes: Sequence[int],
    *,
    cache_dir: str | None = None,
    repeats: int = 3,
    log: Log | None = _stderr,
    world: int = 1,
    instantiate: Callable[[Any], Any],
) -> ModelProfile:
    """Profile every size in ``sizes`` of ``cfg``'s model on this process: build the model and
    data module (``instantiate(spec)`` builds a config's class spec: the CLI's, which checks what
    it may call), take one training batch, measure. Sizes already in the cache
    (``cache_dir/profile-<config_hash>.json``) are not measured again; a full hit builds
    nothing.

    Torch runs :func:`profile_threads` threads, as each of ``world`` training processes will.
    With one thread the layers are timed in process CPU time: on a shared CPU host a timed run
    that another process preempts would otherwise read many times its cost (measured: 20x
    outliers at ``nice 19`` next to a busy process, and a wrong recommendation from them)."""
    threads = profile_threads(world)
    digest = config_hash(cfg, threads)
    cache_dir = cache_dir or default_cache_dir()
    path = os.path.join(cache_dir, f"profile-{digest}.json")
    cached: ModelProfile | None = None
    if os.path.exists(path):
        try:
            cached = ModelProfile.load(path)
        except (OSError, ValueError):
            cached = None  # a stale or foreign file: measure again
    want = sorted(set(sizes))
    missing = [n for n in want if cached is None or n not in cached.by_size]
    if cached is not None and not missing:
        if log is not None:
            log(f"profile: cached {path} (microbatch sizes {cached.sizes})")
        return cached
    seed = cfg.get("seed")
    if isinstance(seed, int):
        torch.manual_seed(seed)
    model = instantiate(cfg.get("model"))
    configure = getattr(model, "configure_model", None)
    if callable(configure):
        configure()
    dm = instantiate(cfg.get("data"))
    for hook, arg in (("prepare_data", None), ("setup", "fit")):
        fn = getattr(dm, hook, None)
        if callable(fn):
            fn() if arg is None else fn(arg)
    batch = next(iter(dm.train_dataloader()))
    if log is not None:
        log(
            f"profile: measuring {len(missing)} microbatch size(s) {missing} on this process "
            f"({repeats} timed runs + 1 warm-up per layer and size)"
        )
    with profiling_threads(threads) as clock:
        fresh = profile_model(
            model, batch, missing, repeats=repeats, model_hash=digest, log=log, clock=clock
        )
    note = (
        f"timed with {'process CPU time' if threads == 1 else 'wall time'}, {threads} torch "
        f"thread(s) (as each of {world} processes on {os.cpu_count()} CPUs)"
    )
    fresh = dataclasses.replace(fresh, notes=(note,))
    if cached is not None:
        merged = {**cached.by_size, **fresh.by_size}
        fresh = ModelProfile(
            merged,
            device=fresh.device,
            model_hash=digest,
            tokens_per_sample=fresh.tokens_per_sample,
            layer_names=fresh.layer_names,
            notes=fresh.notes,
        )
    fresh.save(path)
    if log is not None:
        log(f"profile: saved {path}")
    return fresh
