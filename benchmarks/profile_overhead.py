"""Where does a pipeline step's time go when the layers cost nothing?

Runs the sleep workload with ``t_f = t_b = 0`` (tiny linear layers, no sleeps): the step time
is then the framework's own per-step overhead (schedule bookkeeping, P2P, autograd calls).
Alternates ours and torch like the main benchmark, then profiles one rank of ours with
cProfile and prints the top functions, plus the engine's own per-action record (comm wait vs
the rest).

Usage:
    python benchmarks/profile_overhead.py --pp 4 --microbatches 8 --schedule 1f1b
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks.bench_pipeline import SCHEDULE_VPP, _builder
from benchmarks.harness import RankStats, launch, timed_step
from benchmarks.workloads import Workload


def _worker(rank, world, device, args):
    schedule, m, steps, t_f, t_b, profile_rank = args
    w = Workload("sleep", t_f=t_f, t_b=t_b)
    vpp = SCHEDULE_VPP[schedule]
    runners = {}
    for impl in ("ours", "torch"):
        st = RankStats()
        runners[impl] = _builder(impl)(w, schedule, world, vpp, m, rank, device, st)
    x, y = w.batch(m)
    times = {"ours": [], "torch": []}
    for rnd in range(4):
        for impl in ("ours", "torch") if rnd % 2 == 0 else ("torch", "ours"):
            step, params = runners[impl]
            for i in range(steps + 2):
                t, _, _ = timed_step(lambda step=step: step(x, y), device)
                for p in params:
                    p.grad = None
                if i >= 2:
                    times[impl].append(t)
    out = {k: statistics.median(v) for k, v in times.items()}
    # engine record of one step: split per-action time into waiting and the rest
    step, params = runners["ours"]
    engine = step.engine
    res = engine.train_step((x, y))
    ev = res.record.events
    out["events"] = len(ev)
    out["action_ms_mean"] = 1e3 * statistics.mean(e.duration for e in ev)
    out["wait_ms_total"] = 1e3 * sum(e.comm_wait for e in ev)
    out["nonwait_ms_total"] = 1e3 * sum(e.duration - e.comm_wait for e in ev)
    out["record_ms"] = 1e3 * res.record.duration
    # beyond the nominal sleep: what an action costs on top of its layers' configured cost
    nominal = {"F": t_f / vpp, "B": t_b / vpp}
    out["extra_ms_mean"] = 1e3 * statistics.mean(
        e.duration - e.comm_wait - nominal[e.action.op.value] for e in ev
    )
    t0 = time.perf_counter()
    for _ in range(20):
        time.sleep(0.005)
    out["sleep_overshoot_ms"] = 1e3 * ((time.perf_counter() - t0) / 20 - 0.005)
    if rank == profile_rank:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            engine.train_step((x, y))
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        out["profile"] = s.getvalue()
    else:
        for _ in range(steps):
            engine.train_step((x, y))
    return out


def _pingpong(rank, world, device, n):
    """Median one-way latency of a 512-byte boundary tensor (rank 0 <-> 1), and the median time
    to post a send and a receive together, two ways: through ``batch_isend_irecv`` (what torch's
    pipelining and, on NCCL, lightning_pp use) and straight on the gloo process group (what
    lightning_pp's communicator does on gloo, ``P2PCommunicator._post_direct``)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    peer = 1 - rank if rank < 2 else None
    buf, other = torch.zeros(128, device=device), torch.zeros(128, device=device)

    def post(direct: bool, send: torch.Tensor, recv: torch.Tensor) -> list:
        if direct:
            return [group.send([send], peer, 0), group.recv([recv], peer, 0)]
        return dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        )

    out = {}
    for direct in (False, True, False, True):
        lat, posting = [], []
        for _ in range(n):
            dist.barrier()
            if peer is None:
                continue
            t0 = time.perf_counter()
            # one message each way, each rank's send and receive posted together
            works = post(direct, buf, other)
            t1 = time.perf_counter()
            for w in works:
                w.wait()
            lat.append((time.perf_counter() - t0) / 2)
            posting.append(t1 - t0)
        if peer is not None:
            key = "direct" if direct else "batch_isend_irecv"
            out.setdefault(key, []).append((statistics.median(lat), statistics.median(posting)))
    return {k: tuple(min(x[i] for x in v) for i in range(2)) for k, v in out.items()}


def device_overshoot(reps: int = 30) -> dict[str, float]:
    """Median time one sleep chunk takes beyond its nominal cost, in ONE process, no pipeline.

    Separates the virtual device's own imprecision (sleep wake-up on a loaded machine) from any
    pipeline runtime cost: whatever shows up here shows up in every action of every runtime.
    """
    from lightning_pp.models.virtual_device import SleepLayer

    out = {}
    for layers in (1, 2):
        chunk = torch.nn.Sequential(*[SleepLayer(32, 0.010, 0.020) for _ in range(layers)])
        fo, bo = [], []
        for _ in range(reps):
            x = torch.zeros(4, 32, requires_grad=True)
            t0 = time.perf_counter()
            y = chunk(x)
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            t2 = time.perf_counter()
            fo.append(t1 - t0 - layers * 0.010)
            bo.append(t2 - t1 - layers * 0.020)
        out[f"{layers}-layer F"] = statistics.median(fo)
        out[f"{layers}-layer B"] = statistics.median(bo)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-rank", type=int, default=0)
    ap.add_argument("--t-f", type=float, default=0.0, help="sleep per rank share, forward (s)")
    ap.add_argument("--t-b", type=float, default=0.0, help="sleep per rank share, backward (s)")
    ap.add_argument("--device-overshoot", action="store_true", help="only time a lone sleep chunk")
    ap.add_argument("--pingpong", action="store_true", help="only measure P2P latency (2 ranks)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.device_overshoot:
        load = os.getloadavg()[0]
        for k, v in device_overshoot().items():
            print(f"{k} (10 ms F / 20 ms B per layer): {v * 1e3:.3f} ms beyond nominal")
        print(f"load average at start: {load:.2f}")
        return
    if a.pingpong:
        res = launch(_pingpong, 2, 300, timeout=300)[0]
        for how, (lat, posting) in res.items():
            print(
                f"{how}: median one-way latency of a 512-byte tensor, rank 0 <-> 1: "
                f"{lat * 1e3:.3f} ms; posting a send and a receive: {posting * 1e6:.0f} us"
            )
        return
    res = launch(
        _worker,
        a.pp,
        (a.schedule, a.microbatches, a.steps, a.t_f, a.t_b, a.profile_rank),
        timeout=900,
    )
    r0 = res[0]
    print(
        f"layers t_f={a.t_f} t_b={a.t_b} s per rank, {a.schedule} p={a.pp} "
        f"m={a.microbatches}: median step "
        f"ours {r0['ours'] * 1e3:.2f} ms, torch {r0['torch'] * 1e3:.2f} ms "
        f"(ours/torch {r0['ours'] / r0['torch']:.3f})"
    )
    for k, r in enumerate(res):
        print(
            f"rank {k}: {r['events']} actions, mean {r['action_ms_mean']:.3f} ms/action; "
            f"waiting {r['wait_ms_total']:.2f} ms, not waiting {r['nonwait_ms_total']:.2f} ms, "
            f"step {r['record_ms']:.2f} ms; per action beyond nominal cost and waiting: "
            f"{r['extra_ms_mean']:.3f} ms; time.sleep overshoot {r['sleep_overshoot_ms']:.3f} ms"
        )
    print(res[a.profile_rank]["profile"])


if __name__ == "__main__":
    main()
