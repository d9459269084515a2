"""A Lightning user's own module under PipelineStrategy: logging, hooks, rebuilds, the summary.

One 2-process job (Lightning's launcher, tests/scripts/hooks_run.py) runs every scenario; the
tests read its per-rank JSON. Issue 13, items 1, 2, 3 and 14.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from jobs import run_job  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hooks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("hooks")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    cmd = [sys.executable, str(SCRIPTS / "hooks_run.py"), "--out", str(out)]
    result = run_job(cmd, env=env, cwd=ROOT, timeout=240)
    if result.timed_out:
        pytest.fail(result.describe(6000))
    data: dict = {"job": result}
    for path in sorted(out.glob("*.json")):
        data[path.stem] = json.loads(path.read_text())
    return data


def _ranks(hooks: dict, scenario: str) -> list[dict]:
    missing = [r for r in range(2) if f"{scenario}.rank{r}" not in hooks]
    assert not missing, f"{scenario}: no result from ranks {missing}\n{hooks['job'].describe()}"
    return [hooks[f"{scenario}.rank{r}"] for r in range(2)]


# ------------------------------------------------------------------ item 1: self.log in hooks
def test_values_logged_in_pipeline_eval_step_reach_every_rank(hooks):
    ranks = _ranks(hooks, "fit_validate")
    for when in ("after_fit", "validated"):
        for d in ranks:
            m = d[when]
            for name in ("val_plain", "val_synced", "val_batches", "val_acc_copy"):
                assert name in m, f"{when}: {name} missing on a rank: {sorted(m)}"
            assert m["val_plain"] == pytest.approx(2 * m["val_loss"], rel=1e-6)
            assert m["val_synced"] == pytest.approx(3 * m["val_loss"], rel=1e-6)
            # 2 batches, summed over data-parallel replicas (dp = 1), not over pipeline ranks
            assert m["val_batches"] == 2.0
            assert m["val_acc_copy"] == pytest.approx(m["val_acc"], rel=1e-6)
        assert ranks[0][when] == ranks[1][when]  # identical on every rank


def test_log_in_a_training_hook_of_one_stage_fails_clearly_on_every_rank(hooks):
    ranks = _ranks(hooks, "train_log")
    errors = [d["error"] for d in ranks]
    assert all(errors), errors
    # the last stage names the hook and the supported alternatives; rank 0 stops, naming it
    assert "self.log('train_ppl')" in errors[1] and "pipeline_loss" in errors[1], errors[1]
    assert "pipeline_log_train_loss" in errors[1] and "pipeline_eval_step" in errors[1]
    assert "rank 1" in errors[0], errors[0]


# ------------------------------------------------------------------ item 2: ignored overrides
def test_warns_once_about_step_overrides_the_strategy_does_not_call(hooks):
    ranks = _ranks(hooks, "fit_validate")
    assert [d["user_validation_steps"] for d in ranks] == [0, 0]
    notes = [w for w in ranks[0]["warnings"] if "validation_step" in w and "not call" in w]
    assert len(notes) == 1, ranks[0]["warnings"]
    assert "pipeline_eval_step" in notes[0] and "EvalLoggingGPT" in notes[0]
    assert "training_step" not in notes[0]  # PipelineMixin's own default, not the user's


# ------------------------------------------------------------------ item 3: configure_model again
def test_validate_after_fit_reports_the_trained_model(hooks):
    ranks = _ranks(hooks, "fit_validate")
    for d in ranks:
        assert d["validated"]["val_loss"] == pytest.approx(d["after_fit"]["val_loss"], rel=1e-6)
        assert d["validated"]["val_acc"] == pytest.approx(d["after_fit"]["val_acc"], rel=1e-6)
    notes = [w for w in ranks[0]["warnings"] if "configure_model" in w and "trained" in w]
    assert len(notes) == 1, ranks[0]["warnings"]
    assert "already built" in notes[0]


# ------------------------------------------------------------------ item 14: model summary
def test_model_summary_counts_the_whole_pipeline(hooks):
    rank0 = _ranks(hooks, "fit_validate")[0]
    summary = rank0["summary"]
    total = rank0["full_params"]
    assert f"{total:<10}Total params" in summary, summary
    assert "Stage" in summary, summary  # each row says which stage holds it
