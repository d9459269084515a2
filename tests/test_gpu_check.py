"""benchmarks/gpu_check.py stays runnable: its dry run lists every step on a CPU machine."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_lists_every_step():
    sys.path.insert(0, ROOT)
    from benchmarks.gpu_check import IN_PROCESS, STEPS

    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "| step | verdict | s | figures / command |" in out
    for step in STEPS:
        assert f"| {step.name} | dry-run |" in out, out
        # every script a step runs exists (a renamed benchmark would otherwise rot unseen)
        for arg in step.argv:
            if arg.endswith((".py", ".sh")):
                assert os.path.exists(os.path.join(ROOT, arg)), arg
    assert {s.name for s in STEPS} >= set(IN_PROCESS)
    assert {s.gpus for s in STEPS} == {1, 2}
