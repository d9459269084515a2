"""What a checkpoint save costs a training step: ``async_checkpoint=True`` against synchronous.

A GPT (``lightning_pp.models.GPT``) with >= 200 MB of checkpoint state (fp32 parameters and
AdamW's two moments, counted from the tensors each stage holds) trains under the real Lightning
``Trainer`` with ``PipelineStrategy(pp=2)`` on 4 CPU processes (pp2 x dp2, gloo), saving every
``--every`` steps through ``ModelCheckpoint(every_n_train_steps=..., save_top_k=-1)``. Two kinds
of run, each a fresh launch (Lightning's launcher starts the 4 ranks): one with
``PipelineStrategy(async_checkpoint=True)``, one synchronous, alternating for ``--rounds``
rounds. A callback stamps every ``on_train_batch_start``; a step is the interval between two
stamps, so the save that ``ModelCheckpoint`` starts at a step's end (in ``on_train_batch_end``)
falls inside that step. Per interval the slowest rank counts. Steps are sorted into:

- **normal**: no save in the step and no write in flight (as seen on rank 0, whose writer
  publishes the checkpoint last);
- **save**: the step whose end starts a save (async: the copy; sync: the whole write);
- **overlap** (async): the steps during which the background write runs.

Each save step is divided by the median of the normal steps among the ``--every`` before it
(a shared host's speed drifts during a run); reported: the medians over every save of every
round. Target (issue 31): the step that starts an async save <= 1.2 x a normal step, beside the
synchronous save's stall (save step - normal step). "Lost per save" adds the overlap steps'
excess: what a save costs the run in all. Afterwards every checkpoint the async runs wrote is
checked: complete (``complete.json``), no hidden ``.partial`` left, and
``python -m lightning_pp consolidate DIR out.pt`` exits 0.

Usage::

    nice -n 19 python benchmarks/bench_async_save.py            # ~6 min on 2 cores
    python benchmarks/bench_async_save.py --smoke --out /tmp/a.json   # tiny model, ~1 min

Writes ``benchmarks/results/async_save.json`` (``--out``): the machine, the command, the
config, every rank's raw stamps and the summary; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # ``python benchmarks/bench_async_save.py`` from anywhere
    sys.path.insert(0, str(ROOT))

#: model sizes: GPT keyword arguments, per-replica microbatch size and count. "full": 6 blocks of
#: width 512 = 19.2 M parameters over the two stages -> 230 MB of fp32 state with AdamW's
#: moments; short sequences and 2 x 1-sample microbatches keep a step near a second on 2 cores.
SIZES: dict[str, dict[str, Any]] = {
    "full": {"model": {"n_layer": 6, "n_head": 8, "n_embd": 512, "block_size": 64}, "mb": 1},
    "smoke": {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}, "mb": 1},
}
PP, WORLD, MICROBATCHES, VOCAB = 2, 4, 2, 256


# --------------------------------------------------------------------------------------------
# Inside the launched Trainer (every rank runs this; Lightning's launcher re-runs the script)
# --------------------------------------------------------------------------------------------


def _state_bytes(module: Any, optimizers: list[Any]) -> int:
    """Bytes of every tensor this rank would checkpoint: the module's state_dict and the
    optimizers' state (AdamW: exp_avg, exp_avg_sq, step), each storage counted once."""
    import torch

    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for t in module.state_dict().values():
        add(t)
    for opt in optimizers:
        for per_param in opt.state.values():
            for t in per_param.values():
                add(t)
    return sum(seen.values())


