"""Pipeline step benchmark: lightning_pp vs torch.distributed.pipelining, same run, alternating.

For every pipeline size ``pp`` one process group of ``pp`` ranks is spawned and runs every
(schedule, microbatches) configuration. Per configuration both implementations are built from
the same layers and data; then ``rounds`` blocks of steps run, alternating the implementation
(ABBA order) so machine noise hits both alike. Each block starts with warmup steps that are not
measured. Output: one JSON object per (configuration, implementation) line in ``--out``.

Usage:
    python benchmarks/bench_pipeline.py --workload sleep --pp 2 4 --microbatches 4 8 16 \
        --schedules gpipe 1f1b interleaved --out benchmarks/results/raw_sleep.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import dataclass

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `lightning_pp` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.harness import (
    Instrumented,
    RankStats,
    gather_floats,
    launch,
    machine_info,
    timed_step,
)
from benchmarks.peer_torch import stage_layers, torch_stage
from benchmarks.workloads import Workload

IMPLS = ("ours", "torch")
# Extra implementations selectable with --impls (not in the default sweep): "ours-nomon" is ours
# with the failure monitor off (abort_on_failure=False), to measure what reliability costs;
# "ours-L<n>" is ours with recv_lookahead=n (e.g. ours-L1: receives posted just in time);
# "bare" runs our schedule's actions with nothing else (benchmarks/bare.py): what a bare executor
# pays on this machine, the yardstick for the simulated-makespan targets.
EXTRA_IMPLS = ("ours-nomon", "ours-L1", "ours-L2", "ours-L4", "ours-L16", "bare")
SCHEDULE_VPP = {
    "gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zbv": 2, "izb": 2, "dualpipev": 2,
    "zb-auto": 2, "zb-auto-2p": 2,
}  # fmt: skip
# Schedules only one side has: torch's interleaved zero bubble (ScheduleInterleavedZeroBubble
# with 2 stages per rank) has no lightning_pp counterpart.
TORCH_ONLY = {"izb", "dualpipev"}
# ... and ours only: zb-auto, the schedule computed from costs (lightning_pp.schedules.auto)
OURS_ONLY = {"zb-auto", "zb-auto-2p"}


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs (picklable)."""

    workload: Workload
    pp: int
    configs: tuple[tuple[str, int], ...]  # (schedule, microbatches)
    impls: tuple[str, ...]
    rounds: int
    steps: int
    warmup: int


def _builder(impl: str):
    if impl == "torch":
        from benchmarks.peer_torch import build_torch_step

        return build_torch_step
    if impl == "ours":
        from benchmarks.ours import build_ours_step

        return build_ours_step
    if impl == "bare":
        from benchmarks.bare import build_bare_step

        return build_bare_step
    if impl == "ours-nomon" or impl.startswith("ours-L"):
        import functools

        from benchmarks.ours import build_ours_step

        if impl == "ours-nomon":
            return functools.partial(build_ours_step, monitor=False)
        return functools.partial(build_ours_step, recv_lookahead=int(impl[len("ours-L") :]))
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def chunk_activation_bytes(
    w: Workload, pp: int, vpp: int, rank: int, device, schedule: str = "1f1b"
) -> list[int]:
    """Bytes autograd saves for ONE microbatch through each local chunk (the memory bound's unit).

    Measured with the same meter as the benchmark, on a fresh copy of the layers.
    """
    layers = w.build_layers(pp)
    out = []
    for c in range(vpp):
        s = torch_stage(schedule, c, pp, rank)
        st = RankStats()
        chunk = Instrumented(torch.nn.Sequential(*stage_layers(layers, s, pp * vpp)), st)
        chunk.to(device)
        x = torch.zeros(w.sample_shape(), device=device, requires_grad=s > 0)
        y = chunk(x)
        out.append(st.peak_saved_bytes)
        del y
    return out


