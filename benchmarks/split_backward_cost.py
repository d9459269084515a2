"""Does a split backward (``I`` + ``W``) cost what a fused one does? One process, no pipeline.

Issue 14's acceptance: on the transformer workload, ``t_i + t_w <= 1.10 * t_b`` for one
stage and microbatch. The pipeline benchmark measures it too, but with every rank sharing the
cores; here one process measures the middle stage of the ``transformer`` workload (two
:class:`~benchmarks.workloads.Block` layers, input that requires grad) three ways, interleaved
round by round in a random order, so drift and contention hit all of them alike:

* ``fused``: a plain forward, then one fused backward (what 1f1b's ``B`` runs);
* ``split``: a plain forward, then :func:`~lightning_pp.runtime.split_backward.backward_input` and
  :meth:`~lightning_pp.runtime.split_backward.WeightWork.run` (``I`` and ``W`` alone), the graph
  retained from ``I`` to ``W`` (``W`` makes one engine call per layer);
* ``engine``: as ``engine_step`` runs a split schedule: ``I`` with ``free_graph=True`` (where
  every layer ``W`` runs is a Linear or a norm, ``I`` frees the graph as it runs, ``W`` keeps
  only their inputs and computes their weight gradients directly:
  :mod:`~lightning_pp.runtime.weight_grad_direct`), the forward then without hooks; otherwise the
  forward under a :class:`~lightning_pp.runtime.saved_for_w.SavedForW`, and ``I`` followed by
  ``work.nodes()`` and the trim (the trim counts in ``t_i``: the engine does it inside the
  ``I`` action);
* ``torch``: torch's own split, ``torch.distributed.pipelining._backward``'s
  ``stage_backward_input`` then ``stage_backward_weight`` (what its ZB-H1 and ZB-V schedules
  run), on the same stage: how far a split's cost is autograd's rather than ours.

Every phase is timed with ``time.perf_counter`` (wall) and ``time.thread_time`` (this
thread's CPU time: a busy machine stretches the wall figure, much less the CPU one). Torch
runs on one thread, as every pipeline rank of the benchmarks does (``harness.py``).

Reported: the median of each phase over ``--iters`` rounds, ``(t_i + t_w) / t_b`` (ratio of
medians, the median of the per-round ratio, and the ratio of 10th percentiles: load only adds
time, so the low end is the least disturbed figure), and a breakdown of ``I`` (graph analysis,
engine call, ``nodes()`` + trim) and of ``W`` (each engine call, the Python around them),
taken by wrapping the module's functions (so it follows whatever ``split_backward`` does).

Usage:
    nice -n 19 python benchmarks/split_backward_cost.py [--iters 200] [--dim 128 --heads 4
        --seq 64 --mb 4 --layers 2] [--threads 1] [--device cuda] [--json FILE]
        [--baseline FILE]

``--baseline``: another ``split_backward.py`` measured in the same rounds (``split-base``,
``engine-base``), the fair before/after on a machine whose load drifts::

    git show caffe28:lightning_pp/runtime/split_backward.py > /tmp/split_backward_base.py
    nice -n 19 python benchmarks/split_backward_cost.py --baseline /tmp/split_backward_base.py
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn

from benchmarks.workloads import Block
from lightning_pp.runtime import split_backward as sb
from lightning_pp.runtime.saved_for_w import SavedForW


class _Clock:
    """Accumulates wall and CPU seconds per phase name for the current round."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        # on an accelerator: wait for its queued work at each phase's start and end, so the
        # wall figure is the phase's device time (the CPU figure is then only the launching)
        self.sync: Callable[[], None] | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.sync is not None:
            self.sync()
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.wall[name] += time.perf_counter() - w0
            self.cpu[name] += time.thread_time() - c0
            self.calls[name] += 1

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()


CLOCK = _Clock()
_context = ["I"]  # which action the wrapped engine calls belong to


def _wrap(module: Any, name: str, label: Callable[[], str]) -> None:
    """Time every call of ``module.name`` under ``label()`` (skipped if it does not exist)."""
    fn = getattr(module, name, None)
    if fn is None or getattr(fn, "_timed", False):
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        with CLOCK.phase(label()):
            return fn(*args, **kwargs)

    timed._timed = True  # type: ignore[attr-defined]
    setattr(module, name, timed)