def _worker(a: argparse.Namespace) -> None:
    """One rank: train ``a.steps`` steps, saving every ``a.every``; write this rank's stamps."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineStrategy
    from lightning_pp.checkpoint import dcp_save
    from lightning_pp.models import GPT

    torch.set_num_threads(1)  # 4 ranks share 2 cores
    size = SIZES[a.size]
    rec: dict[str, Any] = {"starts": [], "saves": [], "strategy_saves": [], "staging": []}
    rec["writes"] = []

    # Instrument the background write without touching the library: wrap the function that
    # dcp_save calls to start it, timing the staging (its return) and the end of the write
    # (``finish`` runs in the writer thread once this rank's DCP save returned; on rank 0 it
    # then publishes, so rank 0's stamp is the checkpoint's completion).
    real_start = dcp_save.start_async_save

    def timed_start(state: Any, directory: Any, group: Any, *, finish: Any) -> Any:
        t0 = time.perf_counter()

        def done() -> None:
            written = time.perf_counter()
            if finish is not None:
                finish()
            rec["writes"].append([t0, written, time.perf_counter()])

        pending = real_start(state, directory, group, finish=done)
        rec["staging"].append([t0, time.perf_counter()])
        return pending

    dcp_save.start_async_save = timed_start

    class StepClock(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            rec["starts"].append(time.perf_counter())

        def on_train_end(self, trainer: Any, *args: Any) -> None:
            rec["starts"].append(time.perf_counter())

    model = GPT(vocab_size=VOCAB, **size["model"], max_steps=a.steps, warmup_steps=2, seed=0)
    strategy = PipelineStrategy(
        pp=PP, microbatches=MICROBATCHES, async_checkpoint=a.mode == "async"
    )
    ckpt = ModelCheckpoint(
        dirpath=a.ckpt_dir, filename="{step}", every_n_train_steps=a.every, save_top_k=-1
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=a.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # every replica reads the same batches: timing only
        callbacks=[StepClock(), ckpt],
    )

    def timed(fn: Any, sink: list, first: Any = None) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            if first is not None and not sink:
                first()
            out = fn(*args, **kwargs)
            sink.append([t0, time.perf_counter(), trainer.global_step])
            return out

        return call

    def count_state() -> None:  # at the first save: the Adam moments exist by then
        rec["state_bytes"] = _state_bytes(trainer.lightning_module, trainer.optimizers)

    trainer.save_checkpoint = timed(trainer.save_checkpoint, rec["saves"], count_state)
    strategy.save_checkpoint = timed(strategy.save_checkpoint, rec["strategy_saves"])
    g = torch.Generator().manual_seed(0)
    batch = size["mb"] * MICROBATCHES
    block = size["model"]["block_size"]
    tokens = torch.randint(0, VOCAB, (a.steps * batch, block + 1), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    trainer.fit(model, DataLoader(data, batch_size=batch, shuffle=False))
    topo = strategy.topology
    rec.update(rank=trainer.global_rank, pp_rank=topo.pp_rank, dp_rank=topo.dp_rank)
    Path(a.run_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(rec))


# --------------------------------------------------------------------------------------------
# The driver: launch, classify, verify
# --------------------------------------------------------------------------------------------


def launch(mode: str, a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """One Trainer run (4 ranks) in a session of its own, killed whole at ``--timeout``;
    returns every rank's record, by rank."""
    run_dir, ckpt_dir = work / f"{mode}-run", work / f"{mode}-ckpts"
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode]
    cmd += ["--size", a.size, "--steps", str(a.steps), "--every", str(a.every)]
    cmd += ["--run-dir", str(run_dir), "--ckpt-dir", str(ckpt_dir)]
    # A port of its own per run: an inherited MASTER_PORT (an earlier in-process Trainer sets
    # one in os.environ) would have both runs reuse it, and the first run's store process may
    # still hold it when the second starts (EADDRINUSE in a loaded CI run).
    from lightning_pp.planner.verify import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MASTER_PORT=str(free_port()))
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=work,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log, _ = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        log = f"killed after --timeout {a.timeout:g} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's children, whatever happened
        except ProcessLookupError:
            pass
    ranks = sorted(run_dir.glob("rank*.json"))
    if proc.returncode != 0 or len(ranks) != WORLD:
        raise RuntimeError(f"the {mode} run failed (exit {proc.returncode}):\n{log[-4000:]}")
    return sorted((json.loads(p.read_text()) for p in ranks), key=lambda r: r["rank"])


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def classify(ranks: list[dict[str, Any]], warmup: int, every: int) -> dict[str, Any]:
    """One run: each step after ``warmup`` as normal / save / overlap, and one record per save.

    A step's time is the slowest rank's (the ranks of a pipeline wait for each other); which
    steps hold a save or overlap a write is read from rank 0's stamps (its writer publishes
    the checkpoint last). Each save is compared with the normal steps among the ``every``
    before it (``local_normal_s``), so a drift of the machine's speed during the run (other
    jobs on a shared host) does not enter the ratio.
    """
    r0 = ranks[0]
    starts = r0["starts"]
    n = min(len(r["starts"]) for r in ranks) - 1
    steps = [max(r["starts"][i + 1] - r["starts"][i] for r in ranks) for i in range(n)]
    save_at = [s[0] for s in r0["saves"]]
    writes = [(w[0], w[2]) for w in r0["writes"]]  # in flight: save start -> published
    kinds = ["warmup"] * n
    for i in range(warmup, n):
        lo, hi = starts[i], starts[i + 1]
        if any(lo <= t < hi for t in save_at):
            kinds[i] = "save"
        elif any(w0 < hi and lo < w1 for w0, w1 in writes):
            kinds[i] = "overlap"
        else:
            kinds[i] = "normal"
    run_normal = _median([t for t, k in zip(steps, kinds) if k == "normal"])
    saves = []
    for k, t in enumerate(save_at):
        i = next((j for j in range(n) if starts[j] <= t < starts[j + 1]), None)
        if i is None or kinds[i] != "save":
            continue  # a save inside the warmup, or after the last stamped step
        near = [steps[j] for j in range(max(0, i - every), i) if kinds[j] == "normal"]
        local = _median(near) or run_normal
        after = []
        for j in range(i + 1, n):
            if kinds[j] != "overlap":
                break
            after.append(steps[j])
        rec = {
            "step": r0["saves"][k][2],
            "save_step_s": steps[i],
            "local_normal_s": local,
            "call_s": max(r["saves"][k][1] - r["saves"][k][0] for r in ranks),
            "overlap_s": after,
        }
        if k < len(r0["staging"]):  # async: the copy, and the write until published
            rec["staging_s"] = max(r["staging"][k][1] - r["staging"][k][0] for r in ranks)
            rec["write_s"] = r0["writes"][k][2] - r0["writes"][k][0]
        if local:
            rec["ratio"] = steps[i] / local
            # what the save costs the run: its own step's excess and that of the steps the
            # write slows down, over the normal step
            rec["lost_s"] = steps[i] - local + sum(x - local for x in after)
        saves.append(rec)
    return {"steps_s": steps, "kinds": kinds, "saves": saves}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every run of one mode (ms; ``ratio``: the median of the per-save ratios)."""
    saves = [s for r in runs for s in r["saves"]]

    def of(kind: str) -> list[float]:
        return [t for r in runs for t, k in zip(r["steps_s"], r["kinds"]) if k == kind]

    def each(key: str) -> list[float]:
        return [s[key] for s in saves if key in s]

    ratio = _median(each("ratio"))
    # a run's first save also makes the writer's process group and allocates the staging
    # buffers (a one-time cost): the later saves show the steady state
    later = _median([s["ratio"] for r in runs for s in r["saves"][1:] if "ratio" in s])
    return {
        "saves": len(saves),
        "ratio_after_first": None if later is None else round(later, 3),
        "normal_ms": _ms(_median(of("normal"))),
        "save_ms": _ms(_median(each("save_step_s"))),
        "ratio": None if ratio is None else round(ratio, 3),
        "stall_ms": _ms(_median([s["save_step_s"] - s["local_normal_s"] for s in saves])),
        "overlap_ms": _ms(_median(of("overlap"))),
        "overlap_steps": len(of("overlap")),
        "lost_ms": _ms(_median(each("lost_s"))),
        "call_ms": _ms(_median(each("call_s"))),
        "staging_ms": _ms(_median(each("staging_s"))),
        "write_ms": _ms(_median(each("write_s"))),
    }


def verify(ckpt_dir: Path, work: Path, timeout: float) -> dict[str, Any]:
    """Every checkpoint directory: its marker present, nothing hidden left beside it, and
    ``lightning-pp consolidate DIR out.pt`` exits 0. Returns names, data bytes, exit codes."""
    dirs = sorted(p for p in ckpt_dir.iterdir() if not p.name.startswith("."))
    hidden = sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("."))
    out: dict[str, Any] = {"hidden": hidden, "checkpoints": []}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cli = [sys.executable, "-m", "lightning_pp"]
    for d in dirs:
        target = work / "consolidated.pt"
        proc = subprocess.run(
            [*cli, "consolidate", str(d), str(target)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        data = sum(f.stat().st_size for f in d.glob("*.distcp"))
        out["checkpoints"].append(
            {
                "name": d.name,
                "complete": (d / "complete.json").is_file(),
                "data_bytes": data,
                "consolidate_rc": proc.returncode,
                "consolidate_err": proc.stderr[-500:] if proc.returncode else "",
            }
        )
        target.unlink(missing_ok=True)
    return out


def state_mb(ranks: list[dict[str, Any]]) -> float:
    """Checkpoint state summed over the stages (one replica each: dp rank 0), in MB (1e6)."""
    return round(sum(r["state_bytes"] for r in ranks if r["dp_rank"] == 0) / 1e6, 1)


def to_markdown(result: dict[str, Any]) -> str:
    """The summary table of a result (as written to the JSON)."""
    a, s = result["summary"]["async"], result["summary"]["sync"]
    m, cfg = result["machine"], result["config"]
    ok = a["ratio"] is not None and a["ratio"] <= 1.2

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x} ms"

    lines = [
        f"GPT {cfg['model']}, {result['state_mb']} MB of checkpoint state (parameters + AdamW "
        f"moments, fp32, summed over the 2 stages), pp2 x dp2 on 4 CPU processes (gloo), "
        f"{cfg['steps']} steps, a save every {cfg['every']}, {cfg['rounds']} round(s) of each "
        f"mode; {m['nproc']} x {m['cpu']}, torch {m['torch']}, lightning {m['lightning']}, "
        f"load {m['loadavg']}.",
        f"Command: `{result['command']}`",
        "",
        "| saves | normal step | save step | save / normal | stall | steps overlapping the "
        "write | lost per save | save call | staging | write |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("async", a), ("sync", s)):
        ov = f"{ms(r['overlap_ms'])} (n={r['overlap_steps']})" if r["overlap_steps"] else "-"
        cells = [f"{name} ({r['saves']})", ms(r["normal_ms"]), ms(r["save_ms"]), r["ratio"]]
        cells += [ms(r["stall_ms"]), ov, ms(r["lost_ms"]), ms(r["call_ms"])]
        cells += [ms(r["staging_ms"]), ms(r["write_ms"])]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += [
        "",
        f"Target: the step that starts an async save <= 1.2 x a normal step: {a['ratio']} -> "
        f"**{'PASS' if ok else 'MISS'}** ({a['ratio_after_first']} over the saves after each "
        f"run's first; synchronous stall: {s['stall_ms']} ms). "
        f"Checkpoints verified: {result['verify']['summary']}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps (CI)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (28)")
    ap.add_argument("--every", type=int, default=None, help="save every N steps (5)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out (2)")
    ap.add_argument("--rounds", type=int, default=None, help="runs of each mode, alternating (2)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_save.json"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--keep", default=None, help="keep the runs' files under this directory")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["async", "sync"], help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return None
    a.size = a.size or ("smoke" if a.smoke else "full")
    a.steps = a.steps or (7 if a.smoke else 28)
    a.every = a.every or (3 if a.smoke else 5)
    a.rounds = a.rounds or (1 if a.smoke else 2)
    warmup = a.warmup if a.warmup is not None else (1 if a.smoke else 2)
    from benchmarks.harness import machine_info

    command = " ".join(["python", "benchmarks/bench_async_save.py", *(argv or sys.argv[1:])])
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="bench_async_save_"))
    work.mkdir(parents=True, exist_ok=True)
    # alternate the modes (async, sync, sync, async, ...) so a drift of the machine's speed
    # hits both alike
    order = [m for r in range(a.rounds) for m in (("async", "sync"), ("sync", "async"))[r % 2]]
    runs: list[dict[str, Any]] = []
    checked: dict[str, Any] = {"hidden": [], "checkpoints": []}
    try:
        for k, mode in enumerate(order):
            ranks = launch(mode, a, work / f"run{k}")
            runs.append({"mode": mode, **classify(ranks, warmup, a.every), "ranks": ranks})
            if mode == "async":  # every checkpoint the background writer published
                got = verify(work / f"run{k}" / f"{mode}-ckpts", work, a.timeout)
                checked["hidden"] += got["hidden"]
                checked["checkpoints"] += got["checkpoints"]
            if not a.keep:  # 230 MB a checkpoint: free the disk as the runs go
                shutil.rmtree(work / f"run{k}" / f"{mode}-ckpts", ignore_errors=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = not checked["hidden"] and all(
        c["complete"] and c["consolidate_rc"] == 0 for c in checked["checkpoints"]
    )
    checked["summary"] = (
        f"{len(checked['checkpoints'])} async checkpoints, "
        f"{'all complete and consolidated (exit 0)' if ok else 'NOT all complete/consolidated'}"
    )
    config = {"size": a.size, "model": SIZES[a.size]["model"], "pp": PP, "world": WORLD}
    config |= {"microbatches": MICROBATCHES, "microbatch_size": SIZES[a.size]["mb"]}
    config |= {"steps": a.steps, "every": a.every, "warmup": warmup, "rounds": a.rounds}
    result = {
        "machine": machine_info(),
        "command": command,
        "config": config,
        "state_mb": state_mb(next(r["ranks"] for r in runs if r["mode"] == "async")),
        "summary": {m: summarize([r for r in runs if r["mode"] == m]) for m in ("async", "sync")},
        "verify": checked,
        "runs": runs,
    }
    md = to_markdown(result)
    result["markdown"] = md
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(md)
    if not ok:
        raise SystemExit(f"checkpoint verification failed: {json.dumps(checked, indent=1)}")
    return result


if __name__ == "__main__":
    main()
