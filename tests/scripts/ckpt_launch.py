"""Start one process per rank for tests/scripts/ckpt_run.py and reap them without hanging.

Not torchrun: when a rank dies on purpose (the crash-during-save test), the survivors are blocked
in a collective that only the process-group timeout would end; here the whole group is killed the
moment any rank exits non-zero, and on a wall-clock timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "ckpt_run.py"
if str(ROOT / "tests") not in sys.path:  # tests/jobs.py, also when imported from outside pytest
    sys.path.insert(0, str(ROOT / "tests"))

from jobs import free_port, kill_job, start_job  # noqa: E402


def launch(world: int, phases: list[dict], out: Path, timeout: float = 240.0) -> dict:
    """Run the phases on ``world`` ranks; return ``{"codes": [...], "output": str}``.

    Returns as soon as every rank exited, or right after the first failure (the others are
    killed: their code is reported as ``"killed"``), or on ``timeout`` (all killed).
    """
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    logs, procs = [], []
    for rank in range(world):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        log = open(out / f"launch.rank{rank}.log", "w+")
        logs.append(log)
        cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--phases", json.dumps(phases)]
        procs.append(start_job(cmd, cwd=ROOT, env=env, stdout=log))
    codes: list[int | str | None] = [None] * world
    deadline = time.monotonic() + timeout
    try:
        while any(c is None for c in codes):
            for r, p in enumerate(procs):
                if codes[r] is None and p.poll() is not None:
                    codes[r] = p.returncode
            if any(isinstance(c, int) and c != 0 for c in codes):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                kill_job(p.pid)
                p.wait()
                codes[r] = "killed" if codes[r] is None else codes[r]
    text = []
    for r, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- rank {r} (exit {codes[r]}) ---\n{log.read()[-4000:]}")
        log.close()
    return {"codes": codes, "output": "\n".join(text)}
