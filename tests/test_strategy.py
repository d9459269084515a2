"""PipelineStrategy under the real Trainer and real gloo process groups, every schedule.

The tied-embedding GPT trains 10 steps under each configuration, with gradient clipping,
validation, checkpointing, accumulation, DP x PP and bf16-mixed; losses and metrics must be
within 1e-5 of a plain Trainer's. The expensive parts run once per module: two single-process
reference runs (plain Trainer) in this process; one case of the shared 4-rank Trainer world
(:mod:`worlds`: torchrun-like workers, no launcher) that trains the eight 4-process
configurations in sequence, and one of the 2-rank world for bf16-mixed; one 2-process job
started by Lightning's own launcher (``Trainer(devices=2)``, the launcher's test; it runs in the
background while the in-process tests run, tests/background.py). Each rank
writes a JSON file; the tests compare them. Two torchrun "nodes" on loopback are tested where a
user starts them, with ``examples/torchrun_two_nodes.sh`` (``test_cli_fit.py``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))

import background  # noqa: E402
from jobs import free_port, run_job  # noqa: E402
from pp_common import MODEL_KW, load_runs, reference_runs  # noqa: E402
from worlds import World, script_main, world  # noqa: E402

REL_TOL = 1e-5

# world 4: pp x dp in {4x1, 2x2}, vpp in {1, 2}, accumulate_grad_batches in {1, 2}, every
# schedule (gpipe's order is 1f1b's without the interleaving: covered at engine level)
FOUR = [
    {"name": "pp4", "pp": 4, "microbatches": 4, "accumulate": 1},
    {"name": "pp4_vpp2_acc2", "pp": 4, "vpp": 2, "microbatches": 4, "accumulate": 2},
    {"name": "pp2_vpp2_dp2", "pp": 2, "vpp": 2, "microbatches": 2, "accumulate": 1},
    # tiny buckets: each chunk's gradients go out in several all-reduces
    {"name": "pp2_dp2_acc2", "pp": 2, "microbatches": 4, "accumulate": 2, "bucket_cap_mb": 0.01},
    {"name": "zbh1_pp4", "pp": 4, "microbatches": 4, "accumulate": 1, "schedule": "zb-h1"},
    # zbv with vpp unset: the schedule's own 2 chunks per rank (8 stages of one layer)
    {"name": "zbv_pp4", "pp": 4, "microbatches": 8, "accumulate": 1, "schedule": "zbv"},
    {"name": "zbv_pp2_dp2_acc2", "pp": 2, "microbatches": 4, "accumulate": 2, "schedule": "zbv"},
    {"name": "zbh1_pp2_dp2", "pp": 2, "microbatches": 2, "accumulate": 1, "schedule": "zb-h1"},
    # zb-auto: rebuilt from the second step's measured costs, V placement, tied weight on rank 0
    {"name": "zbauto_pp2_dp2", "pp": 2, "microbatches": 4, "accumulate": 1, "schedule": "zb-auto"},
]
# Lightning's own launcher (python script.py with Trainer(devices=2)): one configuration
LAUNCHER = [{"name": "pp2", "pp": 2, "microbatches": 4, "accumulate": 1}]
# precision, in the 2-rank world
TWO = [
    {"name": "pp2_bf16", "pp": 2, "microbatches": 2, "accumulate": 1, "precision": "bf16-mixed"},
    {
        "name": "zbv_pp2_bf16",
        "pp": 2,
        "microbatches": 4,
        "accumulate": 1,
        "schedule": "zbv",
        "precision": "bf16-mixed",
    },
]


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> str:
    """Run ``cmd`` in its own session; on timeout kill the whole process group."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    # kill_leftovers (default): stragglers, e.g. a rank left behind by a failed peer
    result = run_job(cmd, env=full_env, cwd=ROOT, timeout=timeout)
    if result.timed_out or result.returncode != 0:
        pytest.fail(result.describe(6000))
    return result.output


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, dict]:
    return reference_runs(str(tmp_path_factory.mktemp("ref")))


# The four-rank world runs ten configurations in one case (33 s alone, over 300 s in a loaded
# CI run): its own case timeout (800 s) bounds it; pytest-timeout's 300 s default cut it short
# while the background jobs shared the CPU, and its ranks went on training during later tests.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def four_proc(tmp_path_factory) -> dict[str, list[dict]]:
    """Four ranks of a shared Trainer world (each a torchrun-like worker, no launcher)."""
    out = tmp_path_factory.mktemp("four")
    argv = ["--out", str(out), "--configs", json.dumps(FOUR)]
    world("trainer", 4).run(script_main, "pp_run", argv, timeout=800)
    return load_runs(out, FOUR, 4)


