"""The equivalence grid under NCCL's rules, emulated on gloo
(``lightning_pp.runtime.nccl_emulation``).

One spawned world of 4 ranks runs every case with ``LIGHTNING_PP_EMULATE_NCCL=1``: matching by
posting order (one tag), one coalesced work per batch, one stream per rank, NCCL's engine
defaults (``recv_lookahead=1``, polled waits). pp=2 cases run as two pipelines (dp=2). Each case
gets a fresh pp group and abort namespace, so a failing case cannot poison the next one, and a
short watchdog turns a deadlock into a report instead of a hung test.

The emulation's own tests show it catches what it is meant to catch, each also run on plain
gloo where it passes: a pp=2 exchange whose two sides post ACT and GRAD in opposite orders, and
the circular header wait (two neighbours each wait for a header whose batch also holds a data
send to the other, and post their data receive only once the header arrived).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from engine_grid import case, case_problem, run_case
from worlds import World

from lightning_pp.layout.topology import PipelineTopology, ProcessGroups
from lightning_pp.runtime.failure import FailureMonitor
from lightning_pp.runtime.nccl_emulation import ENV_VAR
from lightning_pp.runtime.p2p import P2PCommunicator
from lightning_pp.runtime.p2p_wire import ACT, GRAD, Message, RecvRequest

WORLD = 4
STEPS = 3
WATCHDOG = 10.0  # a case that deadlocks is reported after this long (passing cases take < 1 s)


def _case(schedule, pp, vpp, m, **kw):
    return case(schedule, pp, m, vpp=vpp, steps=STEPS, **kw)


GRID = [
    _case(name, pp, vpp, m, static=static)
    for static in (False, True)
    for name, pp, vpp, m in [
        ("gpipe", 2, 1, 4),
        ("gpipe", 2, 2, 4),
        ("1f1b", 2, 1, 4),
        ("1f1b", 2, 1, 5),
        ("interleaved", 2, 2, 4),
        ("gpipe", 4, 1, 4),
        ("gpipe", 4, 2, 4),
        ("1f1b", 4, 1, 6),
        ("1f1b", 4, 1, 2),
        ("interleaved", 4, 2, 4),
        ("interleaved", 4, 2, 8),
        ("gpipe-v", 2, 2, 3),
        ("gpipe-v", 4, 2, 4),
    ]
]
GRID += [
    # uneven microbatches (10 rows over 4 / 3: the last microbatch is smaller)
    _case("1f1b", 4, 1, 4, batch=9),
    _case("interleaved", 2, 2, 3, group=3),
    _case("interleaved", 4, 2, 6, group=6, batch=11),
    _case("interleaved", 2, 2, 5, group=5),
    # tuple activations (hidden + int64 mask), sequence length changing every step
    _case("1f1b", 4, 1, 4, model="tuple", batch=8),
    _case("interleaved", 2, 2, 4, model="tuple", batch=8),
    _case("interleaved", 4, 2, 8, model="tuple", batch=8),
    _case("gpipe", 4, 2, 4, model="tuple", batch=8),
    _case("gpipe-v", 2, 2, 3, model="tuple", batch=8),
    # zero-bubble schedules (split backward: I and W; zbv on the V placement), m < 2p for zbv
    _case("zb-h1", 2, 1, 3),
    _case("zb-h1", 4, 1, 6),
    _case("zbv", 2, 2, 3),
    _case("zbv", 4, 2, 8, static=True),
    _case("zb-h1", 4, 1, 4, model="tuple", batch=8),
    _case("zbv", 4, 2, 5, model="tuple", batch=8),
]


def _fresh(topo: PipelineTopology, name: str, watchdog: float):
    """A fresh pp group (one per pipeline, same creation order everywhere) and abort namespace,
    and the monitor NCCL gets (it polls ``is_completed()``)."""
    pp_group = None
    for d in range(topo.dp):
        ranks = [p * topo.dp + d for p in range(topo.pp)]
        g = dist.new_group(ranks=ranks)
        if topo.rank in ranks:
            pp_group = g
    groups = ProcessGroups(topology=topo, pp_group=pp_group, dp_group=None)
    # one namespace per pipeline: the two pp=2 pipelines of the world fail independently
    store = dist.PrefixStore(f"{name}-dp{topo.dp_rank}", dist.distributed_c10d._get_default_store())
    monitor = FailureMonitor(
        store,
        topo.rank,
        watchdog_timeout=watchdog,
        poll_interval=0.05,
        poll_works=True,
        pipeline_ranks=topo.pipeline_ranks,
    )
    return groups, monitor


def _run_case(rank, c, index):
    """Train ``c`` on this rank and the reference (:func:`engine_grid.run_case`) on a fresh pp
    group and abort namespace; ``c["device"]`` (default cpu) is where the model and data live
    (benchmarks/gpu_check.py runs this on CUDA/NCCL)."""
    topo = PipelineTopology.from_world(dist.get_world_size(), rank, c["pp"])
    groups, monitor = _fresh(topo, f"nccl-case{index}", c.get("watchdog", WATCHDOG))
    device = torch.device(c.get("device", "cpu"))
    return run_case(rank, c, groups, monitor=monitor, device=device)


# ---- what the emulation must catch (communicator level, pp=2: rank 0 holds stages 0 and 2) ----
FAULT_WATCHDOG = 2.0


def _exchange_case(rank, index, kind, emulate):
    """One of the two bugs, on a fresh pp=2 group; returns what each rank saw."""
    topo = PipelineTopology.from_world(WORLD, rank, 2)
    groups, monitor = _fresh(topo, f"nccl-fault{index}", FAULT_WATCHDOG)
    if not emulate:
        monitor.poll_works = False  # gloo's own setting (helper-thread waits)
    static = kind == "misordered-same-size"
    comm = P2PCommunicator(
        topo, groups.pp_group, static_shapes=static, monitor=monitor, emulate_nccl=emulate
    )
    peer = topo.pipeline_ranks[1 - topo.pp_rank]
    first = topo.pp_rank == 0
    x = torch.arange(32, dtype=torch.float32).reshape(4, 8) + 100 * topo.pp_rank
    g = -torch.arange(32, dtype=torch.float32).reshape(4, 8)
    spec = [((4, 8), torch.float32)]
    got = {}
    try:
        if kind.startswith("misordered"):
            # rank 0: the activation for stage 1 (from stage 0) and the gradient for stage 1
            # (from stage 2's backward), in this order; rank 1 posts the receives the other way
            # round. gloo matches by tag (channel); NCCL by position.
            if static:  # agree the activation's shape first (the header goes once)
                if first:
                    sent, _ = comm.exchange([Message(ACT, peer, 1, 0, (x,), False)], [])
                    sent.wait()
                else:
                    _, (p,) = comm.exchange([], [RecvRequest(ACT, peer, 1, 0)])
                    comm.receive(p)
            if first:
                msgs = [Message(ACT, peer, 1, 0, (x,), False), Message(GRAD, peer, 1, 0, (g,))]
                sent, _ = comm.exchange(msgs, [])
                sent.wait()
            else:
                reqs = [RecvRequest(GRAD, peer, 1, 0, spec), RecvRequest(ACT, peer, 1, 0)]
                _, (pg, pa) = comm.exchange([], reqs)
                got["grad"] = comm.receive(pg)[0].equal(g)
                got["act"] = comm.receive(pa)[0].equal(x - 100 * topo.pp_rank)
        elif kind == "circular-header":
            # each sends an activation (header + data) to the other and, in the same batch,
            # receives the header of the other's; the data receive goes out once it arrived
            stage_out, stage_in = (1, 2) if first else (2, 1)
            msg = Message(ACT, peer, stage_out, 0, (x,), False)
            sent, (p,) = comm.exchange([msg], [RecvRequest(ACT, peer, stage_in, 0)])
            got["act"] = comm.receive(p)[0].equal(x + (100 if first else -100))
            sent.wait()
        elif kind == "ordered-header":
            # the same two messages posted in the global order (rank 0's first): the protocol
            # the engine uses under NCCL
            stage_out, stage_in = (1, 2) if first else (2, 1)
            msg = Message(ACT, peer, stage_out, 0, (x,), False)
            req = RecvRequest(ACT, peer, stage_in, 0)
            steps = [([msg], []), ([], [req])] if first else [([], [req]), ([msg], [])]
            sends = []
            for out_msgs, reqs in steps:
                sent, pendings = comm.exchange_ordered(out_msgs, reqs)
                sends.append(sent)
                for p in pendings:
                    got["act"] = comm.receive(p)[0].equal(x + (100 if first else -100))
            for sent in sends:
                sent.wait()
    except Exception as e:
        monitor.report_failure(kind, e)
        return {"error": f"{type(e).__name__}: {e}"}
    return {"ok": True, **got}


FAULTS = [
    (kind, emulate)
    for kind in ("misordered", "misordered-same-size", "circular-header", "ordered-header")
    for emulate in (False, True)
]


def _grid_worker(rank, world_size, cases):
    os.environ[ENV_VAR] = "1"
    out = {}
    t0 = time.perf_counter()
    for index, c in enumerate(cases):
        t = time.perf_counter()
        try:
            out[c["id"]] = _run_case(rank, c, index)
        except Exception as e:
            out[c["id"]] = {"error": f"{type(e).__name__}: {e}"}
        out[c["id"]]["seconds"] = time.perf_counter() - t
    out["seconds"] = time.perf_counter() - t0
    for index, (kind, emulate) in enumerate(FAULTS):
        t = time.perf_counter()
        r = _exchange_case(rank, index, kind, emulate)
        r["seconds"] = time.perf_counter() - t
        out[(kind, emulate)] = r
    return out


@pytest.fixture(scope="module")
def grid():
    """A world of its own (its fault cases leave broken groups and stuck waits behind)."""
    t0 = time.perf_counter()
    own = World("gloo", WORLD)
    try:
        results = own.run(_grid_worker, GRID, timeout=400)
    finally:
        own.close()
    print(f"\nNCCL-emulated grid, {len(GRID)} cases in one world: {time.perf_counter() - t0:.1f}s")
    return results


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("case", GRID, ids=[c["id"] for c in GRID])
def test_grid_matches_unpipelined_under_nccl_rules(grid, case):
    for rank, res in enumerate(grid):
        r = res[case["id"]]
        assert case_problem(r) is None, f"rank {rank}: {case_problem(r)}"
        assert r["emulating"] and r["lookahead"] == 1
        assert r["batches"] > 0  # the traffic really went through the emulated stream


def _fault(grid, kind, emulate):
    return [grid[r][(kind, emulate)] for r in range(WORLD)]


@pytest.mark.parametrize("kind", ["misordered", "misordered-same-size"])
def test_misordered_pair_passes_on_gloo_and_fails_under_emulation(grid, kind):
    for r in _fault(grid, kind, False):
        assert r.get("ok"), r
        assert r.get("grad", True) and r.get("act", True), r  # right tensors by tag on gloo
    results = _fault(grid, kind, True)
    receivers = [r for rank, r in enumerate(results) if rank >= 2]  # pp_rank 1
    for r in receivers:
        text = r["error"]
        assert "NcclOrderError" in text, text
        assert "receive #" in text and "expects the gradient for stage 1" in text
        what = "activation" if kind == "misordered-same-size" else "activation header"
        assert f"is the {what} for stage 1" in text, text
        assert ("silently" in text) == (kind == "misordered-same-size"), text
    for r in results[:2]:  # the senders stop (abort channel) or are named by the watchdog
        assert "PipelineAborted" in r["error"] or "watchdog" in r["error"], r
        assert r["seconds"] < FAULT_WATCHDOG + 5


def test_circular_header_wait_passes_on_gloo_and_hangs_under_emulation(grid):
    for r in _fault(grid, "circular-header", False):
        assert r == {"ok": True, "act": True, "seconds": r["seconds"]}
    results = _fault(grid, "circular-header", True)
    hung = [r["error"] for r in results if "watchdog: blocked" in r["error"]]
    assert hung, results
    assert any("waiting for the shape header of the activation of mb=0" in t for t in hung), hung
    for r in results:
        assert "PipelineHang" in r["error"] or "PipelineAborted" in r["error"], r
        assert r["seconds"] < FAULT_WATCHDOG + 5


@pytest.mark.parametrize("emulate", [False, True])
def test_ordered_posting_exchanges_headers_safely(grid, emulate):
    for r in _fault(grid, "ordered-header", emulate):
        assert r.get("ok") and r["act"], r
