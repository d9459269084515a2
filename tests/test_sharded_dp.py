"""Sharded data parallelism under the real Trainer and gloo: the distributed optimizer
(``PipelineStrategy(zero=1|2)``) and FSDP2 per chunk (``fsdp=True``).

Every schedule at pp2 x dp2 trains the tied-embedding GPT for 10 steps (AdamW, clipping on,
warmup + cosine LR) in one shared 4-rank Trainer world (:mod:`worlds`, ``pp_run``); each run's
losses and validation metrics must be within 1e-5 of the single-process plain Trainer's (the
unsharded, unpipelined reference: never DDP or FSDP). The same world measures each rank's held
bytes from the tensors, and the launch times of the reduce-scatters against the engine's record.
A planted bug (the reduce-scatter sums the replicas' gradients instead of averaging them, as
FSDP2 does on gloo, pytorch#162338) must make the comparison fail. Checkpoints written under
``zero=1`` resume under ``zero=0``, ``zero=2``, another schedule and a plain Trainer, and
checkpoints written under ``fsdp=True`` resume under ``zero=1`` and a plain Trainer, and the
other way round (the phases of ``ckpt_run`` in a second 4-rank world).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from pp_common import load_runs, reference_runs  # noqa: E402
from pp_common import mismatches as _mismatches  # noqa: E402
from pp_common import rel_errors as _rel  # noqa: E402
from worlds import World, script_main, world  # noqa: E402

REL_TOL = 1e-5
RESHARD_TOL = 1e-6

PP2 = {"pp": 2, "microbatches": 4, "accumulate": 1}
ZERO = [
    {"name": "gpipe_z1", **PP2, "schedule": "gpipe", "zero": 1},
    {"name": "1f1b_z1", **PP2, "zero": 1, "timeline": True},
    {"name": "zbh1_z1", **PP2, "schedule": "zb-h1", "zero": 1},
    {"name": "zbv_z1", **PP2, "schedule": "zbv", "zero": 1, "timeline": True},
    # pp2 x dp2 x vpp2, the tied embedding and head on different ranks, accumulation 2
    {"name": "il_z1_acc2", **PP2, "vpp": 2, "accumulate": 2, "zero": 1},
    # tiny buckets: several reduce-scatters per chunk; full-size gradients freed
    {"name": "1f1b_z2_tiny", **PP2, "zero": 2, "bucket_cap_mb": 0.01},
    {"name": "il_z2_recompute", **PP2, "vpp": 2, "zero": 2, "recompute": "full"},
    # the parameter all-gathers finish at the next forwards (small buckets: several of them)
    {
        "name": "il_z1_overlap",
        **PP2,
        "vpp": 2,
        "zero": 1,
        "overlap_param_gather": True,
        "bucket_cap_mb": 0.01,
    },
    {
        "name": "zbv_z2_overlap_acc2",
        **PP2,
        "schedule": "zbv",
        "accumulate": 2,
        "zero": 2,
        "overlap_param_gather": True,
    },
    {"name": "zbv_z1_bf16", **PP2, "schedule": "zbv", "zero": 1, "precision": "bf16-mixed"},
    # bf16 parameters: the optimizer steps fp32 master rows
    {"name": "1f1b_z1_bf16true", **PP2, "zero": 1, "precision": "bf16-true"},
    # FSDP2 per chunk: every schedule; zbv's V placement puts the tied embedding and head in
    # two chunks of rank 0 (that weight stays whole, all-reduced); vpp2 ties across ranks.
    # reshard_after_forward and recompute with FSDP2 are proven at engine level
    # (test_fsdp_chunks: 1f1b-reshard-after-forward, 1f1b-recompute, zbv-recompute).
    {"name": "gpipe_fsdp", **PP2, "schedule": "gpipe", "fsdp": True},
    {"name": "1f1b_fsdp", **PP2, "fsdp": True, "timeline": True},
    {"name": "zbh1_fsdp", **PP2, "schedule": "zb-h1", "fsdp": True},
    {"name": "zbv_fsdp", **PP2, "schedule": "zbv", "fsdp": True, "timeline": True},
    {"name": "il_fsdp_acc2", **PP2, "vpp": 2, "accumulate": 2, "fsdp": True},
    {"name": "il_fsdp_bf16", **PP2, "vpp": 2, "fsdp": True, "precision": "bf16-mixed"},
    # unsharded, same shapes: the memory figures' baseline
    {"name": "1f1b_z0", **PP2},
    {"name": "zbv_z0", **PP2, "schedule": "zbv"},
    # last (it patches the module while it runs): the planted summing bug
    {"name": "1f1b_z1_summed", **PP2, "zero": 1, "plant": "no_average"},
]
EXACT = [c for c in ZERO if "plant" not in c and "precision" not in c]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, dict]:
    return reference_runs(str(tmp_path_factory.mktemp("ref")))


_OUT: dict[str, Path] = {}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("zero")
    _OUT["zero"] = out
    argv = ["--out", str(out), "--configs", json.dumps(ZERO)]
    world("trainer", 4).run(script_main, "pp_run", argv, timeout=500)
    return load_runs(out, ZERO, 4)


@pytest.mark.parametrize("cfg", EXACT, ids=[c["name"] for c in EXACT])
def test_sharded_runs_match_the_single_process_trainer(zero_runs, references, cfg):
    ranks = zero_runs[cfg["name"]]
    assert len(ranks[0]["train_loss"]) == 10 * cfg["accumulate"]
    kind = "ShardedGradSync" if cfg.get("zero") else "DeferredGradSync"
    kind = "FsdpGradSync" if cfg.get("fsdp") else kind
    assert {d["sharding"]["kind"] for d in ranks} == {kind}
    assert _mismatches(ranks, references[cfg["accumulate"]], REL_TOL) == []
    for d in ranks[1:]:  # every rank logs the very same values
        assert d["train_loss"] == ranks[0]["train_loss"]


@pytest.mark.parametrize("cfg", ZERO[:-1], ids=[c["name"] for c in ZERO[:-1]])
def test_tied_copies_stay_bitwise_equal(zero_runs, cfg):
    digests = [v for d in zero_runs[cfg["name"]] for v in d["tied"].values()]
    assert len(digests) >= 2 and len(set(digests)) == 1


def test_one_device_mesh_serves_the_strategy_the_module_and_every_group(zero_runs):
    """strategy.device_mesh is a (pipeline_parallel, data_parallel, tensor_parallel) mesh, pp
    outermost, tp of size 1 here, whose coordinates are the topology's; the module's hooks read
    the same object as self.device_mesh (Lightning's ModelParallelStrategy convention); the pp,
    dp and tp groups are the mesh's own."""
    for cfg in ZERO:
        for d in zero_runs[cfg["name"]]:
            mesh = d["mesh"]
            assert mesh["names"] == ["pipeline_parallel", "data_parallel", "tensor_parallel"]
            assert mesh["shape"] == [2, 2, 1]
            assert mesh["coordinate"] == [d["pp_rank"], d["dp_rank"], 0]
            assert mesh["module_sees_it"] and mesh["pp_group"] and mesh["dp_group"]
            assert mesh["tp_group"]


@pytest.mark.parametrize("name", ["il_z1_overlap", "zbv_z2_overlap_acc2"])
def test_overlapped_parameter_gathers_run_past_the_optimizer_step(zero_runs, name):
    """With overlap_param_gather the all-gathers are still in flight after the optimizer step
    (each finished by the first forward that reads its bucket), except where a checkpoint was
    saved in between (every 4th step here: the save completes them); the runs still equal the
    single-process Trainer (test_sharded_runs_match_the_single_process_trainer)."""
    cfg = next(c for c in ZERO if c["name"] == name)
    for d in zero_runs[name]:
        stepped = [s for i, s in enumerate(d["sync"]) if (i + 1) % cfg["accumulate"] == 0]
        in_flight = [s["gathers_in_flight"] for s in stepped]
        assert sum(1 for n in in_flight if n > 0) >= len(stepped) // 2, in_flight
    for c in ZERO:  # without the setting, every gather is finished inside the step
        if c.get("zero") and not c.get("overlap_param_gather"):
            assert all(s["gathers_in_flight"] == 0 for d in zero_runs[c["name"]] for s in d["sync"])


def test_the_comparison_catches_summed_gradients(zero_runs, references):
    """The planted bug (replicas' gradients summed, not averaged) fails the same check. AdamW
    hardly notices a gradient twice too large (its update divides by the gradient's scale, and
    clipping scales it down again), so the losses stay close: the global gradient norm, which
    the clipping computes and the check compares, is what doubles."""
    ranks = zero_runs["1f1b_z1_summed"]
    bad = _mismatches(ranks, references[1], REL_TOL)
    assert any("gradient norm" in b for b in bad), bad
    for d in ranks:
        ratios = [g / w for g, w in zip(d["grad_norm"], references[1]["grad_norm"])]
        assert all(abs(r - 2) < 1e-3 for r in ratios), ratios


@pytest.mark.parametrize("name", ["zbv_z1_bf16", "il_fsdp_bf16"])
def test_bf16_mixed_sharded_trains_close_to_fp32(zero_runs, references, name):
    losses = zero_runs[name][0]["train_loss"]
    assert all(math.isfinite(x) for x in losses)
    # bf16 autocast keeps ~3 significant digits: close to fp32, not equal
    assert max(_rel(losses, references[1]["train_loss"])) < 5e-2


def test_bf16_parameters_get_fp32_master_rows(zero_runs, references):
    """bf16-true: the optimizer steps fp32 copies of each rank's rows (1/dp of the parameters,
    at twice the bytes per element) and its moments are fp32; the tied copies stay bitwise
    equal; the run trains close to fp32."""
    ranks = zero_runs["1f1b_z1_bf16true"]
    for d in ranks:
        held = d["held"]
        assert held["master"] == held["params"] // d["dp"] * 2  # bf16: 2 bytes, fp32: 4
        assert held["optimizer"] == 2 * held["master"]  # AdamW: two fp32 moments per row
    assert len({v for d in ranks for v in d["tied"].values()}) == 1
    assert max(_rel(ranks[0]["train_loss"], references[1]["train_loss"])) < 5e-2
    for d in zero_runs["1f1b_z1"]:  # fp32: the rows are views of the parameters
        assert d["held"]["master"] == 0


@pytest.mark.parametrize(
    "sharded,plain", [("1f1b_z1", "1f1b_z0"), ("zbv_z1", "zbv_z0"), ("1f1b_z2_tiny", "1f1b_z0")]
)
def test_optimizer_state_is_one_dp_th_per_rank(zero_runs, sharded, plain):
    """Measured from the optimizer's state tensors: each replica holds 1/dp of the unsharded
    run's AdamW moments, give or take its rows of padding (8 bytes per padded element)."""
    for z, u in zip(zero_runs[sharded], zero_runs[plain]):
        assert z["dp"] == 2 and z["pp_rank"] == u["pp_rank"]
        want = u["held"]["optimizer"] / z["dp"]
        assert abs(z["held"]["optimizer"] - want) <= 8 * z["sharding"]["padding"], (z, u)
        assert z["held"]["optimizer"] < u["held"]["optimizer"]
        assert z["held"]["params"] == u["held"]["params"]  # zero shards no parameters


@pytest.mark.parametrize("sharded,plain", [("1f1b_fsdp", "1f1b_z0"), ("zbv_fsdp", "zbv_z0")])
def test_fsdp_holds_one_dp_th_of_parameters_gradients_and_state(zero_runs, sharded, plain):
    """Measured from the tensors (a DTensor's local shard): parameters, gradients and AdamW
    moments are 1/dp of the unsharded run's; a weight two local chunks share (zbv, rank 0: the
    tied embedding and head) stays whole on every replica, 4 bytes per element."""
    for f, u in zip(zero_runs[sharded], zero_runs[plain]):
        whole = 4 * f["sharding"]["whole_numel"]
        held, full = f["held"], u["held"]
        assert held["params"] == (full["params"] - whole) / f["dp"] + whole, (f, u)
        assert held["grads"] == (full["grads"] - whole) / f["dp"] + whole
        assert held["optimizer"] == (full["optimizer"] - 2 * whole) / f["dp"] + 2 * whole
        assert held["master"] == 0


@pytest.mark.parametrize("name", ["1f1b_fsdp", "zbv_fsdp", "il_fsdp_acc2"])
def test_fsdp_reduce_scatter_starts_at_each_chunks_last_backward(zero_runs, name):
    """One reduce-scatter per FSDP2 unit, started inside its chunk's last B (or W), not at the
    end of the step (torch.distributed.pipelining reduces every stage after its last
    backward); with two chunks per rank the first chunk's start while the rank still works."""
    cfg = next(c for c in ZERO if c["name"] == name)
    for d in zero_runs[name]:
        for i, step in enumerate(d["sync"]):
            if (i + 1) % cfg["accumulate"]:
                assert step["launches"] == []
                continue
            assert len(step["launches"]) == step["buckets"] > 0
            for ev in step["launches"]:
                last = step["last_b"][str(ev["chunk"])]
                assert last["start"] <= ev["t"] <= last["end"]
            if len(step["last_b"]) > 1:
                assert min(ev["t"] for ev in step["launches"]) < step["last_action"]["start"]


@pytest.mark.parametrize(
    "name", ["1f1b_z1", "1f1b_z2_tiny", "1f1b_fsdp", "1f1b_z0", "zbv_z1", "zbv_fsdp"]
)
def test_the_plans_prediction_is_within_2_percent_of_the_measured_bytes(zero_runs, name):
    """The planner's per-rank state bytes (planner.sharding.sharded_state_bytes, from the
    layers' parameter shapes) against what ModelStateMemoryMonitor measured from the tensors
    after the optimizer step, on every rank: parameters, gradients, master weights, optimizer
    state, each within 2 %. Under zbv the tied embedding and head are one tensor on pipeline
    rank 0: counted once, and left whole by FSDP2."""
    from pp_common import MODEL_KW, state_bytes_off

    from lightning_pp.layout.plan import PipelinePlan
    from lightning_pp.models import GPT
    from lightning_pp.planner.meta_profile import layers_tensor_shapes, tied_groups

    cfg = next(c for c in ZERO if c["name"] == name)
    model = GPT(**MODEL_KW)
    model.configure_model()
    shapes = layers_tensor_shapes([model.layers[i] for i in range(8)], tied_groups(model))
    plan = PipelinePlan.build(
        pp=2,
        schedule=cfg.get("schedule"),
        world_size=4,
        microbatches=cfg["microbatches"],
        num_layers=8,
        zero=cfg.get("zero", 0),
        fsdp=cfg.get("fsdp", False),
        bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0),
    )
    assert state_bytes_off(plan, shapes, zero_runs[name]) == [], name


