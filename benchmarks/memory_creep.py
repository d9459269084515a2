"""Resident memory over a long run of the demo: does it level off? (issue 35, item 6)

Runs ``lightning-pp fit configs/demo_cpu.yaml`` (the README's demo, pp=2 x dp=2, Lightning's
launcher, the summary callbacks ``fit`` adds) with a shrunk model so that 2,000 steps finish in
minutes on 2 cores, once per schedule, and reads each process's resident memory (``VmRSS`` of
``/proc/self/status``) after the steps named by ``--at``. Prints one table; exits 1 when the
growth between the last two points is ``--limit-mib`` or more on any process. Usage::

    python benchmarks/memory_creep.py                          # zbv, zb-h1, 1f1b; 2,000 steps
    python benchmarks/memory_creep.py --schedules zbv --steps 400 --at 100 200 400
    python benchmarks/memory_creep.py --tree /work/main        # another checkout's lightning_pp
    python benchmarks/memory_creep.py --no-summary --every 100 # without the summary callbacks
    python benchmarks/memory_creep.py --schedules zbv --set strategy.recompute=full  # overrides

Each run is a subprocess in a session of its own with a timeout that kills its whole process
tree. ``--tree`` runs another checkout's package (its ``lightning_pp`` first on ``PYTHONPATH``):
the probe callback is copied next to the run's config under a module name of its own, so it does
not depend on the other tree having this file. ``--every N`` also records every N steps, and the
garbage collector's view (objects tracked, collections per generation), for diagnosis.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo_cpu.yaml"
SCHEDULES = ("zbv", "zb-h1", "1f1b")

# The demo shrunk: the same model class, data, world and callbacks, so every code path of the
# demo runs, at a size where a step is tens of milliseconds. zbv needs vpp=2: 4 chunks of the
# 6 pipeline layers (embedding + 4 blocks + head).
SHRUNK = {
    "model.init_args.n_layer": 4,
    "model.init_args.n_head": 2,
    "model.init_args.n_embd": 32,
    "data.init_args.block_size": 32,
    "data.init_args.batch_size": 8,
    "data.init_args.max_chars": 400_000,
    "strategy.microbatches": 4,
    "trainer.val_check_interval": 500,
    "trainer.limit_val_batches": 2,
    "sample.enabled": False,
}


def rss_kib() -> int:
    """This process's resident set size in KiB (``VmRSS``; 0 where ``/proc`` has none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssProbe(Callback):
    """Records this process's ``VmRSS`` after the training steps in ``at`` (and every
    ``every`` steps when given) and writes them to ``{out}/rank{global_rank}.json`` at the end
    of training."""

    def __init__(self, out: str, at: list[int], every: int = 0, collect: bool = False) -> None:
        self.out = Path(out)
        self.at = set(at)
        self.every = every
        self.collect = collect
        self.found = 0  # unreachable objects gc.collect() found (``collect`` only)
        self.rows: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        step = trainer.global_step
        if self.collect:  # diagnosis: does collecting cycles every step stop the growth?
            self.found += gc.collect()
        if step in self.at or (self.every and step % self.every == 0):
            row: dict[str, Any] = {"step": step, "rss_kib": rss_kib()}
            row["seconds"] = round(time.perf_counter() - self._t0, 1)
            if self.collect:
                row["gc_found"] = self.found
            if self.every:
                row["gc_objects"] = len(gc.get_objects())
                row["gc_collections"] = [s["collections"] for s in gc.get_stats()]
            self.rows.append(row)
            self._write(trainer.global_rank)  # each time: a run cut short keeps its rows

    def on_train_end(self, trainer: Any, *args: Any) -> None:
        self._write(trainer.global_rank)

    def _write(self, rank: int) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"rank{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": rank, "rows": self.rows}))
        tmp.replace(path)


