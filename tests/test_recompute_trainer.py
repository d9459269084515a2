"""Activation recompute under the real Trainer: losses equal a plain run with the same recompute.

One 2-process torchrun job (real gloo process groups, wall-clock timeout that kills the process
tree) trains the tied GPT of ``tests/scripts/pp_common.py`` for 10 steps under
``PipelineStrategy(pp=2, recompute=R)`` for every R in {"full", "auto" (a budget that forces
some recompute), "selective:fc*" (the MLP's two linears inside every block)} and every schedule
in {1f1b, interleaved (vpp=2), zb-h1}: nine runs in one process group. Each is compared with a
plain single-process Lightning run of the same module whose same layers (or modules inside
layers) run under ``torch.utils.checkpoint`` (non-reentrant): per-step **relative** error of the
logged training loss <= 1e-5, the tolerance ``tests/test_strategy.py`` uses for the runs without
recompute. For "auto" the layers come from the job's plan (they depend on measured forward
times), so its references run after the job.

The ``ActivationMemoryMonitor`` (every step) is checked too: the per-rank layer lists, the logged
keys, the one INFO log, and for "auto" the measured peak of saved bytes within 10 % of the plan's
prediction on every rank and step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))

from pp_common import MODEL_KW, STEPS, Data, Recorder, make_trainer  # noqa: E402
from worlds import script_main, world  # noqa: E402

from lightning_pp.models import GPT  # noqa: E402

REL_TOL = 1e-5
RATIO_TOL = 0.10
PP = 2
SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]
SPECS = {"full": "full", "auto": "auto", "selective": "selective:fc*"}
CONFIGS = [
    {"name": f"{sched}_{key}", "schedule": sched, "vpp": vpp, "recompute": spec}
    for sched, vpp in SCHEDULES
    for key, spec in SPECS.items()
]
NUM_LAYERS = MODEL_KW["n_layer"] + 2  # embedding, blocks, head
BLOCKS = range(1, MODEL_KW["n_layer"] + 1)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, list[dict]]:
    """Every configuration in one case of the shared Trainer world of PP ranks."""
    out = tmp_path_factory.mktemp("recompute_trainer")
    argv = ["--out", str(out), "--configs", json.dumps(CONFIGS)]
    world("trainer", PP).run(script_main, "recompute_run", argv, timeout=900)
    return {
        c["name"]: [json.loads((out / f"{c['name']}.rank{r}.json").read_text()) for r in range(PP)]
        for c in CONFIGS
    }


# -- the plain references -------------------------------------------------------------------


class CheckpointedGPT(GPT):
    """The same GPT; the modules named in ``wrap`` (relative to ``self.layers``: ``"3"`` a
    whole layer, ``"3.fc"`` a module inside one) run under non-reentrant checkpoint when
    gradients are on."""

    wrap: tuple[str, ...] = ()
    calls = 0

    def configure_model(self) -> None:
        fresh = self.layers is None
        super().configure_model()
        if fresh:
            for name in self.wrap:
                self._checkpoint(self.layers.get_submodule(name))

    def _checkpoint(self, module: torch.nn.Module) -> None:
        forward = module.forward

        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            CheckpointedGPT.calls += 1
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

        module.forward = run


_REFERENCES: dict[tuple[str, ...], list[float]] = {}


def reference_losses(wrap: tuple[str, ...], tmp: Path) -> list[float]:
    """10 training losses of a plain single-process run with ``wrap`` checkpointed (cached)."""
    if wrap not in _REFERENCES:
        torch.set_num_threads(1)
        model = CheckpointedGPT(**MODEL_KW)
        model.wrap = wrap
        before = CheckpointedGPT.calls
        rec = Recorder()
        trainer = make_trainer("auto", 1, 1, str(tmp / f"ref{len(_REFERENCES)}"), [rec])
        trainer.fit(model, Data(dp=1, accumulate=1))
        assert CheckpointedGPT.calls > before, f"nothing was checkpointed for {wrap}"
        _REFERENCES[wrap] = rec.train_loss
    return _REFERENCES[wrap]


def _names(layers: list) -> tuple[str, ...]:
    """The monitor's labels (``3``, ``"3.fc"``) as module names under ``GPT.layers``."""
    return tuple(sorted(str(x) for x in layers))


def _rank_layers(ranks: list[dict]) -> list[list]:
    """Per rank, what the monitor says it recomputed (the same on every step and every rank)."""
    out = []
    for d in ranks:
        steps = d["recompute_steps"]
        assert len(steps) == STEPS, f"rank {d['rank']}: {len(steps)} measured steps"
        for step in steps:
            assert [s["layers"] for s in step] == [s["layers"] for s in steps[-1]], steps
        out.append([s["layers"] for s in steps[-1]])
    assert out[0] == out[1], "every rank sees every rank's layers"
    return out[0]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_losses_match_plain_run_with_same_recompute(job, cfg, tmp_path_factory):
    ranks = job[cfg["name"]]
    per_rank = _rank_layers(ranks)
    wrapped = [x for layers in per_rank for x in layers]
    assert wrapped, f"{cfg['name']}: nothing recomputed"
    if cfg["recompute"] == "full":
        assert sorted(wrapped) == list(range(NUM_LAYERS))
    elif cfg["recompute"].startswith("selective"):
        assert sorted(wrapped) == sorted(f"{b}.{m}" for b in BLOCKS for m in ("fc", "fc_proj"))
    ref = reference_losses(_names(wrapped), tmp_path_factory.mktemp("ref"))
    for d in ranks:
        got = d["train_loss"]
        assert len(got) == len(ref) == STEPS
        errs = [abs(g - w) / abs(w) for g, w in zip(got, ref)]
        print(f"{cfg['name']} rank {d['rank']}: max relative error {max(errs):.2e}")
        assert max(errs) <= REL_TOL, f"rank {d['rank']}: per-step relative errors {errs}"
    assert ranks[1]["train_loss"] == ranks[0]["train_loss"]


@pytest.mark.parametrize("sched", [s for s, _ in SCHEDULES])
def test_auto_prediction_within_10_percent_on_every_rank(job, sched):
    ranks = job[f"{sched}_auto"]
    per_rank = _rank_layers(ranks)
    assert sum(len(x) for x in per_rank) > 0, "the budget forced no recompute"
    for d in ranks:
        # the monitor reports what the plan chose
        assert [x for c in d["plan_layers"] for x in c] == per_rank[d["rank"]]
        for i, step in enumerate(d["recompute_steps"]):
            for s in step:
                where = f"step {i} rank {s['rank']}: {s}"
                assert s["predicted_bytes"] is not None and s["saved_bytes"] > 0, where
                assert abs(s["ratio"] - 1) <= RATIO_TOL, where
                assert s["predicted_bytes"] <= d["budget"], where
    keys = set(ranks[0]["metric_keys"])
    for r in range(PP):
        want = {f"pp/rank{r}/{k}" for k in ("saved_bytes_predicted", "saved_bytes_ratio")}
        assert want | {f"pp/rank{r}/recompute_layers"} <= keys


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_monitor_logs_layers_once_and_numeric_keys(job, cfg):
    ranks = job[cfg["name"]]
    assert len(ranks[0]["recompute_log"]) == 1  # once per fit, global rank 0
    assert ranks[1]["recompute_log"] == []
    keys = set(ranks[0]["metric_keys"])
    assert {f"pp/rank{r}/recompute_layers" for r in range(PP)} <= keys
    if cfg["recompute"] != "auto":  # no plan, no prediction
        assert not any(k.endswith("saved_bytes_predicted") for k in keys)