@pytest.mark.parametrize("name", ["1f1b_z1", "zbv_z1", "1f1b_fsdp", "zbv_fsdp"])
def test_the_timeline_shows_each_reduce_scatter_before_the_ranks_last_action(zero_runs, name):
    """PipelineTimeline's trace of the last step (what a user opens in Perfetto): on every
    rank's data-parallel track, one instant per bucket, each at or before the end of the rank's
    last action, inside its chunk's last backward; under zbv the first chunk's before the last
    action starts."""
    trace = json.loads((_OUT["zero"] / f"timeline_{name}" / "timeline_step9.json").read_text())
    events = trace["traceEvents"]
    for rank in range(4):
        actions = [e for e in events if e.get("pid") == rank and e["ph"] == "X" and e["tid"] == 0]
        actions = [e for e in actions if e["name"] != "wait"]
        reduces = [e for e in events if e.get("pid") == rank and e["ph"] == "i"]
        assert len(reduces) == zero_runs[name][rank]["sync"][-1]["buckets"] > 0
        last = max(actions, key=lambda e: e["ts"])
        for r in reduces:
            chunk = r["args"]["chunk"]
            backs = [a for a in actions if a["args"]["chunk"] == chunk and a["name"][0] in "BW"]
            final = max(backs, key=lambda a: a["ts"])
            assert final["ts"] <= r["ts"] <= final["ts"] + final["dur"] + 1e-3
            assert r["ts"] <= last["ts"] + last["dur"] + 1e-3
        if name.startswith("zbv"):
            assert min(r["ts"] for r in reduces) < last["ts"]


