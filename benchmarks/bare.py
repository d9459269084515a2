"""A bare runner of a schedule's actions, for the benchmarks only: what executing them costs on
this machine before any runtime adds anything.

Why it exists: the zero-bubble targets of issue 14 compare measured step times with the
simulator's makespan, and on a 2-core machine running 4 ranks every action costs something on
top of its nominal layer time (the virtual device's wake-up, autograd's entry, gloo's posting).
Whether a target is out of reach for a plain executor too, or only for lightning_pp's engine,
is a measurement: run the very same actions with nothing but what they need and see. On the
virtual device (layers of custom autograd Functions, which our engine does not split further)
that is a lower bound in practice; on real layers it is not, since the engine's graph-free ``I``
/ ``W`` (:mod:`lightning_pp.runtime.weight_grad_direct`) does less work than the second engine pass
here.

What it does, and nothing more:

* every receive of the step is posted at its start (static shapes, one buffer each, a tag per
  destination stage and kind), so no action ever waits for a late posting;
* ``F`` runs the chunk (the last stage adds the loss, scaled by ``1/m``); the output goes out
  with ``isend`` or, when the next stage is on the same rank (zbv's fold), is handed over
  directly;
* ``B`` is one ``torch.autograd.backward`` into the input and the parameters; ``I`` is
  ``torch.autograd.grad`` into the input and every layer's output with the graph retained, and
  ``W`` one ``torch.autograd.backward`` per layer, from that layer's output into its own
  parameters. Starting ``W`` at each layer's output is what keeps it from running a second
  input-gradient pass through the stage's later layers (the virtual device's ``W`` then only
  re-enters one untimed join node per layer); torch keeps the same intermediate gradients;
* sends are waited for once, at the end of the step.

It checks nothing, frees no output early, keeps no record: it is a ruler, not a runtime. The
chunks are wrapped in the same :class:`~benchmarks.harness.Instrumented` meter as both real
implementations, so the three are measured alike.

Example (inside an initialised process group of ``pp`` ranks)::

    step, params = build_bare_step(w, "zbv", pp, 2, m, rank, dev, stats)
    loss = step(x, y)  # the loss on the rank holding the last stage, else None
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_pp.layout.partition import PipelineChunk
from lightning_pp.schedules import Op, Schedule

from .harness import Instrumented, RankStats
from .ours import build_chunks
from .workloads import Workload


def _tag(stage: int, grad: bool) -> int:
    """One tag per (destination stage, kind): receives of one kind into one stage are posted
    and sent in microbatch order on both sides, which is all gloo's matching needs."""
    return 2 * stage + int(grad)


def _timed_wait(work: dist.Work) -> float:
    """Wait for ``work``; return the seconds it blocked."""
    t0 = time.perf_counter()
    work.wait()
    return time.perf_counter() - t0