_LAUNCHER_OUT: dict[str, Path] = {}


def _launcher_run(out: Path) -> str:
    """Plain ``python script.py`` with Trainer(devices=2): Lightning's subprocess launcher."""
    cmd = [
        sys.executable,
        str(SCRIPTS / "pp_run.py"),
        "--devices",
        "2",
        "--out",
        str(out),
        "--configs",
        json.dumps(LAUNCHER),
    ]
    env = {"MASTER_PORT": str(free_port()), "MASTER_ADDR": "127.0.0.1"}
    _run(cmd, timeout=300, env=env)
    return "exit 0"


def background_jobs(items, tmp_path_factory) -> dict:
    """The Lightning-launcher job runs in the background (tests/background.py) while the
    in-process tests run; ``launcher_proc`` reads what it wrote."""
    if not any("launcher_proc" in getattr(item, "fixturenames", ()) for item in items):
        return {}
    _LAUNCHER_OUT["out"] = tmp_path_factory.mktemp("launcher")
    return {"strategy_launcher": functools.partial(_launcher_run, _LAUNCHER_OUT["out"])}


@pytest.fixture(scope="module")
def launcher_proc() -> dict[str, list[dict]]:
    background.check("strategy_launcher")
    return load_runs(_LAUNCHER_OUT["out"], LAUNCHER, 2)


@pytest.fixture(scope="module")
def two_proc(tmp_path_factory) -> dict[str, list[dict]]:
    """The bf16-mixed configurations in the shared 2-rank Trainer world."""
    out = tmp_path_factory.mktemp("two")
    argv = ["--out", str(out), "--configs", json.dumps(TWO)]
    world("trainer", 2).run(script_main, "pp_run", argv, timeout=300)
    return load_runs(out, TWO, 2)


def _rel_errors(got: list[float], want: list[float]) -> list[float]:
    assert len(got) == len(want), (len(got), len(want))
    return [abs(g - w) / abs(w) for g, w in zip(got, want)]


def _check_against_reference(ranks: list[dict], ref: dict, tol: float = REL_TOL) -> None:
    for d in ranks:
        errs = _rel_errors(d["train_loss"], ref["train_loss"])
        assert max(errs) <= tol, f"rank {d['rank']}: per-step relative errors {errs}"
        assert [v["step"] for v in d["val"]] == [v["step"] for v in ref["val"]]
        for key in ("val_loss", "val_acc"):
            errs = _rel_errors([v[key] for v in d["val"]], [v[key] for v in ref["val"]])
            assert max(errs) <= tol, f"rank {d['rank']}: {key} relative errors {errs}"
        assert d["best"] == ref["best"], f"rank {d['rank']}: best checkpoint"
    # every rank logs the very same values (monitors read them on every rank)
    for d in ranks[1:]:
        assert d["train_loss"] == ranks[0]["train_loss"]
        assert d["val"] == ranks[0]["val"]