def test_zero_2_keeps_only_the_gradient_rows(zero_runs):
    """After the step, zero=2 holds the optimizer's row gradients alone (1/dp); zero=1 keeps
    the full-size gradients allocated as well."""
    for z2, z1, z0 in zip(zero_runs["1f1b_z2_tiny"], zero_runs["1f1b_z1"], zero_runs["1f1b_z0"]):
        full = z0["held"]["grads"]
        assert full == z0["held"]["params"]
        assert abs(z2["held"]["grads"] - full / 2) <= 4 * z2["sharding"]["padding"]
        assert z1["held"]["grads"] == full + z2["held"]["grads"]


@pytest.mark.parametrize("name", ["1f1b_z1", "zbv_z1", "il_z1_acc2", "1f1b_z2_tiny"])
def test_reduce_scatter_starts_at_each_chunks_last_backward(zero_runs, name):
    """One asynchronous reduce-scatter per bucket, started inside the chunk's last B (or W),
    before the rank's last action of the step ends; with two chunks per rank, the chunk that
    finishes first is reducing while the rank still computes."""
    cfg = next(c for c in ZERO if c["name"] == name)
    for d in zero_runs[name]:
        for i, step in enumerate(d["sync"]):
            if (i + 1) % cfg["accumulate"]:
                assert step["calls"] == 0 and step["launches"] == []
                continue
            assert step["calls"] == step["buckets"] == len(step["launches"])
            for ev in step["launches"]:
                last = step["last_b"][str(ev["chunk"])]
                assert last["start"] <= ev["t"] <= last["end"]
                assert ev["t"] <= step["last_action"]["end"]
            if len(step["last_b"]) > 1:
                early = min(ev["t"] for ev in step["launches"])
                assert early < step["last_action"]["start"]