def instrument(module: Any) -> None:
    """Wrap a split backward module's internals, so the breakdown follows its implementation."""
    for name in ("_walk", "_intermediates", "_group", "_scan", "_analyse"):
        _wrap(module, name, lambda name=name: f"I.{name}")  # type: ignore[misc]
    _wrap(module, "_run_backward", lambda: f"{_context[0]}.engine")


def load_baseline(path: str) -> Any:
    """Another version of ``split_backward.py`` as its own module (e.g. the output of
    ``git show REV:lightning_pp/runtime/split_backward.py``): measured in the same rounds as
    the current one, so the machine's load weighs on both alike."""
    spec = importlib.util.spec_from_file_location("split_backward_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # its relative imports (.weight_grad_direct, ...) resolve beside the installed one
    module.__package__ = "lightning_pp.runtime"
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def build(layers: int, dim: int, heads: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(dim, heads) for _ in range(layers)])


_GRAPH_FREE: dict[int, bool] = {}  # per implementation: its last engine-mode I freed the graph


def one_round(
    stage: nn.Module, x0: torch.Tensor, dy: torch.Tensor, mode: str, impl: Any = sb
) -> None:
    """One forward + backward in ``mode``; phases land in ``CLOCK``."""
    x = x0.detach().requires_grad_(True)
    if mode == "torch":
        _torch_round(stage, x, dy)
        return
    kept = None
    engine = mode.startswith("engine")
    # as StepRun: once a chunk's I freed its graph, its forwards skip the SavedForW hooks
    free = engine and "free_graph" in inspect.signature(impl.backward_input).parameters
    with CLOCK.phase("F"):
        if engine and not _GRAPH_FREE.get(id(impl), False):
            kept = SavedForW()
            with kept.hooks():
                y = stage(x)
        else:
            y = stage(x)
    # As the engine does once the output is sent: only its grad_fn is needed any more.
    y.data = torch.empty(1, device=y.device)
    # Each action drops what the engine drops at its end (the stash entry holding the output,
    # so its graph), so freeing the graph is timed where the engine pays for it: in B, in W.
    if mode == "fused":
        with CLOCK.phase("B"):
            sb.fused_backward((y,), (dy,))
            del y
        return
    _context[0] = "I"
    with CLOCK.phase("I"):
        dx, work = impl.backward_input((y,), (dy,), (x,), **({"free_graph": True} if free else {}))
        del y  # the graph (or what W captured) lives on in `work` until W
        freed = getattr(work, "graph_freed", False)
        if engine:
            _GRAPH_FREE[id(impl)] = freed
        if kept is not None and not freed:
            with CLOCK.phase("I.nodes"):
                w_nodes = work.nodes()
            with CLOCK.phase("I.trim"):
                kept.trim(w_nodes)
            del w_nodes
    assert dx[0] is not None and not work.fused, work.reason
    _context[0] = "W"
    with CLOCK.phase("W"):
        work.run()
        del work