@pytest.mark.parametrize("cfg", FOUR, ids=[c["name"] for c in FOUR])
def test_four_processes_match_single_process(four_proc, references, cfg):
    ranks = four_proc[cfg["name"]]
    assert len(ranks[0]["train_loss"]) == 10 * cfg["accumulate"]
    assert {d["dp"] for d in ranks} == {4 // cfg["pp"]}
    _check_against_reference(ranks, references[cfg["accumulate"]])


@pytest.mark.timeout(background.WAIT)
def test_lightning_launcher_matches_single_process(launcher_proc, references):
    _check_against_reference(launcher_proc["pp2"], references[1])


@pytest.mark.parametrize("name", ["pp2_bf16", "zbv_pp2_bf16"])
def test_bf16_mixed_trains_close_to_fp32(two_proc, references, name):
    ranks = two_proc[name]
    losses = ranks[0]["train_loss"]
    assert all(math.isfinite(x) for x in losses)
    # bf16 autocast keeps ~3 significant digits: close to fp32, not equal
    errs = _rel_errors(losses, references[1]["train_loss"])
    assert max(errs) < 5e-2, errs
    assert ranks[1]["train_loss"] == losses


@pytest.mark.parametrize("cfg", FOUR, ids=[c["name"] for c in FOUR])
def test_each_rank_holds_only_its_layers(four_proc, cfg):
    ranks = four_proc[cfg["name"]]
    held = []
    for d in ranks:
        assert d["local_layers"] == d["expected_layers"]
        # parameters and storage are exactly this rank's layers, nothing of other stages;
        # under V placement rank 0 holds both tied layers: one shared parameter, counted once
        shared = MODEL_KW["vocab_size"] * MODEL_KW["n_embd"] if len(d["tied"]) == 2 else 0
        assert d["param_count"] == d["expected_param_count"] - shared
        assert d["storage_bytes"] == d["param_bytes"]
        if d["dp_rank"] == 0:
            held += d["local_layers"]
    assert sorted(held) == list(range(8))  # the stages of one replica partition the model


@pytest.mark.parametrize("cfg", FOUR, ids=[c["name"] for c in FOUR])
def test_tied_copies_bitwise_equal_after_training(four_proc, cfg):
    digests = [v for d in four_proc[cfg["name"]] for v in d["tied"].values()]
    # embedding on the first stage, head on the last: a copy on each, every replica
    assert len(digests) == 2 * (4 // cfg["pp"])
    assert len(set(digests)) == 1


def test_zb_auto_rebuilt_from_measured_costs(four_proc):
    """schedule="zb-auto": after the second (profiling) step, the first having warmed up, every
    rank runs the schedule built from the measured costs (the engine's, which its step records
    carry: the bubble monitor compares against it), and the costs cover every (pp rank, chunk);
    training matched the single-process reference (test_four_processes_match_single_process)."""
    ranks = four_proc["zbauto_pp2_dp2"]
    for d in ranks:
        auto = d["auto_schedule"]
        assert auto is not None, f"rank {d['rank']}: no rebuild"
        assert auto["plan_has_it"]
        assert auto["overrides"] == 2 * 2  # pp=2 ranks x 2 chunks (V placement)
        assert auto["step"] == 2
        assert "zb-auto (V placement" in auto["text"] and "zbv" in auto["text"]
    # one order for all replicas: the same summary everywhere (built from the same numbers)
    assert len({d["auto_schedule"]["text"] for d in ranks}) == 1
    assert all(d["auto_schedule"] is None for d in four_proc["zbv_pp4"])


def test_zbv_places_first_and_last_stage_on_rank_0(four_proc):
    """V placement: the tied embedding and head both live on pipeline rank 0 (one parameter)."""
    for d in four_proc["zbv_pp4"]:
        assert len(d["layer_ranges"]) == 8
        if d["pp_rank"] == 0:
            assert d["local_layers"] == [0, 7]
    digests = [v for d in four_proc["zbv_pp4"] for v in d["tied"].values()]
    assert len(set(digests)) == 1


@pytest.mark.parametrize("name", ["zbv_pp2_dp2_acc2", "zbh1_pp2_dp2"])
def test_deferred_allreduce_after_last_w(four_proc, name):
    """dp=2 under zero-bubble: one async all-reduce per bucket, launched inside the chunk's LAST
    W event."""
    cfg = next(c for c in FOUR if c["name"] == name)
    for d in four_proc[name]:
        for i, step in enumerate(d["sync"]):
            if (i + 1) % cfg["accumulate"]:
                assert step["calls"] == 0
                continue
            assert step["calls"] == step["buckets"] == len(step["launches"])
            for ev in step["launches"]:
                last = step["last_b"][str(ev["chunk"])]
                assert last["start"] <= ev["t"] <= last["end"]


@pytest.mark.parametrize("name", ["pp2_vpp2_dp2", "pp2_dp2_acc2"])
def test_data_parallel_allreduce_deferred_bucketed_async(four_proc, name):
    cfg = next(c for c in FOUR if c["name"] == name)
    for d in four_proc[name]:
        assert d["dp"] == 2
        for i, step in enumerate(d["sync"]):
            sync_step = (i + 1) % cfg["accumulate"] == 0
            if not sync_step:  # accumulation micro-step: no communication at all
                assert step["calls"] == 0 and step["launches"] == []
                continue
            # one asynchronous all-reduce per bucket, nothing else
            assert step["calls"] == step["buckets"] == len(step["launches"])
            assert step["call_numels"] == [ev["numel"] for ev in step["launches"]]
            for ev in step["launches"]:
                # launched after the chunk's last backward started, before the step ended
                last_b = step["last_b"][str(ev["chunk"])]
                assert last_b["start"] <= ev["t"] <= last_b["end"]
            chunks = [ev["chunk"] for ev in step["launches"]]
            assert chunks == sorted(chunks, reverse=True)  # later chunks finish first
            if cfg.get("vpp", 1) > 1:
                # overlap: chunk 1 is already reducing while chunk 0 still runs backward
                first = min(ev["t"] for ev in step["launches"] if ev["chunk"] == 1)
                assert first < step["last_b"]["0"]["start"]
        if cfg.get("bucket_cap_mb"):
            assert d["sync"][-1]["buckets"] > 1


# ---- preflight through the strategy (cheap: no launched job except the batch check) ---------


def test_world_check_is_preflight_with_divisors():
    import lightning as L

    from lightning_pp.layout.rules import PreflightError
    from lightning_pp.strategy.pipeline_strategy import PipelineStrategy

    with pytest.raises(PreflightError) as err:
        L.Trainer(accelerator="cpu", devices=3, strategy=PipelineStrategy(pp=2), logger=False)
    msg = str(err.value)
    assert "does not divide the world size 3 (num_nodes=1 x devices=3)" in msg
    assert "use pp in [1, 3]" in msg
    with pytest.raises(PreflightError, match="pp=4 pipeline stages need at least 4 processes"):
        L.Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(pp=4), logger=False)


def test_layer_split_check_is_preflight_and_shows_the_split():
    from types import SimpleNamespace

    from lightning_pp.layout.rules import PreflightError
    from lightning_pp.layout.topology import PipelineTopology
    from lightning_pp.strategy.pipeline_strategy import PipelineStrategy

    strategy = PipelineStrategy(pp=2, vpp=2, microbatches=4)
    layout = strategy.layout
    layout.topology = PipelineTopology.from_world(2, 0, pp=2)  # as after setup_environment
    with pytest.raises(PreflightError) as err:
        strategy.stage_build.select(layout, None, SimpleNamespace(num_layers=3))
    msg = str(err.value)
    assert "num_layers=3" in msg and "pp(2) * vpp(2) = 4" in msg and "s3=" in msg
    assert strategy.stage_build.select(layout, None, SimpleNamespace(num_layers=4)) == [0, 2]


def _two_linear_fit(strategy, batch_size: int) -> None:
    """One step of a two-``Linear`` pipeline model (8 samples of 4 features) under the real
    Trainer on ``strategy``, in a rank of a 2-process Trainer world."""
    import lightning as L
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineLayers, PipelineMixin

    class Net(PipelineMixin, L.LightningModule):
        def configure_model(self):
            if getattr(self, "layers", None) is None:
                self.layers = PipelineLayers([lambda: torch.nn.Linear(4, 4) for _ in range(2)])

        def pipeline_input(self, batch):
            return batch[0]

        def pipeline_loss(self, output, batch):
            return F.mse_loss(output, batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 4))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        strategy=strategy,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=batch_size))