# ---------------------------------------------------------------------------- checkpoints
def _phases(out: Path) -> dict[str, str]:
    z1, f = out / "z1_ckpt", out / "f_ckpt"
    return {
        "z1": str(z1),
        "z1_5": str(z1 / "step=5.ckpt"),
        "f": str(f),
        "f_5": str(f / "step=5.ckpt"),
    }


@pytest.fixture(scope="module")
def ckpt_runs(tmp_path_factory) -> Path:
    """zero=1 saves at step 5; zero=1, zero=0, zero=2 under zbv, and a plain Trainer resume."""
    out = tmp_path_factory.mktemp("zero_ckpt")
    paths = _phases(out)
    pp2 = {"pp": 2, "microbatches": 2}
    phases = [
        {"name": "z1_save", **pp2, "zero": 1, "max_steps": 5, "every": 5, "ckpt_dir": paths["z1"]},
        {"name": "z1_resume", **pp2, "zero": 1, "max_steps": 10, "resume": paths["z1_5"]},
        {"name": "z1_to_z0", **pp2, "max_steps": 10, "resume": paths["z1_5"]},
        {"name": "f_save", **pp2, "fsdp": True, "max_steps": 5, "every": 5, "ckpt_dir": paths["f"]},
        {"name": "f_resume", **pp2, "fsdp": True, "max_steps": 10, "resume": paths["f_5"]},
        {"name": "f_to_z1", **pp2, "zero": 1, "max_steps": 10, "resume": paths["f_5"]},
        {"name": "z1_to_f", **pp2, "fsdp": True, "max_steps": 10, "resume": paths["z1_5"]},
        {
            "name": "z1_to_zbv_z2",
            "pp": 2,
            "microbatches": 4,
            "schedule": "zbv",
            "zero": 2,
            "max_steps": 10,
            "resume": paths["z1_5"],
        },
    ]
    fresh = World("trainer", 4)
    try:
        (out / "w").mkdir()
        argv = ["--out", str(out / "w"), "--phases", json.dumps(phases)]
        fresh.run(script_main, "ckpt_run", argv, timeout=400)
    finally:
        fresh.close()
    from ckpt_run import run_phase

    torch.set_num_threads(1)
    (out / "p").mkdir()
    run_phase({"name": "plain_full", "pp": 0, "max_steps": 10}, str(out / "p"), 1)
    plain = {"name": "z1_to_plain", "pp": 0, "max_steps": 10, "resume": paths["z1_5"]}
    run_phase({**plain, "pipeline_io": True}, str(out / "p"), 1)
    f_plain = {"name": "f_to_plain", "pp": 0, "max_steps": 10, "resume": paths["f_5"]}
    run_phase({**f_plain, "pipeline_io": True}, str(out / "p"), 1)
    return out