def build_bare_step(
    workload: Workload,
    schedule: str,
    pp: int,
    vpp: int,
    microbatches: int,
    rank: int,
    device: torch.device,
    stats: RankStats,
    log: list[tuple[str, float, float]] | None = None,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None], list[nn.Parameter]]:
    """Return ``(step(x, y) -> loss or None, local parameters)``, like the other builders.

    ``log``: if given, each step replaces its contents with one ``(op, seconds, seconds blocked
    on a receive)`` per action, in order (``benchmarks/ops_vs_bare.py`` compares them with our
    engine's step records); two clock reads and one wait stamp per action, nothing else.
    """
    inner: list[PipelineChunk] = []  # the chunks inside their meters, for their layers

    def metered(sched: Schedule, c: int, chunk: PipelineChunk) -> nn.Module:
        inner.append(chunk)
        return Instrumented(chunk, stats, weight_hook=not sched.split_backward)

    sched, chunks = build_chunks(workload, schedule, pp, vpp, microbatches, rank, device, metered)
    stages = sched.stages_of(rank)
    last = sched.num_stages - 1
    chunk_params = [[p for p in c.parameters() if p.requires_grad] for c in chunks]
    # Each layer's output, recorded by a forward hook during the chunk's F (see the module
    # docstring: W starts from them).
    outs: list[torch.Tensor] = []
    layer_params = []
    for chunk in inner:
        per_layer = []
        for layer in chunk.layers:
            layer.register_forward_hook(lambda mod, args, out: outs.append(out))
            per_layer.append([p for p in layer.parameters() if p.requires_grad])
        layer_params.append(per_layer)
    shape = workload.sample_shape()
    actions = sched.ranks[rank]
    m = microbatches

    def peer(stage: int) -> int | None:
        """The rank holding ``stage``, or ``None`` when it is this rank (a local hand-over)."""
        r = sched.locate(stage)[0]
        return None if r == rank else r

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        xs, ys = x.chunk(m), y.chunk(m)
        # Every receive of the step, posted now: (chunk, mb) -> (work, buffer).
        acts: dict[tuple[int, int], tuple] = {}
        grads: dict[tuple[int, int], tuple] = {}
        for c, s in enumerate(stages):
            for mb in range(m):
                if s > 0 and (src := peer(s - 1)) is not None:
                    buf = torch.empty(shape, device=device)
                    acts[c, mb] = (dist.irecv(buf, src, tag=_tag(s, False)), buf)
                if s < last and (src := peer(s + 1)) is not None:
                    buf = torch.empty(shape, device=device)
                    grads[c, mb] = (dist.irecv(buf, src, tag=_tag(s, True)), buf)
        local_act: dict[tuple[int, int], torch.Tensor] = {}  # stage -> next stage, same rank
        local_grad: dict[tuple[int, int], torch.Tensor] = {}
        # (chunk, mb) -> (input, output, its gradient, layer outputs, their gradients)
        stash: dict[tuple[int, int], tuple] = {}
        sends: list = []
        total = None
        if log is not None:
            log.clear()
        for a in actions:
            start, blocked = time.perf_counter(), 0.0
            try:
                c, mb = a.chunk, a.mb
                s = stages[c]
                if a.op is Op.F:
                    if s == 0:
                        inp = xs[mb].to(device)
                    elif (c, mb) in acts:
                        work, inp = acts.pop((c, mb))
                        blocked = _timed_wait(work)
                        inp.requires_grad_()
                    else:
                        inp = local_act.pop((s, mb))
                    outs.clear()
                    out = chunks[c](inp)
                    layer_outs = list(outs)
                    if s == last:
                        loss = Workload.loss_fn(out, ys[mb].to(device))
                        total = loss.detach() if total is None else total + loss.detach()
                        out = loss / m
                    elif (dst := peer(s + 1)) is not None:
                        sends.append(dist.isend(out.detach(), dst, tag=_tag(s + 1, False)))
                    else:
                        local_act[s + 1, mb] = out.detach().requires_grad_()
                    stash[c, mb] = (inp, out, None, layer_outs, None)
                    continue
                inp, out, g, layer_outs, layer_grads = stash[c, mb]
                if a.op is Op.W:
                    if layer_grads is None:  # the first stage: I was a no-op, W is the backward
                        torch.autograd.backward(out, g, inputs=chunk_params[c])
                    else:
                        for h, gh, ps in zip(layer_outs, layer_grads, layer_params[c]):
                            if ps:  # a layer without trainable weights has no W
                                torch.autograd.backward(h, gh, inputs=ps)
                    del stash[c, mb]
                    continue
                if s == last:
                    g = None
                elif (c, mb) in grads:
                    work, g = grads.pop((c, mb))
                    blocked = _timed_wait(work)
                else:
                    g = local_grad.pop((s, mb))
                if a.op is Op.B or not inp.requires_grad:
                    # a fused backward, or the first stage's I (no input gradient): W then does it
                    if a.op is Op.B:
                        torch.autograd.backward(out, g)
                        del stash[c, mb]
                    else:
                        stash[c, mb] = (inp, out, g, layer_outs, None)
                    gin = inp.grad if inp.requires_grad else None
                else:
                    gin, *layer_grads = torch.autograd.grad(
                        out, [inp, *layer_outs], g, retain_graph=True
                    )
                    stash[c, mb] = (inp, out, g, layer_outs, layer_grads)
                if s > 0:
                    if (dst := peer(s - 1)) is not None:
                        sends.append(dist.isend(gin, dst, tag=_tag(s - 1, True)))
                    else:
                        local_grad[s - 1, mb] = gin
            finally:
                if log is not None:
                    log.append((a.op.value, time.perf_counter() - start, blocked))
        for work in sends:
            work.wait()
        return None if total is None else total / m

    params = [p for ps in chunk_params for p in ps]
    return step, params