def _config(work: Path, schedule: str, args: argparse.Namespace) -> Path:
    """The demo's config with the probe added (JSON is YAML)."""
    import yaml

    cfg = yaml.safe_load(DEMO.read_text())
    cfg["callbacks"] = [
        {
            "class_path": "memory_creep_probe.RssProbe",
            "init_args": {
                "out": str(work / "rss"),
                "at": args.at,
                "every": args.every,
                "collect": args.gc_collect,
            },
        }
    ]
    cfg["trainer"]["default_root_dir"] = str(work / "run")
    cfg["logger"]["init_args"]["save_dir"] = str(work / "run")
    path = work / f"demo_{schedule}.yaml"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def run_schedule(schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    """One ``lightning-pp fit`` of the shrunk demo under ``schedule``: each rank's rows."""
    with tempfile.TemporaryDirectory(prefix=f"memcreep_{schedule}_") as tmp:
        work = Path(tmp)
        shutil.copy(__file__, work / "memory_creep_probe.py")
        config = _config(work, schedule, args)
        overrides = [f"{k}={v}" for k, v in SHRUNK.items()]
        overrides += [f"strategy.schedule={schedule}", f"trainer.max_steps={args.steps}"]
        overrides += args.set
        if schedule == "zbv":
            overrides.append("strategy.vpp=2")
        cmd = [sys.executable, "-m", "lightning_pp", "fit", str(config), *overrides]
        if args.no_summary:
            cmd.insert(4, "--no-summary")
        env = dict(os.environ)
        tree = str(Path(args.tree).resolve()) if args.tree else str(REPO)
        env["PYTHONPATH"] = os.pathsep.join([tree, str(work)])
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        cut = False
        try:
            out, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            cut = True
            print(f"{schedule}: killed after --timeout {args.timeout:g} s", file=sys.stderr)
        if proc.returncode != 0 and not cut:
            raise SystemExit(f"{schedule}: fit exited {proc.returncode}\n{out[-3000:]}")
        ranks = sorted((work / "rss").glob("rank*.json"))
        if not ranks:
            raise SystemExit(f"{schedule}: the probe wrote nothing\n{out[-3000:]}")
        rows = {}
        for path in ranks:
            data = json.loads(path.read_text())
            rows[data["rank"]] = data["rows"]
        seconds = time.perf_counter() - t0
        return {"schedule": schedule, "seconds": seconds, "cut": cut, "ranks": rows}


def table(results: list[dict[str, Any]], at: list[int]) -> tuple[str, float]:
    """The RSS table in MiB, and the largest growth between the last two points."""
    head = "| schedule | rank | " + " | ".join(f"RSS at {s}" for s in at)
    head += f" | growth {at[-2]} -> {at[-1]} | per 1,000 steps |"
    lines = [head, "|" + "---|" * (len(at) + 4)]
    worst = 0.0
    for res in results:
        for rank, rows in sorted(res["ranks"].items()):
            by_step = {r["step"]: r["rss_kib"] / 1024 for r in rows}
            got = [by_step.get(s) for s in at]
            cells = [f"{v:.1f}" if v is not None else "-" for v in got]
            a, b = got[-2], got[-1]
            grow = b - a if a is not None and b is not None else float("nan")
            per_k = grow / (at[-1] - at[-2]) * 1000
            worst = max(worst, grow) if grow == grow else float("inf")  # a missing point fails
            lines.append(
                f"| {res['schedule']} | {rank} | "
                + " | ".join(cells)
                + f" | {grow:+.1f} MiB | {per_k:+.1f} MiB |"
            )
    return "\n".join(lines), worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--at", type=int, nargs="+", default=[200, 1000, 2000])
    p.add_argument("--every", type=int, default=0, help="also record every N steps (diagnosis)")
    p.add_argument("--tree", help="a checkout whose lightning_pp to run (default: this one)")
    p.add_argument("--no-summary", action="store_true", help="fit --no-summary")
    p.add_argument(
        "--gc-collect", action="store_true", help="diagnosis: gc.collect() after every step"
    )
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="more overrides, e.g. strategy.zero=1",
    )
    p.add_argument("--limit-mib", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per schedule")
    p.add_argument("--json", help="write every rank's rows here")
    args = p.parse_args(argv)
    if len(args.at) < 2 or sorted(args.at) != args.at or args.at[-1] > args.steps:
        p.error(f"--at needs at least 2 increasing steps up to --steps {args.steps}, got {args.at}")
    results = []
    for schedule in args.schedules:
        res = run_schedule(schedule, args)
        last = max(r["step"] for rows in res["ranks"].values() for r in rows)
        print(f"{schedule}: {last} of {args.steps} steps in {res['seconds']:.0f} s", flush=True)
        results.append(res)
    text, worst = table(results, args.at)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ok = worst < args.limit_mib
    print(
        f"largest growth {args.at[-2]} -> {args.at[-1]}: {worst:+.1f} MiB "
        f"({'under' if ok else 'NOT under'} {args.limit_mib:g} MiB)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