def _torch_round(stage: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    """torch's split backward (its runtime keeps the stage output whole: no release)."""
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    with CLOCK.phase("F"):
        y = stage(x)
    with CLOCK.phase("I"):
        _, groups = stage_backward_input([y], [dy], [x], stage.parameters())
        del y
    with CLOCK.phase("W"):
        stage_backward_weight(stage.parameters(), groups)
        del groups


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--device", default="cpu", help="cpu, or cuda (then judge by [wall]: it waits for the GPU)"
    )
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument(
        "--baseline",
        help="another split_backward.py to measure in the same rounds (modes split-base, "
        "engine-base), e.g. from `git show caffe28:lightning_pp/runtime/split_backward.py`",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    instrument(sb)
    impls: dict[str, Any] = {"fused": sb, "split": sb, "engine": sb, "torch": None}
    if args.baseline:
        base = load_baseline(args.baseline)
        instrument(base)
        impls.update({"split-base": base, "engine-base": base})
    device = torch.device(args.device)
    if device.type == "cuda":
        CLOCK.sync = torch.cuda.synchronize
    stage = build(args.layers, args.dim, args.heads, args.seed).to(device)
    g = torch.Generator().manual_seed(args.seed)
    x0 = torch.randn(args.mb, args.seq, args.dim, generator=g).to(device)
    dy = torch.randn(args.mb, args.seq, args.dim, generator=g).to(device)
    modes = tuple(impls)
    rng = random.Random(args.seed)
    # samples[mode][clock][phase] -> per-round values
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        m: {"wall": defaultdict(list), "cpu": defaultdict(list)} for m in modes
    }
    calls: dict[str, dict[str, int]] = {}
    for it in range(args.warmup + args.iters):
        # a fresh random order each round: no mode always follows the same one (what ran just
        # before leaves caches and the allocator in its own state)
        order = list(modes)
        rng.shuffle(order)
        for mode in order:
            CLOCK.reset()
            one_round(stage, x0, dy, mode, impls[mode])
            for p in stage.parameters():
                p.grad = None
            if it < args.warmup:
                continue
            for phase in CLOCK.wall:
                samples[mode]["wall"][phase].append(CLOCK.wall[phase] * 1e3)
                samples[mode]["cpu"][phase].append(CLOCK.cpu[phase] * 1e3)
            calls[mode] = dict(CLOCK.calls)
    med = {
        m: {c: {p: statistics.median(v) for p, v in samples[m][c].items()} for c in ("wall", "cpu")}
        for m in modes
    }
    out: dict[str, Any] = {"args": vars(args), "median_ms": med, "calls": calls, "ratio": {}}
    print(
        f"stage: {args.layers} x Block(dim={args.dim}, heads={args.heads}), mb={args.mb}, "
        f"seq={args.seq}, threads={args.threads}, device={args.device}, {args.iters} rounds "
        "(medians, ms)"
    )
    for clock in ("wall", "cpu"):
        tb = med["fused"][clock]["B"]
        print(f"\n[{clock}]  fused: F {med['fused'][clock]['F']:.3f}  B {tb:.3f}")
        for mode in modes[1:]:
            m = med[mode][clock]
            per_round = statistics.median(
                (i + w) / b
                for i, w, b in zip(
                    samples[mode][clock]["I"],
                    samples[mode][clock]["W"],
                    samples["fused"][clock]["B"],
                )
            )
            ratio = (m["I"] + m["W"]) / tb
            # the 10th percentiles: a loaded machine only ever adds time, so the low end of
            # each distribution is the least disturbed estimate of its cost
            p10 = (
                _quantile(samples[mode][clock]["I"], 0.1)
                + _quantile(samples[mode][clock]["W"], 0.1)
            ) / _quantile(samples["fused"][clock]["B"], 0.1)
            out["ratio"][f"{mode}.{clock}"] = {
                "of_medians": ratio,
                "per_round": per_round,
                "of_p10": p10,
            }
            print(
                f"  {mode:11s}: F {m['F']:.3f}  I {m['I']:.3f}  W {m['W']:.3f}  "
                f"(I+W)/B = {ratio:.3f} (per-round median {per_round:.3f}, of p10s {p10:.3f})"
            )
            for phase in sorted(m):
                if "." in phase:
                    n = calls[mode].get(phase, 0)
                    print(f"      {phase:18s} {m[phase]:7.3f}  ({n} call{'s' if n != 1 else ''})")
            w_py = m["W"] - m.get("W.engine", 0.0)
            i_py = m["I"] - sum(v for k, v in m.items() if k.startswith("I."))
            print(f"      {'W python':18s} {w_py:7.3f}\n      {'I rest':18s} {i_py:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    # one line for benchmarks/gpu_check.py's table: on a GPU the wall clock is the figure
    clock = "wall" if device.type != "cpu" else "cpu"
    headline = {
        f"{mode} (I+W)/B": round(out["ratio"][f"{mode}.{clock}"]["of_medians"], 3)
        for mode in ("engine", "torch")
    }
    print(
        "RESULT "
        + json.dumps({"clock": clock, "B_ms": round(med["fused"][clock]["B"], 3)} | headline)
    )
    return out


if __name__ == "__main__":
    main()
