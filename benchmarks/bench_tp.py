"""Tensor parallelism inside a stage: pp2 x tp2 against pp4 and pp2 x dp2, on the same four
processes and the same layers, under the real Trainer and ``PipelineStrategy``.

The model is :class:`~lightning_pp.models.decoder.DecoderLM` (separate q/k/v; tp shards q, k, v
and the MLP's first Linear column-wise, the two output projections row-wise, the embedding by
vocabulary and the tied head column-wise with gathered logits); every variant trains the same
global batch, cut into the same 8 microbatches, under 1F1B, AdamW inside the timed step:

=========  ====  ====  ====  ===========================================================
variant    pp    dp    tp    what moves between processes
=========  ====  ====  ====  ===========================================================
pp4        4     1     1     3 stage boundaries, one sender per boundary
pp2-dp2    2     2     1     1 boundary x 2 replicas; the gradients all-reduced over dp
pp2-tp2    2     1     2     1 boundary x 2 tp ranks (each sends its replicated copy to its
                             peer); per block 2 forward + 4 backward all-reduces over tp
=========  ====  ====  ====  ===========================================================

**Correctness first.** Every variant's per-step training loss is compared with the
single-process plain Trainer on the same global batch (the project's reference: one process,
unpipelined, unsharded): a variant off by more than ``--tol`` (relative) is reported.

**Timing.** ``--rounds`` rounds, each one ``Trainer.fit`` per variant of ``--warmup`` +
``--steps`` steps, the variants in order in even rounds and reversed in odd ones. A step is timed
by a callback: a barrier of all four processes at ``on_train_batch_start``, then ``max(end) -
min(start)`` over the ranks at ``on_train_batch_end`` (after the optimizer step;
``time.perf_counter`` is CLOCK_MONOTONIC, one clock for every process of the machine). The
median over every measured step is reported.

**P2P bytes per step, counted.** ``P2PCommunicator._post`` is wrapped: every posted send's
tensor bytes (activations, gradients and the small shape headers), summed over the four ranks
per step; the table also gives the number computed from the shapes (boundaries x senders per
boundary x microbatches x (activation + gradient), ``mb x T x C x 4`` bytes each) as a check.

**tp collective time per step, measured.** The functional collectives DTensor issues
(``torch.distributed._functional_collectives.all_reduce``, ``all_gather_single``,
``all_gather_tensor``, ``reduce_scatter_single``, ``reduce_scatter_tensor``) are wrapped: each
call is timed from its launch to its completion (the wrapper waits for it, where DTensor
would wait at the result's first use: on gloo CPU the overlap that removes is small), with its
bytes; per rank per step, then the mean over the ranks (``all_gather_tensor`` calls
``all_gather_single``: only the outer call counts). pp4 and pp2-dp2 issue none (checked).

**Send or broadcast** (issue 33, point 3): the activation a row-wise layer leaves replicated
over the tp ranks of a stage can be sent by every tp rank to its peer on the next stage (what
the engine does), or by tp rank 0 alone, then broadcast over the receiving stage's tp group.
After the runs, the same four processes time both (gloo, ranks 0,1 = stage 0 and 2,3 = stage
1): from a barrier to the last receiver holding the tensor, ``--micro-iters`` times each,
alternating, at the benchmark's own message size and around it.

Usage::

    nice -n 19 python benchmarks/bench_tp.py                  # ~6 min on 2 cores
    python benchmarks/bench_tp.py --quick --out /tmp/tp.json  # tiny model, ~1 min

Writes ``benchmarks/results/tp.json`` (``--out``; every number and the command) and the table
beside it (``tp.md``); prints the table. On CPU this is a correctness-and-cost report, not a
speed claim: four processes share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_pp` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

WORLD = 4
MICROBATCHES = 8

#: model and batch per size: DecoderLM, 8 microbatches per replica of ``mb`` samples (pp4 and
#: pp2 x tp2: one replica, so ``mb = global batch / 8``)
SIZES: dict[str, dict[str, Any]] = {
    "full": {"n_embd": 256, "n_head": 8, "n_layer": 8, "seq": 128, "vocab": 512, "batch": 16},
    "quick": {"n_embd": 64, "n_head": 4, "n_layer": 4, "seq": 16, "vocab": 64, "batch": 16},
}


@dataclass(frozen=True)
class Variant:
    name: str
    pp: int
    tp: int
    #: DecoderLM(sequence_parallel=True): activations between the tp regions cut along T
    sp: bool = False
    #: with sequence parallelism, torch's ColwiseParallel for q, k, v and fc: each keeps its
    #: gathered (whole-sequence) input for backward, where ColwiseFromSequence keeps the
    #: rank's T / tp part and gathers it again in backward (Megatron's second saving)
    keep_gathered: bool = False

    @property
    def dp(self) -> int:
        return WORLD // (self.pp * self.tp)


VARIANTS = {
    v.name: v
    for v in (
        Variant("pp4", 4, 1),
        Variant("pp2-dp2", 2, 1),
        Variant("pp2-tp2", 2, 2),
        Variant("pp2-tp2-sp", 2, 2, sp=True),
        Variant("pp2-tp2-sp-gathered", 2, 2, sp=True, keep_gathered=True),
    )
}


@dataclass(frozen=True)
class Spec:
    size: dict[str, Any]
    variants: tuple[Variant, ...]
    rounds: int
    warmup: int
    steps: int
    micro_sizes: tuple[int, ...]
    micro_iters: int


# --------------------------------------------------------------------------------------------
# Model and data (the same in every process and in the reference)
# --------------------------------------------------------------------------------------------


def make_model(size: dict[str, Any], max_steps: int, sequence_parallel: bool = False) -> Any:
    from lightning_pp.models.decoder import DecoderLM

    return DecoderLM(
        sequence_parallel=sequence_parallel,
        vocab_size=size["vocab"],
        n_layer=size["n_layer"],
        n_head=size["n_head"],
        n_embd=size["n_embd"],
        block_size=size["seq"],
        lr=1e-3,
        warmup_steps=2,
        max_steps=max_steps,
        seed=11,
    )


def make_data(size: dict[str, Any], steps: int, dp: int) -> Any:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    class Tokens(L.LightningDataModule):
        """Random tokens, the same global batches for any dp: replica r takes samples r, r +
        dp, ... of each global batch (the strategy's sampler arguments)."""

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(5)
            n = size["batch"] * steps
            seq = torch.randint(0, size["vocab"], (n, size["seq"] + 1), generator=g)
            ds = TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
            if dp == 1:
                return DataLoader(ds, batch_size=size["batch"], shuffle=False)
            kw = self.trainer.strategy.distributed_sampler_kwargs
            sampler = DistributedSampler(ds, shuffle=False, **kw)
            return DataLoader(ds, batch_size=size["batch"] // dp, sampler=sampler)

    return Tokens()


def make_trainer(strategy: Any, devices: int, steps: int, callbacks: list[Any]) -> Any:
    import lightning.pytorch as L

    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        precision="32-true",
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )


def reference(size: dict[str, Any], steps: int) -> list[float]:
    """The single-process plain Trainer's loss per step on the whole global batch."""
    torch.set_num_threads(1)
    losses = _Losses()
    trainer = make_trainer("auto", 1, steps, [losses])
    trainer.fit(make_model(size, steps), make_data(size, steps, dp=1))
    return losses.values


def _losses_callback_base() -> type:
    from lightning.pytorch.callbacks import Callback

    return Callback


class _Losses(_losses_callback_base()):  # type: ignore[misc]
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["train_loss"]))