def test_zero_saves_each_ranks_rows_where_they_belong(ckpt_runs):
    """The moments are written as DTensor shards (each replica its own rows, nothing
    gathered): DCP's metadata holds one chunk per replica, at torch.chunk's row offsets, of a
    tensor of the parameter's own shape."""
    from lightning_pp.checkpoint.dcp_safe import read_dcp_metadata

    meta = read_dcp_metadata(Path(_phases(ckpt_runs)["z1_5"]) / ".metadata")
    moments = {
        k: v for k, v in meta.state_dict_metadata.items() if k.startswith("optimizer_0.state.")
    }
    name = "optimizer_0.state.layers.1.qkv.weight.exp_avg"
    shape = tuple(moments[name].size)
    offsets = sorted(tuple(c.offsets) for c in moments[name].chunks)
    assert offsets == [(0, 0), (shape[0] // 2, 0)], (shape, offsets)
    split = [k for k, v in moments.items() if len(v.chunks) == 2]
    assert len(split) > len(moments) // 2  # every moment of a parameter of 2 rows or more


def _moment_sizes(checkpoint: str) -> dict[str, tuple[int, ...]]:
    """Global shape of every optimizer-state tensor of a checkpoint, by DCP key."""
    from lightning_pp.checkpoint.dcp_safe import read_dcp_metadata

    meta = read_dcp_metadata(Path(checkpoint) / ".metadata")
    return {
        k: tuple(v.size)
        for k, v in meta.state_dict_metadata.items()
        if k.startswith("optimizer_0.state.") and hasattr(v, "size")
    }


@pytest.mark.parametrize(
    "name,saved",
    [
        ("z1_resume", "z1_5"),
        ("z1_to_zbv_z2", "z1_5"),
        ("z1_to_f", "z1_5"),
        ("f_resume", "f_5"),
        ("f_to_z1", "f_5"),
    ],
)
def test_a_sharded_resume_reads_only_the_replicas_part_of_each_moment(ckpt_runs, name, saved):
    """A zero or fsdp rank asks DCP for its own rows of each moment (torch.chunk's rows for its
    data-parallel coordinate, read into a DTensor laid out as it keeps them), never the whole:
    counted by the reader every load goes through. Before, each replica read every moment whole
    and kept ``1/dp`` of it, so resuming needed the stage's whole optimizer state per rank. The
    plain Trainer's resume, which keeps everything, reads each whole (the counter's check)."""
    sizes = _moment_sizes(_phases(ckpt_runs)[saved])
    split = {k: s for k, s in sizes.items() if len(s) >= 1 and s[0] >= 2}
    assert split

    def read_moments(d: dict) -> dict[str, int]:
        return {k: n for k, n in d["read_elements"].items() if k in split}

    for d in _ck(ckpt_runs, "w", name, 4):
        got = read_moments(d)
        assert got, f"rank {d['rank']} read no moment"
        for key, n in got.items():
            rows, numel = split[key][0], math.prod(split[key])
            first = math.ceil(rows / 2)
            mine = {first * (numel // rows), (rows - first) * (numel // rows)}
            assert n in mine, (name, d["rank"], key, n, split[key])
    plain = _ck(ckpt_runs, "p", "z1_to_plain" if saved == "z1_5" else "f_to_plain", 1)[0]
    whole = read_moments(plain)
    assert whole == {k: math.prod(s) for k, s in split.items()}


def _ck(out: Path, group: str, name: str, size: int) -> list[dict]:
    return [json.loads((out / group / f"{name}.rank{r}.json").read_text()) for r in range(size)]


@pytest.mark.parametrize(
    "name,group,size",
    [
        ("z1_resume", "w", 4),
        ("z1_to_z0", "w", 4),
        ("z1_to_zbv_z2", "w", 4),
        ("z1_to_plain", "p", 1),
        ("z1_to_f", "w", 4),
        ("f_resume", "w", 4),
        ("f_to_z1", "w", 4),
        ("f_to_plain", "p", 1),
    ],
)
def test_a_sharded_checkpoint_resumes_under_any_sharding(ckpt_runs, name, group, size):
    """Steps 6-10 after loading the step-5 checkpoint of a zero=1 (``z1_*``) or an fsdp
    (``f_*``) run equal the uninterrupted plain single-process run's: parameters and moments
    were saved by name and shape (DTensor shards, one chunk per replica) and are cut anew on
    loading, for zero's rows or FSDP2's shards."""
    full = _ck(ckpt_runs, "p", "plain_full", 1)[0]
    for saved_name in ("z1_save", "f_save"):
        saved = _ck(ckpt_runs, "w", saved_name, 4)
        assert max(_rel(saved[0]["train_loss"], full["train_loss"][:5])) <= REL_TOL
    resumed = _ck(ckpt_runs, group, name, size)
    for d in resumed:
        assert max(_rel(d["train_loss"], full["train_loss"][5:])) <= RESHARD_TOL, name
        assert d["lr"] == full["lr"][5:]
        assert d["global_step"] == 10