def _small_batch(rank: int, size: int) -> str:
    """A batch of 2 samples for microbatches=4: what each rank ends with."""
    from lightning_pp import PipelineStrategy

    try:
        _two_linear_fit(PipelineStrategy(pp=2, microbatches=4, watchdog_timeout=30.0), 2)
    except Exception as e:
        return f"ENDED WITH {type(e).__name__}: {e}"
    return "TRAINED"


def _timeouts_of_two_fits(rank: int, size: int) -> list[list[float]]:
    """Two Trainers one after the other in this process, with different ``timeout=``: after
    each fit, the gloo timeout (seconds) of the default group and of the mesh's pp, dp and tp
    groups (the dp and tp ones of one rank each here, made by ``DeviceMesh``)."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_pp import PipelineStrategy

    seen = []
    for seconds in (77, 91):
        strategy = PipelineStrategy(pp=2, microbatches=2, timeout=timedelta(seconds=seconds))
        _two_linear_fit(strategy, 4)
        g = strategy.layout.groups
        groups = [dist.group.WORLD, g.pp_group, g.dp_group, g.tp_group]
        seen.append(
            [x._get_backend(torch.device("cpu")).options._timeout.total_seconds() for x in groups]
        )
    return seen


def test_a_later_trainers_timeout_reaches_the_existing_process_group():
    """Lightning leaves a process group that exists (made by an earlier Trainer of the same
    process) as it is, the mesh's groups are built once per process and ``DeviceMesh`` takes no
    timeout: a ``PipelineStrategy(timeout=)`` reached none of the dp and tp groups, and a later
    Trainer's none at all. The strategy now sets it on every group it uses. Read back from each
    group's gloo backend."""
    seen = world("trainer", 2).run(_timeouts_of_two_fits, timeout=120)
    assert seen == [[[77.0] * 4, [91.0] * 4]] * 2


def test_batch_smaller_than_microbatches_fails_on_every_rank_without_hanging():
    """Both ranks raise the preflight error themselves, before communicating: none is left
    waiting for the other. (A world of its own: the failure marks its store.)"""
    own = World("trainer", 2)
    try:
        ended = own.run(_small_batch, timeout=120)  # a hang would fail here, after 120 s
    finally:
        own.close()
    for rank, text in enumerate(ended):
        want = (
            f"ENDED WITH PreflightError: rank {rank}: batch size 2 per replica is smaller "
            f"than microbatches=4"
        )
        assert text.startswith(want), (rank, text)