# --------------------------------------------------------------------------------------------
# What is counted: P2P sends and the tp collectives
# --------------------------------------------------------------------------------------------


class Counters:
    """Per step on this rank: P2P send bytes and count, tp collective seconds, count, bytes."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.p2p_bytes = self.p2p_sends = 0
        self.coll_s = 0.0
        self.coll_n = self.coll_bytes = 0
        self.coll_kinds: dict[str, int] = {}


COUNTERS = Counters()


def install_counters() -> None:
    """Wrap the engine's P2P posting and DTensor's functional collectives (module notes)."""
    import torch.distributed._functional_collectives as funcol

    from lightning_pp.runtime.p2p import P2PCommunicator

    post = P2PCommunicator._post

    def counted_post(self, ops, what):
        for op in ops:
            if op.send:
                COUNTERS.p2p_bytes += op.tensor.numel() * op.tensor.element_size()
                COUNTERS.p2p_sends += 1
        return post(self, ops, what)

    P2PCommunicator._post = counted_post  # type: ignore[method-assign]

    depth = [0]  # all_gather_tensor calls all_gather_single: count the outer call only

    def timed(name: str, real: Any) -> Any:
        def call(tensor, *args, **kwargs):
            if depth[0]:
                return real(tensor, *args, **kwargs)
            t0 = time.perf_counter()
            depth[0] += 1
            try:
                out = real(tensor, *args, **kwargs)
                if isinstance(out, funcol.AsyncCollectiveTensor):
                    out.trigger_wait()
            finally:
                depth[0] -= 1
            COUNTERS.coll_s += time.perf_counter() - t0
            COUNTERS.coll_n += 1
            COUNTERS.coll_bytes += tensor.numel() * tensor.element_size()
            COUNTERS.coll_kinds[name] = COUNTERS.coll_kinds.get(name, 0) + 1
            return out

        return call

    for name in (
        "all_reduce",
        "all_gather_single",
        "all_gather_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
    ):
        real = getattr(funcol, name, None)
        if real is not None:
            setattr(funcol, name, timed(name, real))


def _clock_base() -> type:
    return _losses_callback_base()


class StepClock(_clock_base()):  # type: ignore[misc]
    """Barrier, then this rank's start and end of every training step and its counters."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import torch.distributed as dist

        # the first (warm-up, untimed) step also counts what autograd saves, from the tensors
        trainer.strategy.engine.measure_memory = batch_idx == 0
        dist.barrier()
        COUNTERS.reset()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        t1 = time.perf_counter()
        c = COUNTERS
        self.rows.append(
            {
                "t0": self._t0,
                "t1": t1,
                "loss": float(trainer.callback_metrics["train_loss"]),
                "p2p_bytes": c.p2p_bytes,
                "p2p_sends": c.p2p_sends,
                "coll_s": c.coll_s,
                "coll_n": c.coll_n,
                "coll_bytes": c.coll_bytes,
                "coll_kinds": dict(c.coll_kinds),
                # peak bytes autograd saved for backward in this step (measured steps only)
                "saved_bytes": trainer.strategy.last_record.peak_saved_bytes
                if batch_idx == 0
                else None,
            }
        )


