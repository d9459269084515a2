"""Tensor parallelism inside each stage (``PipelineStrategy(tp=N)``) under the real Trainer and
gloo, against the single-process plain Trainer (fp32, 10 steps, AdamW, clipping 0.5, warmup +
cosine LR, relative 1e-5 per step on the loss, the validation metrics and the clipping's global
gradient norm).

* ``PipelineLayers``: :class:`~lightning_pp.models.decoder.DecoderLM` (separate q/k/v, a
  vocabulary-parallel embedding tied to a column-wise head) at pp2 x tp2 under 1f1b and zbv
  (V placement: the tied embedding and head on one rank) in the shared 4-rank world, and at
  pp2 x tp2 x dp2 interleaved (the tie across ranks) in an 8-rank world.
* ``split=``: unmodified ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` with ``tp_plan="auto"``
  (their own plans, transformers' own styles) at pp2 x tp2.
* Checkpoints: written at pp2 x tp2, resumed at pp2 x tp2, pp2 x tp1 x dp2, pp4 x tp1 and in a
  plain Trainer; written at pp2 x dp2 and resumed at pp2 x tp2 (tp1 -> tp2); written at
  pp2 x dp2 x tp2 under fsdp or zero=1, resumed there, under the other one, at tp2 unsharded,
  at dp4 without tp and plain.
* fsdp x tp: FSDP2 over each tensor-parallel shard (2-D placements) at pp2 x dp2 x tp2 under
  1f1b (the tie across ranks) and zbv (the tie on one rank, left whole by FSDP2).
* zero x tp: the distributed optimizer over each tensor-parallel shard (its rows cut over dp)
  at pp2 x dp2 x tp2 under 1f1b (zero=1, the tie across ranks), zbv (zero=2, the tie on one
  rank, the parameter all-gathers overlapped with the next forwards) and with sequence
  parallelism; each rank's rows seen whole by a checkpoint (every
  placement, uneven rows); the replicated rows counted once by the clipping (a planted
  double count is caught); checkpoints resume at their own shape, under fsdp and plain.
* Sequence parallelism (``DecoderLM(sequence_parallel=True)``: the projections keep ``T / tp``
  of their gathered inputs and regather them in backward) at pp2 x tp2 (1f1b, zbv, zbv with
  every layer recomputed) and under fsdp at pp2 x dp2 x tp2 (zbv): equal to the reference,
  every layer's input measured at ``T / tp`` positions; an uneven length refused.
* The planner's per-rank state bytes on the tp-local shapes against the measured ones (2 %).
* The rules: the world, the sharding, the plan settings and the model's sizes are refused with
  the numbers named, before any process group exists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from pp_common import load_runs, mismatches, rel_errors, run_reference  # noqa: E402
from worlds import script_main, world  # noqa: E402

from lightning_pp.layout.plan import PipelinePlan  # noqa: E402
from lightning_pp.layout.rules import PreflightError  # noqa: E402

# Trainer worlds of 4 and 8 ranks run several configurations per case (each case has its own
# world timeout); pytest-timeout's 300 s default would cut the module fixtures short under load.
pytestmark = pytest.mark.timeout(1200)

REL_TOL = 1e-5
RESHARD_TOL = 1e-6

TP2 = {"pp": 2, "tp": 2, "microbatches": 4, "accumulate": 1, "model": "decoder"}
WORLD4 = [
    {"name": "tp2_1f1b", **TP2, "memory": True},
    {"name": "tp2_zbv", **TP2, "schedule": "zbv"},
    # every layer under torch's checkpoint: its recompute stops at the last saved tensor, past
    # the embedding's async all-reduce (waited for by collectives_waited)
    {"name": "tp2_1f1b_recompute", **TP2, "recompute": "full"},
    # sequence parallelism: the residual stream, the norms and the P2P messages cut along the
    # sequence over tp (DecoderLM(sequence_parallel=True)); the tie across ranks, then on one
    {"name": "tp2_sp_1f1b", **TP2, "model": "decoder-sp", "memory": True},
    {"name": "tp2_sp_zbv", **TP2, "model": "decoder-sp", "schedule": "zbv"},
    # ... with every layer recomputed: the regathered parts are saved tensors a recomputed
    # region refills (once, for I and W)
    {
        "name": "tp2_sp_zbv_recompute",
        **TP2,
        "model": "decoder-sp",
        "schedule": "zbv",
        "recompute": "full",
    },
]
# last (it patches the strategy while it runs): replicated weights counted on every tp rank
PLANTED = {"name": "tp2_norm_planted", **TP2, "plant": "tp_norm_everywhere"}
WORLD8 = [
    {"name": "tp2_dp2_interleaved", **TP2, "vpp": 2},
    # FSDP2 over each tensor-parallel shard: 2-D placements (a column-wise weight is a
    # _StridedShard over dp), the tie across ranks (1f1b) and on one rank, left whole (zbv)
    {"name": "tp2_dp2_fsdp_1f1b", **TP2, "fsdp": True},
    {"name": "tp2_dp2_fsdp_zbv", **TP2, "fsdp": True, "schedule": "zbv"},
    # sequence parallelism under FSDP2: a norm's weight is Replicate over tp (its gradient
    # partial until summed) and Shard over dp
    {"name": "tp2_dp2_sp_fsdp_zbv", **TP2, "model": "decoder-sp", "fsdp": True, "schedule": "zbv"},
    # the distributed optimizer over each tensor-parallel shard: rows of the local shards
    {"name": "tp2_dp2_zero1_1f1b", **TP2, "zero": 1},
    # ... with the parameter all-gathers finished at the next forwards
    {
        "name": "tp2_dp2_zero2_zbv",
        **TP2,
        "zero": 2,
        "schedule": "zbv",
        "overlap_param_gather": True,
    },
    {"name": "tp2_dp2_sp_zero1_zbv", **TP2, "model": "decoder-sp", "zero": 1, "schedule": "zbv"},
]
# last (it patches the distributed optimizer while it runs): replicated rows counted on every
# tp rank
PLANTED8 = {"name": "tp2_dp2_zero1_norm_planted", **TP2, "zero": 1,
            "plant": "zero_tp_norm_everywhere"}  # fmt: skip
HF = {"split": "model.model.layers", "pp": 2, "microbatches": 4, "clip": 1.0}
ATTENTION_ONLY = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
}
HF_RUNS = [
    {"name": "llama_tp2_1f1b", "model": "llama", **HF, "tp": 2, "tp_plan": "auto"},
    {
        "name": "qwen2_tp2_zbv",
        "model": "qwen2",
        **HF,
        "tp": 2,
        "tp_plan": "auto",
        "schedule": "zbv",
    },
    # a user's own plan replaces the model's: attention only, the MLP and the head stay whole
    {"name": "llama_tp2_own_plan", "model": "llama", **HF, "tp": 2, "tp_plan": ATTENTION_ONLY},
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    torch.set_num_threads(1)
    return run_reference(1, str(tmp_path_factory.mktemp("ref")), model="decoder")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out4, out8 = tmp_path_factory.mktemp("tp4"), tmp_path_factory.mktemp("tp8")
    configs4 = [*WORLD4, PLANTED]
    world("trainer", 4).run(
        script_main, "pp_run", ["--out", str(out4), "--configs", json.dumps(configs4)], timeout=400
    )
    configs8 = [*WORLD8, PLANTED8]
    world("trainer", 8).run(
        script_main, "pp_run", ["--out", str(out8), "--configs", json.dumps(configs8)], timeout=800
    )
    return {**load_runs(out4, configs4, 4), **load_runs(out8, configs8, 8)}


@pytest.mark.parametrize("cfg", WORLD4 + WORLD8, ids=[c["name"] for c in WORLD4 + WORLD8])
def test_tensor_parallel_runs_match_the_single_process_trainer(runs, reference, cfg):
    ranks = runs[cfg["name"]]
    assert mismatches(ranks, reference, REL_TOL) == []
    # every collective DTensor launched was waited for, a recompute's included (one that
    # stops at its last saved tensor leaves its earlier async collectives without a consumer)
    assert [d["unwaited_collectives"] for d in ranks] == [0] * len(ranks)
    for d in ranks[1:]:  # every rank logs the very same values
        assert d["train_loss"] == ranks[0]["train_loss"]
    shape = [cfg["pp"], len(ranks) // (cfg["pp"] * cfg["tp"]), cfg["tp"]]
    for d in ranks:
        assert d["mesh"]["names"] == ["pipeline_parallel", "data_parallel", "tensor_parallel"]
        assert d["mesh"]["shape"] == shape
        assert d["mesh"]["tp_group"] and d["mesh"]["coordinate"][2] == d["tp_rank"]


@pytest.mark.parametrize("planted", [PLANTED, PLANTED8], ids=["tp", "zero_tp"])
def test_counting_replicated_weights_on_every_tp_rank_is_caught(runs, reference, planted):
    """The comparison catches torchtitan#596: with the LayerNorms' squares summed on both tp
    ranks the clipping norm, and through the clipping the losses, leave the reference; under
    zero the same for their rows (and the position table's, a plain tensor on both tp ranks)."""
    bad = mismatches(runs[planted["name"]], reference, REL_TOL)
    assert any("gradient norm" in b for b in bad), bad


@pytest.mark.parametrize("cfg", WORLD4 + WORLD8, ids=[c["name"] for c in WORLD4 + WORLD8])
def test_each_rank_allocates_one_tp_th_of_its_sharded_weights(runs, cfg):
    """Measured from the tensors: the local shards' storages of the weights cut over tp hold
    exactly 1/tp of their bytes, on every rank of every stage; under fsdp 1/(tp * dp), but for a
    weight FSDP2 leaves whole (zbv's tied embedding and head, on one rank), 1/tp."""
    for d in runs[cfg["name"]]:
        dp = d["dp"] if cfg.get("fsdp") else 1  # zero keeps the parameters whole over dp
        whole = d["sharding"]["whole_tp_bytes"]  # cut over tp only
        assert d["tp_sharded_bytes"] > 0
        assert d["tp_sharded_bytes"] * cfg["tp"] * dp == d["tp_whole_bytes"] + whole * (dp - 1)
        assert d["local_layers"] == d["expected_layers"]
    left_whole = [d["rank"] for d in runs[cfg["name"]] if d["sharding"]["whole_tp_bytes"]]
    # zbv's first pipeline rank (ranks 0-3 of pp2 x dp2 x tp2) holds the tie in two chunks
    assert left_whole == ([0, 1, 2, 3] if cfg.get("fsdp") and cfg.get("schedule") else [])


@pytest.mark.parametrize(
    "sp,plain",
    [
        ("tp2_sp_1f1b", "tp2_1f1b"),
        ("tp2_sp_zbv", "tp2_zbv"),
        ("tp2_dp2_sp_fsdp_zbv", "tp2_dp2_fsdp_zbv"),
    ],
)
def test_sequence_parallel_cuts_every_stage_boundary_along_the_sequence(runs, sp, plain):
    """Measured at each layer's input during training: under sequence parallelism every block
    and the head get ``T / tp`` positions (what the previous layer, or the previous stage's
    P2P message, handed over), the embedding the whole batch of tokens; without it, ``T``."""
    for a, b in zip(runs[sp], runs[plain]):
        assert a["layer_inputs"].keys() == b["layer_inputs"].keys() and a["layer_inputs"]
        for index, shape in a["layer_inputs"].items():
            whole = b["layer_inputs"][index]
            assert shape[0] == whole[0] and shape[2:] == whole[2:], (sp, index, shape, whole)
            assert shape[1] * 2 == whole[1], (sp, a["rank"], index, shape, whole)


def test_sequence_parallel_saves_less_for_backward(runs):
    """ActivationMemoryMonitor (autograd's saved tensors, counted from their storages; a
    DTensor by its local part) on the last step: each rank of the sequence-parallel run saves
    less than the same rank without it (the norms' inputs, the residual stream and the stage
    boundary are T / tp positions); both are measured, so neither can be zero."""
    for a, b in zip(runs["tp2_sp_1f1b"], runs["tp2_1f1b"]):
        assert 0 < a["saved_bytes"] < b["saved_bytes"], (
            a["rank"],
            a["saved_bytes"],
            b["saved_bytes"],
        )


def _meta_tp_layers(cfg: dict) -> tuple[Any, list, list]:
    """``cfg``'s DecoderLM on the meta device, its layers' tp styles and the tp-local layers
    one tp rank holds (what ``lightning-pp plan`` measures)."""
    from pp_common import MODEL_KW

    from lightning_pp.models.decoder import DecoderLM
    from lightning_pp.planner.meta_profile import meta_layers
    from lightning_pp.planner.tensor_parallel import local_layers, record_tp_styles

    with torch.device("meta"):
        model = DecoderLM(**MODEL_KW, sequence_parallel=cfg["model"] == "decoder-sp")
        model.configure_model()
    layers = meta_layers(model)
    styles = record_tp_styles(model, layers, cfg["tp"])
    assert styles is not None
    return model, styles, local_layers(layers, styles, cfg["tp"])


def _plan_of(cfg: dict, world_size: int, num_layers: int) -> PipelinePlan:
    return PipelinePlan.build(
        pp=cfg["pp"],
        vpp=cfg.get("vpp"),
        schedule=cfg.get("schedule"),
        world_size=world_size,
        tp=cfg["tp"],
        microbatches=cfg["microbatches"],
        num_layers=num_layers,
        fsdp=cfg.get("fsdp", False),
        zero=cfg.get("zero", 0),
    )


@pytest.mark.parametrize(
    "name",
    [
        "tp2_1f1b",
        "tp2_dp2_interleaved",
        "tp2_dp2_fsdp_1f1b",
        "tp2_dp2_fsdp_zbv",
        "tp2_dp2_zero1_1f1b",
        "tp2_dp2_zero2_zbv",
    ],
)
def test_the_plans_tp_prediction_is_within_2_percent_of_the_measured_bytes(runs, name):
    """What ``lightning-pp plan`` predicts for one tp rank (the state formulas of
    planner.sharding on the tp-local layer shapes the meta model gives,
    planner.tensor_parallel.local_layers) against what ModelStateMemoryMonitor measured from
    the tensors after the optimizer step, on every rank: parameters, gradients, master weights
    and optimizer state, each within 2 %; under fsdp each tp share sharded again over dp,
    under zero its moments (and with zero=2 its gradients) cut into rows over dp. Under zbv
    the tied embedding and head are one tensor on pipeline rank 0 (counted once; left whole
    by FSDP2)."""
    from pp_common import state_bytes_off

    from lightning_pp.planner.meta_profile import layers_tensor_shapes, tied_groups

    cfg = next(c for c in WORLD4 + WORLD8 if c["name"] == name)
    model, _, local = _meta_tp_layers(cfg)
    shapes = layers_tensor_shapes(local, tied_groups(model))
    ranks = runs[name]
    plan = _plan_of(cfg, len(ranks), len(local))
    assert state_bytes_off(plan, shapes, ranks) == [], name


@pytest.mark.parametrize("name", ["tp2_1f1b", "tp2_sp_1f1b"])
def test_the_plans_activation_prediction_is_the_measured_saved_bytes(runs, name):
    """What ``lightning-pp plan`` predicts for one tp rank's activations (the meta measurement
    of the tp-local layers, 1F1B's in-flight microbatches; under sequence parallelism the
    stage boundary and what the norms save at ``T / tp``, planner.tensor_parallel
    .sequence_saved_bytes) against the peak ActivationMemoryMonitor measured from the saved
    tensors' storages, on every rank: equal, byte for byte."""
    from pp_common import BLOCK, GLOBAL_BATCH

    from lightning_pp.planner.meta_profile import layers_tensor_shapes, tied_groups
    from lightning_pp.planner.plan_memory import plan_memory
    from lightning_pp.planner.sharding import Sharding, StateBytes
    from lightning_pp.planner.tensor_parallel import local_layer_costs

    cfg = next(c for c in WORLD4 if c["name"] == name)
    model, styles, local = _meta_tp_layers(cfg)
    tokens = torch.zeros(GLOBAL_BATCH // cfg["microbatches"], BLOCK, dtype=torch.long)
    costs = local_layer_costs(local, styles, cfg["tp"], tokens.to("meta"))
    plan = _plan_of(cfg, len(runs[name]), len(local))
    tensors = layers_tensor_shapes(local, tied_groups(model))
    predicted = [
        r.activations for r in plan_memory(plan, tensors, costs, StateBytes(), Sharding()).ranks
    ]
    for d in runs[name]:
        assert d["saved_bytes"] == predicted[d["pp_rank"]], (name, d["rank"], predicted)


# ---------------------------------------------------------------------------- split= (HF)
@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("tp_hf")
    argv = ["--out", str(out), "--configs", json.dumps(HF_RUNS)]
    world("trainer", 4).run(script_main, "split_run", argv, timeout=600)
    return {
        c["name"]: [json.loads((out / f"{c['name']}.rank{r}.json").read_text()) for r in range(4)]
        for c in HF_RUNS
    }


@pytest.mark.parametrize("cfg", HF_RUNS, ids=[c["name"] for c in HF_RUNS])
def test_unmodified_hf_models_with_their_own_tp_plan_match(hf_runs, cfg):
    """``tp_plan="auto"``: the model's own plan on the modules each rank holds (a dict: that
    plan instead); losses equal the plain Trainer's, and the tp ranks of a stage hold the plain
    model's keys for it."""
    from split_common import CausalLM
    from split_common import run_reference as split_reference

    from lightning_pp.autosplit import meta_build

    ref = split_reference({k: v for k, v in cfg.items() if k not in ("tp", "tp_plan")})
    ranks = hf_runs[cfg["name"]]
    for d in ranks:
        assert max(rel_errors(d["train"], ref["train"])) <= REL_TOL, d["rank"]
        assert max(rel_errors(d["val"], ref["val"])) <= REL_TOL, d["rank"]
    own = cfg["tp_plan"] != "auto"
    for d in ranks:  # what was cut: the plan's modules, and only them
        assert d["sharded"] and all(("self_attn" in n) or not own for n in d["sharded"])
        assert any("mlp" in n for n in d["sharded"]) != own
    plain = sorted(meta_build(lambda: CausalLM(cfg["model"], "init")).model.state_dict())
    for tp_rank in (0, 1):  # ranks 0, 2 (tp 0) and 1, 3 (tp 1): each a partition of the keys
        keys = [k for d in ranks[tp_rank::2] for k in d["keys"]]
        assert sorted(keys) == plain


HF_SHARDED = [
    {"name": "llama_tp2_dp2_fsdp", "model": "llama", **HF, "tp": 2, "tp_plan": "auto",
     "fsdp": True},
    {"name": "llama_tp2_dp2_zero1", "model": "llama", **HF, "tp": 2, "tp_plan": "auto",
     "zero": 1},
]  # fmt: skip


def test_an_unmodified_hf_model_trains_under_fsdp_or_zero_times_tp(tmp_path):
    """Llama with its own tp plan at pp2 x dp2 x tp2 with FSDP2 over each tp shard, and with
    the distributed optimizer's rows of each tp shard (8 ranks): the plain Trainer's losses
    (1e-5) on every rank."""
    from split_common import run_reference as split_reference

    argv = ["--out", str(tmp_path), "--configs", json.dumps(HF_SHARDED)]
    world("trainer", 8).run(script_main, "split_run", argv, timeout=600)
    plain = {k: v for k, v in HF_SHARDED[0].items() if k not in ("tp", "tp_plan", "fsdp")}
    ref = split_reference(plain)
    for cfg in HF_SHARDED:
        for r in range(8):
            d = json.loads((tmp_path / f"{cfg['name']}.rank{r}.json").read_text())
            assert max(rel_errors(d["train"], ref["train"])) <= REL_TOL, (cfg["name"], r)
            assert max(rel_errors(d["val"], ref["val"])) <= REL_TOL, (cfg["name"], r)


# ---------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def ckpt_runs(tmp_path_factory) -> Path:
    """pp2 x tp2 saves at step 5 and resumes at four shapes; pp2 x dp2 saves and resumes at
    pp2 x tp2; the plain single-process run is the reference."""
    out = tmp_path_factory.mktemp("tp_ckpt")
    tp_dir, dp_dir = out / "tp_ckpt", out / "dp_ckpt"
    tp5, dp5 = str(tp_dir / "step=5.ckpt"), str(dp_dir / "step=5.ckpt")
    dec = {"model": "decoder", "microbatches": 2}
    save = {"max_steps": 5, "every": 5}
    phases = [
        {"name": "tp_save", "pp": 2, "tp": 2, **dec, **save, "ckpt_dir": str(tp_dir)},
        {"name": "tp_resume", "pp": 2, "tp": 2, **dec, "max_steps": 10, "resume": tp5},
        {"name": "tp_to_dp2", "pp": 2, **dec, "max_steps": 10, "resume": tp5},
        {"name": "tp_to_pp4", "pp": 4, **dec, "max_steps": 10, "resume": tp5},
        {"name": "dp_save", "pp": 2, **dec, **save, "ckpt_dir": str(dp_dir)},
        {"name": "dp_to_tp2", "pp": 2, "tp": 2, **dec, "max_steps": 10, "resume": dp5},
    ]
    (out / "w").mkdir()
    argv = ["--out", str(out / "w"), "--phases", json.dumps(phases)]
    world("trainer", 4).run(script_main, "ckpt_run", argv, timeout=500)
    _plain_phases(out, "tp_to_plain", tp5)
    return out


def _plain_phases(out: Path, name: str, resume: str) -> None:
    """In this process: the plain Trainer's whole run (``plain_full``) and ``name``, a plain
    Trainer resuming the pipelined checkpoint ``resume``."""
    from ckpt_run import run_phase

    torch.set_num_threads(1)
    (out / "p").mkdir()
    run_phase(
        {"name": "plain_full", "pp": 0, "model": "decoder", "max_steps": 10}, str(out / "p"), 1
    )
    plain = {"name": name, "pp": 0, "model": "decoder", "max_steps": 10, "resume": resume}
    run_phase({**plain, "pipeline_io": True}, str(out / "p"), 1)


def _ck(out: Path, group: str, name: str, size: int) -> list[dict]:
    return [json.loads((out / group / f"{name}.rank{r}.json").read_text()) for r in range(size)]


@pytest.mark.parametrize(
    "name,group,size",
    [
        ("tp_resume", "w", 4),
        ("tp_to_dp2", "w", 4),
        ("tp_to_pp4", "w", 4),
        ("dp_to_tp2", "w", 4),
        ("tp_to_plain", "p", 1),
    ],
)
def test_a_tensor_parallel_checkpoint_resumes_at_any_shape(ckpt_runs, name, group, size):
    """Steps 6-10 after loading the step-5 checkpoint equal the uninterrupted plain run's: the
    DTensor shards were saved by name at the whole shape and are cut anew on loading (tp2 ->
    tp1, tp1 -> tp2, pp2 -> pp4, a plain Trainer)."""
    full = _ck(ckpt_runs, "p", "plain_full", 1)[0]
    for saved in ("tp_save", "dp_save"):
        for d in _ck(ckpt_runs, "w", saved, 4):
            assert max(rel_errors(d["train_loss"], full["train_loss"][:5])) <= REL_TOL
    for d in _ck(ckpt_runs, group, name, size):
        assert max(rel_errors(d["train_loss"], full["train_loss"][5:])) <= RESHARD_TOL, name
        assert d["lr"] == full["lr"][5:]
        assert d["global_step"] == 10


@pytest.mark.parametrize("name", ["tp_resume", "dp_to_tp2"])
def test_a_tensor_parallel_resume_reads_only_each_ranks_shard_of_the_moments(ckpt_runs, name):
    """At tp2 each rank asks DCP for its own shard of every tensor-parallel parameter and moment
    (read into a DTensor laid out as the parameter), whether the checkpoint was written at tp2
    or whole at pp2 x dp2: half of it, counted by the reader every load goes through. The plain
    Trainer's resume reads each whole (the counter's check). The tensor-parallel tensors are
    those the tp2 save wrote as two chunks."""
    import math

    from lightning_pp.checkpoint.dcp_safe import read_dcp_metadata

    meta = read_dcp_metadata(ckpt_runs / "tp_ckpt" / "step=5.ckpt" / ".metadata")
    cut = {
        k: math.prod(v.size)
        for k, v in meta.state_dict_metadata.items()
        if len(getattr(v, "chunks", ())) == 2  # parameters and moments
    }
    assert any(k.startswith("optimizer_0.state.") for k in cut)
    assert any(k.startswith("state_dict.") for k in cut)
    assert cut
    for d in _ck(ckpt_runs, "w", name, 4):
        got = {k: n for k, n in d["read_elements"].items() if k in cut}
        assert got, f"rank {d['rank']} read no tensor-parallel tensor"
        assert all(2 * n == cut[k] for k, n in got.items()), (name, d["rank"], got)
    plain = _ck(ckpt_runs, "p", "tp_to_plain", 1)[0]
    assert {k: n for k, n in plain["read_elements"].items() if k in cut} == cut


#: the 2-D shardings a checkpoint is written under at pp2 x dp2 x tp2, and the other one
SHARDED = {"fsdp": ({"fsdp": True}, {"zero": 1}), "zero": ({"zero": 1}, {"fsdp": True})}


@pytest.fixture(scope="module", params=list(SHARDED))
def sharded_ckpt_runs(request, tmp_path_factory) -> tuple[str, Path]:
    """pp2 x dp2 x tp2 under fsdp (FSDP2 over each tp shard) or zero=1 (rows of each tp shard)
    saves at step 5 (8 ranks) and resumes at its own shape, under the other sharding, at tp2
    without sharding, at dp4 without tp and in a plain Trainer."""
    how, other = SHARDED[request.param]
    out = tmp_path_factory.mktemp(f"{request.param}_tp_ckpt")
    ck = out / "ck"
    step5 = str(ck / "step=5.ckpt")
    dec = {"model": "decoder", "microbatches": 2}
    resume = {"max_steps": 10, "resume": step5}
    phases = [
        {"name": "save", "pp": 2, "tp": 2, **how, **dec, "max_steps": 5, "every": 5,
         "ckpt_dir": str(ck)},
        {"name": "resume", "pp": 2, "tp": 2, **how, **dec, **resume},
        {"name": "to_other", "pp": 2, "tp": 2, **other, **dec, **resume},
        {"name": "to_tp2", "pp": 2, "tp": 2, **dec, **resume},
        {"name": "to_tp1", "pp": 2, **how, **dec, **resume},
    ]  # fmt: skip
    (out / "w").mkdir()
    argv = ["--out", str(out / "w"), "--phases", json.dumps(phases)]
    world("trainer", 8).run(script_main, "ckpt_run", argv, timeout=600)
    _plain_phases(out, "to_plain", step5)
    return request.param, out


@pytest.mark.parametrize(
    "name,group,size",
    [
        ("resume", "w", 8),
        ("to_other", "w", 8),
        ("to_tp2", "w", 8),
        ("to_tp1", "w", 8),
        ("to_plain", "p", 1),
    ],
)
def test_a_sharded_tensor_parallel_checkpoint_resumes_at_any_shape(
    sharded_ckpt_runs, name, group, size
):
    """Written with 2-D shards (FSDP2 over each tensor-parallel shard, or the distributed
    optimizer's rows of it), read back at the same shape, under the other sharding, with one
    of the two cuts dropped, and whole: steps 6-10 equal the uninterrupted plain run's; at its
    own shape each rank reads a quarter of every tensor cut both ways (under zero: the
    moments; the parameters are cut over tp only)."""
    import math

    from lightning_pp.checkpoint.dcp_safe import read_dcp_metadata

    sharding, out = sharded_ckpt_runs
    full = _ck(out, "p", "plain_full", 1)[0]
    for d in _ck(out, "w", "save", 8):
        assert max(rel_errors(d["train_loss"], full["train_loss"][:5])) <= REL_TOL
    for d in _ck(out, group, name, size):
        assert max(rel_errors(d["train_loss"], full["train_loss"][5:])) <= RESHARD_TOL, name
        assert d["lr"] == full["lr"][5:]
        assert d["global_step"] == 10
    if name != "resume":
        return
    meta = read_dcp_metadata(out / "ck" / "step=5.ckpt" / ".metadata")
    cut = {
        k: math.prod(v.size)
        for k, v in meta.state_dict_metadata.items()
        if len(getattr(v, "chunks", ())) == 4  # cut over dp and tp
    }
    assert any(k.startswith("optimizer_0.state.") for k in cut) and cut
    if sharding == "zero":
        assert not any(k.startswith("state_dict.") for k in cut), sorted(cut)
    for d in _ck(out, "w", name, 8):
        got = {k: n for k, n in d["read_elements"].items() if k in cut}
        assert got and all(4 * n == cut[k] for k, n in got.items()), (d["rank"], got)


def _zero_rows_case(rank: int, size: int) -> dict:
    """pp1 x dp2 x tp2 on gloo: a distributed optimizer over tensor-parallel parameters of every
    kind (column-wise ``Shard(0)`` with uneven rows inside its tp shard, row-wise ``Shard(1)``
    with uneven rows, ``Replicate``, a plain tensor, a scalar). Each rank's rows as the
    checkpoint sees them (:meth:`ShardedGradSync.as_dtensor`), gathered whole, against the
    tensor the parameter was cut from; and which rows the clipping's norm leaves out."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_pp.runtime.distributed_optimizer import ShardedGradSync
    from lightning_pp.runtime.grad_sync import TiedParameterSync

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    tp_mesh = mesh["tensor_parallel"]
    torch.manual_seed(0)  # the same wholes on every rank
    wholes = {
        "col": torch.randn(6, 4),  # tp rows 3 each, over dp: 2 and 1
        "row": torch.randn(5, 6),  # dp rows 3 and 2, columns 3 per tp rank
        "rep": torch.randn(5),
        "plain": torch.randn(3, 2),
        "scalar": torch.randn(()),
    }
    cuts = {"col": [Shard(0)], "row": [Shard(1)], "rep": [Replicate()]}
    params = {
        k: nn.Parameter(distribute_tensor(v, tp_mesh, cuts[k]) if k in cuts else v.clone())
        for k, v in wholes.items()
    }
    sync = ShardedGradSync(
        [list(params.values())],
        mesh["data_parallel"].get_group(),
        dp_size=2,
        dp_rank=mesh.get_local_rank(0),
        zero=1,
        mesh=mesh,
    )
    equal = {}
    for k, p in params.items():
        main = sync.main.get(id(p))
        rows = None if main is None else main.detach()
        whole = sync.as_dtensor(id(p), rows).full_tensor()
        equal[k] = torch.equal(whole.reshape(wholes[k].shape), wholes[k])
    names = {id(sync.main[id(p)]): k for k, p in params.items() if id(p) in sync.main}
    skipped = sorted(names[i] for i in sync.grad_norm_skip(TiedParameterSync([])))
    return {
        "dp_rank": mesh.get_local_rank(0),
        "tp_rank": mesh.get_local_rank(1),
        "equal": equal,
        "skipped": skipped,
    }


def test_zero_rows_of_tensor_parallel_parameters_are_whole_tensors_to_a_checkpoint():
    got = world("gloo", 4).run(_zero_rows_case, timeout=120)
    for r in got:
        assert all(r["equal"].values()), r
        # rows both tp ranks hold (a Replicate weight, a plain tensor) count on tp rank 0 only;
        # the scalar's one row lies on dp rank 0; the cut weights' rows count everywhere
        want = {"rep", "plain", "scalar"} if r["dp_rank"] == 0 else {"rep", "plain"}
        assert r["skipped"] == (sorted(want) if r["tp_rank"] == 1 else []), r


def _tied_cuts(rank: int, size: int, dims: tuple[int, int]) -> list:
    """Ranks 0-1 (pipeline rank 0) hold the embedding cut as ``Shard(dims[0])`` over their tp
    pair, ranks 2-3 the head as ``Shard(dims[1])``; a second tied weight is held whole by ranks
    0 and 2 only. Returns the error each rank raised (or ``None``)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_pp.runtime.grad_sync import check_tied_cuts

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    w = torch.arange(64.0).reshape(8, 8)  # square: both cuts have 32 local elements
    weight = nn.Parameter(distribute_tensor(w, mesh["tp"], [Shard(dims[rank // 2])]))
    bias = torch.zeros(3) if rank in (0, 2) else None
    try:
        check_tied_cuts([(("embed.weight", "head.weight"), weight), (("a", "b"), bias)])
    except ValueError as e:
        return [str(e)]
    return [None]


def test_tied_copies_cut_differently_are_refused_on_every_rank():
    """A plan that cuts a tied embedding by rows and its head by columns: the local parts have
    the same size (the tied-gradient all-reduce would add unrelated elements without a word),
    so every rank refuses it at set-up, naming both cuts. Copies cut alike pass."""
    refused = world("gloo", 4).run(_tied_cuts, (0, 1), timeout=60)
    for (text,) in refused:
        assert text is not None and "embed.weight / head.weight" in text, refused
        assert "rank 0: Shard(0) over 2 ranks of (8, 8), local (4, 8)" in text
        assert "rank 2: Shard(1) over 2 ranks of (8, 8), local (8, 4)" in text
        assert "a / b" not in text  # held whole by its two holders: alike
    assert world("gloo", 4).run(_tied_cuts, (0, 0), timeout=60) == [[None]] * 4


# ---------------------------------------------------------------------------- the rules
@pytest.mark.quick
def test_the_world_must_be_pp_times_dp_times_tp():
    plan = PipelinePlan.build(pp=2, tp=2, world_size=8)
    assert (plan.dp, plan.tp) == (2, 2)
    assert "x tp=2" in plan.describe()[0]
    with pytest.raises(
        PreflightError, match=r"pp\(3\) \* tp\(2\) does not divide the world size 8"
    ):
        PipelinePlan.build(pp=3, tp=2, world_size=8)
    with pytest.raises(PreflightError, match=r"pp must be one of \[1, 2, 4\]"):
        PipelinePlan.build(pp=3, tp=2, world_size=8)
    with pytest.raises(PreflightError, match="tp must be a positive integer"):
        PipelinePlan.build(pp=2, tp=0, world_size=8)


@pytest.mark.quick
@pytest.mark.parametrize("sharding", [{"zero": 1}, {"zero": 2}, {"fsdp": True}])
def test_every_data_parallel_sharding_composes_with_tensor_parallel(sharding):
    plan = PipelinePlan.build(pp=2, tp=2, world_size=8, **sharding)
    assert (plan.dp, plan.tp, plan.zero, plan.fsdp) == (
        2,
        2,
        sharding.get("zero", 0),
        sharding.get("fsdp", False),
    )
    with pytest.raises(PreflightError, match="FSDP2 already shards"):
        PipelinePlan.build(pp=2, tp=2, world_size=8, zero=1, fsdp=True)


@pytest.mark.quick
def test_strategy_settings_are_checked_at_construction():
    from lightning_pp import PipelineStrategy

    with pytest.raises(PreflightError, match="tp_plan applies to split= models"):
        PipelineStrategy(pp=2, tp=2, tp_plan="auto")
    with pytest.raises(PreflightError, match="tp_plan must be 'auto'"):
        PipelineStrategy(pp=2, tp=2, split="model.layers", tp_plan="colwise")
    PipelineStrategy(pp=2, tp=2, zero=2)  # the distributed optimizer composes with tp


@pytest.mark.quick
def test_hf_sizes_tp_does_not_divide_are_named():
    from transformers import LlamaConfig

    from lightning_pp.strategy.tensor_parallel import check_hf_sizes

    ok = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    check_hf_sizes(ok, 2)
    bad = LlamaConfig(
        vocab_size=50257, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
    )
    with pytest.raises(PreflightError, match=r"kv_heads=2, vocab=50257.*pad the vocabulary"):
        check_hf_sizes(bad, 4)


@pytest.mark.quick
def test_a_model_without_the_hook_is_told_what_to_implement():
    from lightning_pp.models import GPT

    with pytest.raises(NotImplementedError, match="implement pipeline_tensor_parallel"):
        GPT().pipeline_tensor_parallel(torch.nn.Linear(2, 2), 0, object())


@pytest.mark.quick
def test_decoder_heads_must_divide_by_tp():
    from lightning_pp.models import DecoderLM

    class Mesh:
        def size(self) -> int:
            return 4

    model = DecoderLM(n_head=2, n_embd=16, n_layer=1)
    model.configure_model()
    with pytest.raises(ValueError, match=r"n_head\(2\) is not divisible by tp\(4\)"):
        model.pipeline_tensor_parallel(model.layers[1], 1, Mesh())


def test_sequence_parallel_refuses_a_length_tp_does_not_divide():
    """An uneven cut of the sequence would make the tp ranks' collectives disagree on their
    sizes (gloo aborts mid-step, NCCL may hang): refused at the embedding, with the numbers."""
    from lightning_pp.models.decoder import check_sequence_length

    check_sequence_length(torch.zeros(2, 12, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"sequence length 10 .* \(10 % 4 = 2\)"):
        check_sequence_length(torch.zeros(2, 10, dtype=torch.long), 4)