def _worker(rank: int, world: int, device: torch.device, spec: RunSpec) -> list[dict]:
    w = spec.workload
    out = []
    for schedule, m in spec.configs:
        vpp = SCHEDULE_VPP[schedule]
        runners = {}
        stats = {}
        impls = tuple(
            i
            for i in spec.impls
            if (i == "torch" or schedule not in TORCH_ONLY)
            and (i != "torch" or schedule not in OURS_ONLY)
        )
        for impl in impls:
            stats[impl] = RankStats()
            runners[impl] = _builder(impl)(w, schedule, spec.pp, vpp, m, rank, device, stats[impl])
        samples = {
            impl: {"step_s": [], "busy": [], "fwd": [], "bwd": [], "peak": []} for impl in impls
        }
        losses = {impl: [] for impl in impls}
        for rnd in range(spec.rounds):
            order = impls if rnd % 2 == 0 else tuple(reversed(impls))
            for impl in order:
                step, params = runners[impl]
                st = stats[impl]
                n_warm = spec.warmup if rnd == 0 else 1
                for i in range(n_warm + spec.steps):
                    x, y = w.batch(m, step=i % 3)
                    x, y = x.to(device), y.to(device)
                    st.reset()
                    call = functools.partial(_call_step, step, x, y, losses[impl])
                    wall, _, _ = timed_step(call, device)
                    for p in params:
                        p.grad = None
                    if i < n_warm:
                        continue
                    s = samples[impl]
                    s["step_s"].append(wall)
                    s["busy"].append(st.busy_s)
                    s["fwd"].append(st.fwd_s)
                    s["bwd"].append(st.bwd_s)
                    s["peak"].append(float(st.peak_saved_bytes))
        for impl in impls:
            s = samples[impl]
            # gather every rank's per-step busy/fwd/bwd/peak so rank 0 can compute bubbles
            per_rank = {k: gather_floats(s[k], device) for k in ("busy", "fwd", "bwd", "peak")}
            loss_vals = [float(v) for v in losses[impl] if v is not None]
            # ours: mean measured compute per op kind (F, B, I, W) from the engine's records
            op_means = _op_means(getattr(runners[impl][0], "records", []), spec.warmup)
            op_all = gather_floats([op_means.get(k, -1.0) for k in "FBIW"], device)
            out.append(
                {
                    "workload": w.name,
                    "impl": impl,
                    "schedule": schedule,
                    "pp": spec.pp,
                    "vpp": vpp,
                    "microbatches": m,
                    "mb_size": w.mb_size,
                    "step_s": s["step_s"],
                    "busy_s": per_rank["busy"],
                    "fwd_s": per_rank["fwd"],
                    "bwd_s": per_rank["bwd"],
                    "peak_saved_bytes": per_rank["peak"],
                    "losses": loss_vals,
                    "op_compute_s": op_all,  # [rank][F, B, I, W]; -1: not run / not measured
                }
            )
        act = chunk_activation_bytes(w, spec.pp, vpp, rank, device, schedule)
        act_all = gather_floats([float(a) for a in act], device)
        for rec in out[-len(impls) :]:
            rec["chunk_act_bytes"] = act_all  # [rank][chunk]
        del runners
    return out


def _op_means(records: list, warmup: int) -> dict[str, float]:
    """Mean compute seconds of each op kind over the measured steps' events (one action of one
    chunk: an F, B, I or W of one microbatch)."""
    sums: dict[str, list[float]] = {}
    for rec in records[warmup:]:
        for e in rec.events:
            sums.setdefault(e.action.op.value, []).append(e.compute)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def _call_step(step, x, y, bucket: list) -> None:
    value = step(x, y)
    bucket.append(None if value is None else float(value))


def run(
    workload: Workload,
    pps: list[int],
    microbatches: list[int],
    schedules: list[str],
    impls: tuple[str, ...] = IMPLS,
    rounds: int = 4,
    steps: int = 3,
    warmup: int = 2,
    device: str = "cpu",
    timeout: float = 3600.0,
) -> list[dict]:
    """Run the sweep; return one record per (pp, schedule, microbatches, impl)."""
    records = []
    for pp in pps:
        configs = tuple(
            (s, m)
            for s in schedules
            for m in microbatches
            if not (s == "interleaved" and m < pp)  # Megatron (and we) need m >= pp there
        )
        spec = RunSpec(workload, pp, configs, tuple(impls), rounds, steps, warmup)
        load_before = machine_info()["loadavg"]
        per_rank = launch(_worker, pp, spec, device=device, timeout=timeout)
        load_after = machine_info()["loadavg"]
        # Rank 0's list holds the gathered per-rank data; the losses come from the rank that
        # holds the last stage: the last rank, except under zbv's V placement (rank 0).
        for rec0, *others in zip(per_rank[0], *per_rank[1:]):
            rec0["losses"] = next((r["losses"] for r in (*others, rec0) if r["losses"]), [])
            rec0["device"] = device
            rec0["workload_desc"] = workload.flops_note()
            rec0["t_f"], rec0["t_b"] = workload.t_f, workload.t_b
            rec0["seq"] = workload.seq
            rec0["loadavg_pp"] = [load_before, load_after]  # around this pp's process group
            records.append(rec0)
    return records


def write_records(path: str, recs: list[dict], info: dict, info_end: dict, command: str) -> None:
    """Append ``recs`` to the JSON-lines file ``path`` with the machine description."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        for r in recs:
            r["machine"] = info
            r["loadavg_end"] = info_end["loadavg"]
            r["command"] = command
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=["sleep", "transformer"], default="sleep")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS + EXTRA_IMPLS))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per round")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps before round 0")
    ap.add_argument("--t-f", type=float, default=0.020, help="sleep: forward s per rank share")
    ap.add_argument("--t-b", type=float, default=0.040, help="sleep: backward s per rank share")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", required=True, help="JSON-lines file to append records to")
    a = ap.parse_args(argv)
    w = Workload(a.workload, t_f=a.t_f, t_b=a.t_b)
    info = machine_info()
    recs = run(
        w,
        a.pp,
        a.microbatches,
        a.schedules,
        tuple(a.impls),
        a.rounds,
        a.steps,
        a.warmup,
        a.device,
        a.timeout,
    )
    write_records(a.out, recs, info, machine_info(), " ".join(["python"] + sys.argv))
    print(f"wrote {len(recs)} records to {a.out}")


if __name__ == "__main__":
    main()