# --------------------------------------------------------------------------------------------
# The worker (one per process, under torchrun)
# --------------------------------------------------------------------------------------------


def run_variant(v: Variant, spec: Spec, steps: int) -> list[dict[str, Any]]:
    from lightning_pp import PipelineStrategy

    clock = StepClock()
    strategy = PipelineStrategy(pp=v.pp, tp=v.tp, microbatches=MICROBATCHES, schedule="1f1b")
    trainer = make_trainer(strategy, WORLD, steps, [clock])
    with torch_colwise(v.keep_gathered):
        trainer.fit(make_model(spec.size, steps, v.sp), make_data(spec.size, steps, v.dp))
    return clock.rows


@contextmanager
def torch_colwise(on: bool) -> Iterator[None]:
    """``DecoderLM``'s sequence-parallel plan with torch's ``ColwiseParallel`` in place of
    ``ColwiseFromSequence`` (the plan imports the name when the strategy applies it)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_pp.models import sequence_parallel

    ours = sequence_parallel.ColwiseFromSequence
    if on:
        sequence_parallel.ColwiseFromSequence = ColwiseParallel  # type: ignore[misc]
    try:
        yield
    finally:
        sequence_parallel.ColwiseFromSequence = ours  # type: ignore[misc]


def send_or_broadcast(spec: Spec) -> list[dict[str, Any]]:
    """Both ways of moving a tp-replicated activation from stage 0 (ranks 0, 1) to stage 1
    (ranks 2, 3); per size and way, this rank's (start, end) per iteration (end: when it holds
    the tensor; senders: after their send completed)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    recv_group = groups[1]
    out = []
    for nbytes in spec.micro_sizes:
        buf = torch.full((nbytes // 4,), float(rank))
        times: dict[str, list[tuple[float, float]]] = {"every": [], "once+bcast": []}
        for i in range(2 + spec.micro_iters):
            for way in ("every", "once+bcast") if i % 2 == 0 else ("once+bcast", "every"):
                dist.barrier()
                t0 = time.perf_counter()
                if way == "every":  # tp rank r of stage 0 -> tp rank r of stage 1, both at once
                    if rank < 2:
                        dist.send(buf, rank + 2)
                    else:
                        dist.recv(buf, rank - 2)
                else:  # tp rank 0 sends, then the next stage's tp group broadcasts
                    if rank == 0:
                        dist.send(buf, 2)
                    elif rank == 2:
                        dist.recv(buf, 0)
                    if rank >= 2:
                        dist.broadcast(buf, src=2, group=recv_group)
                t1 = time.perf_counter()
                if i >= 2:
                    times[way].append((t0, t1))
        out.append({"bytes": nbytes, "times": times})
    return out


def worker(spec: Spec, raw_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    install_counters()
    runs = []
    for r in range(spec.rounds):
        order = list(spec.variants) if r % 2 == 0 else list(reversed(spec.variants))
        for v in order:
            rows = run_variant(v, spec, spec.warmup + spec.steps)
            runs.append({"round": r, "variant": v.name, "rows": rows})
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    micro = send_or_broadcast(spec)
    rank = dist.get_rank()
    with open(os.path.join(raw_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "runs": runs, "micro": micro}, f)
    dist.barrier()


# --------------------------------------------------------------------------------------------
# The parent: reference, launch, summary
# --------------------------------------------------------------------------------------------


def expected_p2p_bytes(v: Variant, size: dict[str, Any]) -> int:
    """From the shapes: each stage boundary, each of its ``dp x tp`` senders, ``m`` microbatches,
    an activation forward and its gradient backward of ``mb x T x C`` fp32 values."""
    mb = size["batch"] // (v.dp * MICROBATCHES)
    msg = mb * size["seq"] * size["n_embd"] * 4 // (v.tp if v.sp else 1)
    return (v.pp - 1) * v.dp * v.tp * MICROBATCHES * 2 * msg


def summarize(ranks: list[dict], spec: Spec, ref: list[float], tol: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in spec.variants:
        steps: list[dict[str, Any]] = []
        losses: list[list[float]] = []
        for i, run in enumerate(ranks[0]["runs"]):
            if run["variant"] != v.name:
                continue
            per_rank = [r["runs"][i]["rows"] for r in ranks]
            losses.append([row["loss"] for row in per_rank[0]])
            for s in range(spec.warmup, spec.warmup + spec.steps):
                rows = [p[s] for p in per_rank]
                steps.append(
                    {
                        "step_s": max(x["t1"] for x in rows) - min(x["t0"] for x in rows),
                        "p2p_bytes": sum(x["p2p_bytes"] for x in rows),
                        "p2p_sends": sum(x["p2p_sends"] for x in rows),
                        "coll_s": statistics.mean(x["coll_s"] for x in rows),
                        "coll_s_max": max(x["coll_s"] for x in rows),
                        "coll_n": statistics.mean(x["coll_n"] for x in rows),
                        "coll_bytes": statistics.mean(x["coll_bytes"] for x in rows),
                        "coll_kinds": {
                            k: sum(x["coll_kinds"].get(k, 0) for x in rows) / len(rows)
                            for k in sorted({k for x in rows for k in x["coll_kinds"]})
                        },
                    }
                )
        errs = [abs(a - b) / abs(b) for run in losses for a, b in zip(run, ref)]
        # per run, the first step's peak saved bytes of the heaviest rank (from the tensors)
        saved = [
            max(r["runs"][i]["rows"][0]["saved_bytes"] or 0 for r in ranks)
            for i, run in enumerate(ranks[0]["runs"])
            if run["variant"] == v.name
        ]

        def med(key: str, steps: list[dict[str, Any]] = steps) -> float:
            return statistics.median(s[key] for s in steps)

        out[v.name] = {
            "pp": v.pp,
            "dp": v.dp,
            "tp": v.tp,
            "step_ms": 1e3 * med("step_s"),
            "step_ms_all": [round(1e3 * s["step_s"], 2) for s in steps],
            "p2p_bytes": med("p2p_bytes"),
            "p2p_sends": med("p2p_sends"),
            "p2p_bytes_from_shapes": expected_p2p_bytes(v, spec.size),
            "tp_coll_ms": 1e3 * med("coll_s"),
            "tp_coll_ms_max_rank": 1e3 * med("coll_s_max"),
            "tp_coll_calls": med("coll_n"),
            "tp_coll_bytes": med("coll_bytes"),
            "tp_coll_kinds": steps[0]["coll_kinds"] if steps else {},
            "saved_bytes_max_rank": max(saved) if saved else None,
            "loss_rel_err_max": max(errs) if errs else None,
            "check": "ok" if errs and max(errs) <= tol else f"DIFFERS (> {tol:g})",
        }
    return out


def summarize_micro(ranks: list[dict]) -> list[dict[str, Any]]:
    """Per size and way: the median over iterations of (last receiver's end - first start)."""
    out = []
    for k, entry in enumerate(ranks[0]["micro"]):
        row: dict[str, Any] = {"bytes": entry["bytes"]}
        for way in ("every", "once+bcast"):
            n = len(entry["times"][way])
            spans = []
            for i in range(n):
                t = [r["micro"][k]["times"][way][i] for r in ranks]
                spans.append(max(e for _, e in t[2:]) - min(s for s, _ in t))
            row[f"{way}_ms"] = 1e3 * statistics.median(spans)
            row[f"{way}_ms_p90"] = 1e3 * sorted(spans)[int(0.9 * (n - 1))]
        out.append(row)
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def to_markdown(result: dict[str, Any]) -> str:
    cfg, s = result["config"], result["summary"]
    lines = [
        f"`{result['command']}` — {result['machine']['nproc']} CPU cores "
        f"({result['machine']['cpu']}), torch {result['machine']['torch']}, load "
        f"{result['machine']['loadavg']} at start, {result['seconds']} s"
        + ("" if result.get("quiet") else "; the machine was NOT confirmed quiet")
        + ".",
        "",
        f"Model: {cfg['model']}; global batch {cfg['global_batch']} x {cfg['seq']} tokens, "
        f"{MICROBATCHES} microbatches per replica, 1F1B, AdamW, fp32, gloo; {cfg['rounds']} "
        f"rounds x {cfg['steps']} measured steps per variant (median).",
        "",
        "| variant | pp x dp x tp | step ms (median) | P2P bytes / step (counted) | "
        "from shapes | P2P sends / step | tp collective ms / step (mean rank; max rank) | "
        "tp collectives / step (bytes) | saved for backward, heaviest rank | loss vs 1 process |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in s.items():
        kinds = ", ".join(f"{k} {v:g}" for k, v in sorted(r["tp_coll_kinds"].items()))
        lines.append(
            f"| {name} | {r['pp']} x {r['dp']} x {r['tp']} | {r['step_ms']:.1f} | "
            f"{_mib(r['p2p_bytes'])} | {_mib(r['p2p_bytes_from_shapes'])} | "
            f"{r['p2p_sends']:.0f} | {r['tp_coll_ms']:.1f}; {r['tp_coll_ms_max_rank']:.1f} | "
            f"{r['tp_coll_calls']:.0f} ({_mib(r['tp_coll_bytes'])})"
            f"{f': {kinds}' if kinds else ''} | "
            f"{_mib(r['saved_bytes_max_rank'] or 0)} | "
            f"{r['loss_rel_err_max']:.1e} {r['check']} |"
        )
    lines += [
        "",
        "Send or broadcast (4 gloo processes; stage 0 = ranks 0, 1; stage 1 = ranks 2, 3; "
        "from a barrier to the last receiver holding the tensor, median (p90) of "
        f"{result['config']['micro_iters']} alternating iterations):",
        "",
        "| message | every tp rank sends to its peer (ms) | tp rank 0 sends, stage 1 "
        "broadcasts (ms) | broadcast / every |",
        "|---|---|---|---|",
    ]
    for row in result["micro"]:
        lines.append(
            f"| {row['bytes'] / 1024:.0f} KiB | {row['every_ms']:.3f} ({row['every_ms_p90']:.3f}) "
            f"| {row['once+bcast_ms']:.3f} ({row['once+bcast_ms_p90']:.3f}) | "
            f"{row['once+bcast_ms'] / row['every_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, one round: a smoke run")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (3)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per fit (2)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per fit (4)")
    ap.add_argument("--micro-iters", type=int, default=None, help="send/broadcast trials (50)")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative, loss vs 1 process")
    ap.add_argument("--quiet", action="store_true", help="record that the machine was quiet")
    ap.add_argument("--out", default=None, help="JSON (default benchmarks/results/tp.json)")
    ap.add_argument("--timeout", type=float, default=3000.0)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--raw", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        d = json.loads(a.worker)
        d["variants"] = tuple(Variant(**v) for v in d["variants"])
        d["micro_sizes"] = tuple(d["micro_sizes"])
        worker(Spec(**d), a.raw)
        return {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = a.out or os.path.join(root, "benchmarks", "results", "tp.json")
    size = SIZES["quick" if a.quick else "full"]
    msg = size["batch"] // MICROBATCHES * size["seq"] * size["n_embd"] * 4
    spec = Spec(
        size=size,
        variants=tuple(VARIANTS[n] for n in a.variants),
        rounds=a.rounds or (1 if a.quick else 3),
        warmup=a.warmup,
        steps=a.steps or (2 if a.quick else 4),
        micro_sizes=tuple(sorted({msg // 4, msg, 4 * msg, 16 * msg})),
        micro_iters=a.micro_iters or (6 if a.quick else 50),
    )
    from benchmarks.harness import machine_info

    command = " ".join(
        ["python", "benchmarks/bench_tp.py", *(argv if argv is not None else sys.argv[1:])]
    )
    info = machine_info()
    t0 = time.time()
    ref = reference(size, spec.warmup + spec.steps)
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as raw:
        payload = json.dumps({**asdict(spec), "variants": [asdict(v) for v in spec.variants]})
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={WORLD}", os.path.abspath(__file__), "--worker", payload,
            "--raw", raw,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, timeout=a.timeout, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the world failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
        ranks = [json.load(open(os.path.join(raw, f"rank{r}.json"))) for r in range(WORLD)]
    params = sum(p.numel() for p in _params(size))
    result: dict[str, Any] = {
        "command": command,
        "machine": info,
        "machine_end": machine_info(),
        "quiet": a.quiet,
        "seconds": round(time.time() - t0, 1),
        "config": {
            "model": f"DecoderLM n_embd {size['n_embd']}, {size['n_head']} heads, "
            f"{size['n_layer']} blocks, vocab {size['vocab']} ({params / 1e6:.2f} M parameters; "
            f"{size['n_layer'] + 2} pipeline layers)",
            "size": size,
            "seq": size["seq"],
            "global_batch": size["batch"],
            "microbatches": MICROBATCHES,
            "rounds": spec.rounds,
            "warmup": spec.warmup,
            "steps": spec.steps,
            "micro_iters": spec.micro_iters,
            "activation_message_bytes": msg,
            "tol": a.tol,
        },
        "reference_loss": ref,
        "summary": summarize(ranks, spec, ref, a.tol),
        "micro": summarize_micro(ranks),
        "raw": ranks,
    }
    md = to_markdown(result)
    result["markdown"] = md
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write("# Tensor parallelism: pp2 x tp2 against pp4 and pp2 x dp2\n\n" + md + "\n")
    print(md)
    bad = [n for n, r in result["summary"].items() if r["check"] != "ok"]
    if bad:
        raise SystemExit(f"variants differ from the single-process reference: {bad}")
    return result


def _params(size: dict[str, Any]) -> list[torch.Tensor]:
    model = make_model(size, 1)
    with torch.device("meta"):
        model.configure_model()
    return list(model.parameters())


if __name__ == "__main__":
    main()
