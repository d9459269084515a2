"""PipelinePlan and its rules: one test per error (message names the numbers and the fix),
the warnings, the plan's refinement steps and its description.

Pure: no process group, no Trainer. Runs in well under a second.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pp.layout.plan import PipelinePlan
from lightning_pp.layout.rules import (
    PipelineWarning,
    PreflightError,
    bubble_warning,
    check_batch,
    check_layers,
    check_schedule_args,
    check_world,
)
from lightning_pp.schedules import build_schedule, validate
from lightning_pp.strategy.model import PipelineLayers, PipelineMixin
from lightning_pp.strategy.module_rules import check_module

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def _no_pipeline_warning(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipelineWarning)
        return fn(*args, **kwargs)


# ---- world size -------------------------------------------------------------------------------


def test_world_not_divisible_by_pp_names_numbers_and_divisors():
    with pytest.raises(PreflightError) as info:
        check_world(6, pp=4)
    msg = str(info.value)
    assert "world size 6 is not divisible by pp=4" in msg
    assert "world_size % pp = 2" in msg
    assert "[1, 2, 3, 6]" in msg  # the pp values that would work


def test_pp_larger_than_world():
    with pytest.raises(PreflightError, match=r"pp=8 pipeline stages need at least 8 processes"):
        check_world(4, pp=8)


def test_explicit_dp_that_does_not_multiply_to_world():
    with pytest.raises(PreflightError) as info:
        check_world(8, pp=2, dp=3)
    msg = str(info.value)
    assert "pp(2) * dp(3) = 6 != world size 8" in msg and "set dp=4" in msg


def test_world_ok_returns_dp():
    assert check_world(8, pp=4) == 2
    assert check_world(8, pp=2, dp=4) == 4


# ---- layers -----------------------------------------------------------------------------------


def test_too_few_layers_shows_split_and_fix():
    with pytest.raises(PreflightError) as info:
        check_layers(6, pp=4, vpp=2)
    msg = str(info.value)
    assert "num_layers=6 into pp(4) * vpp(2) = 8" in msg
    assert "s0=0 s1=0 s2=1 s3=1 s4=1 s5=1 s6=1 s7=1" in msg  # the split that would result
    assert "use vpp=1 (pp*vpp=4)" in msg


def test_too_few_layers_even_for_vpp1():
    with pytest.raises(PreflightError, match=r"use pp <= 3"):
        check_layers(3, pp=4, vpp=1)


def test_zero_layers_is_a_module_without_pipeline_layers():
    with pytest.raises(PreflightError, match="no pipeline layers"):
        check_layers(0, pp=2)


def test_explicit_split_errors_pass_through_with_numbers():
    with pytest.raises(PreflightError, match=r"explicit split sums to 7 layers but the model has"):
        check_layers(8, pp=2, vpp=1, partition=[3, 4])


def test_layers_ok_returns_split():
    ranges = check_layers(10, pp=2, vpp=2)
    assert [len(r) for r in ranges] == [2, 2, 3, 3]


# ---- schedule ---------------------------------------------------------------------------------


def test_schedule_name_typo_did_you_mean():
    with pytest.raises(PreflightError) as info:
        check_schedule_args("interleave", pp=2, microbatches=4, vpp=2)
    assert "unknown schedule 'interleave'" in str(info.value)
    assert "Did you mean 'interleaved'?" in str(info.value)


def test_vpp_with_1f1b_cannot_interleave():
    with pytest.raises(PreflightError) as info:
        check_schedule_args("1f1b", pp=4, microbatches=8, vpp=2)
    msg = str(info.value)
    assert "'1f1b' cannot interleave" in msg and "vpp=2" in msg
    assert "schedule='interleaved' (pp=4, vpp=2)" in msg


def test_interleaved_microbatches_below_pp_uses_generator_rule():
    # microbatches vs vpp/pp: the interleaved generator's own error, not a copy of its rule
    with pytest.raises(ValueError) as info:
        check_schedule_args("interleaved", pp=4, microbatches=2, vpp=2)
    assert "microbatches >= pp: got microbatches=2 < pp=4" in str(info.value)
    assert "raise microbatches to at least 4" in str(info.value)


def test_interleaved_group_remainder_rule():
    with pytest.raises(ValueError, match=r"microbatches % N = 5 % 4 = 1 < pp=4"):
        check_schedule_args("interleaved", pp=4, microbatches=5, vpp=2, group_size=4)


def test_interleaved_needs_vpp2():
    with pytest.raises(ValueError, match=r"needs vpp >= 2 chunks per rank, got vpp=1"):
        check_schedule_args("interleaved", pp=2, microbatches=4, vpp=1)


def test_non_positive_sizes():
    with pytest.raises(PreflightError, match=r"microbatches must be a positive integer, got 0"):
        check_schedule_args("1f1b", pp=2, microbatches=0)
    with pytest.raises(PreflightError, match=r"vpp must be a positive integer, got -1"):
        check_schedule_args(None, pp=2, vpp=-1)


def test_defaults_pick_schedule_and_microbatches():
    s = _no_pipeline_warning(check_schedule_args, None, pp=4)
    assert (s.name, s.microbatches) == ("1f1b", 4)
    s = _no_pipeline_warning(check_schedule_args, None, pp=2, vpp=2)
    assert (s.name, s.microbatches, s.vpp) == ("interleaved", 2, 2)


def test_fewer_microbatches_than_pp_is_a_warning_with_the_bubble():
    with pytest.warns(PipelineWarning) as rec:
        s = check_schedule_args("1f1b", pp=4, microbatches=2)
    validate(s)  # accepted: it runs (Megatron allows m < pp too)
    msg = str(rec[0].message)
    assert "microbatches=2 < pp=4" in msg
    assert "(pp-1)/m = 3/2" in msg
    assert "1.50x its compute time" in msg  # the simulator agrees with the formula here
    assert "microbatches=8 gives 0.38x" in msg


def test_bubble_warning_absent_when_pipeline_fills():
    assert bubble_warning(build_schedule("1f1b", 4, 4)) is None
    assert bubble_warning(build_schedule("gpipe", 1, 1)) is None


# ---- batch ------------------------------------------------------------------------------------


def test_batch_smaller_than_microbatches():
    with pytest.raises(PreflightError) as info:
        check_batch(3, microbatches=4)
    msg = str(info.value)
    assert "batch size 3 per replica is smaller than microbatches=4" in msg
    assert "lower microbatches to <= 3 or raise the batch size to >= 4" in msg


def test_global_batch_not_divisible_by_dp():
    with pytest.raises(PreflightError, match=r"global batch size 10 does not split over dp=4"):
        check_batch(None, microbatches=2, dp=4, global_batch_size=10)


def test_global_batch_per_replica_below_microbatches():
    with pytest.raises(PreflightError) as info:
        check_batch(None, microbatches=4, dp=4, global_batch_size=8)
    msg = str(info.value)
    assert "global batch 8 / dp(4) = 2 per replica is smaller than microbatches=4" in msg
    assert "global batch >= 16" in msg


def test_global_and_per_replica_batch_disagree():
    with pytest.raises(PreflightError, match=r"= 4 per replica, but the per-replica batch_size"):
        check_batch(3, microbatches=2, dp=2, global_batch_size=8)


# ---- module -----------------------------------------------------------------------------------


class _Plain(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 2)


class _NoConfigure(PipelineMixin, L.LightningModule):
    def pipeline_input(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return output.sum()


class _NoLoss(PipelineMixin, L.LightningModule):
    def configure_model(self):
        self.layers = PipelineLayers([lambda: nn.Linear(2, 2)] * 2)

    def pipeline_input(self, batch):
        return batch[0]


class _Good(_NoConfigure):
    def configure_model(self):
        self.layers = PipelineLayers([lambda: nn.Linear(2, 2)] * 2)


def test_module_without_pipeline_hooks():
    with pytest.raises(PreflightError) as info:
        check_module(_Plain())
    msg = str(info.value)
    assert "_Plain lacks pipeline_layers(), pipeline_input(), pipeline_loss()" in msg
    assert "Subclass lightning_pp.PipelineMixin" in msg


def test_module_hook_left_unimplemented():
    with pytest.raises(PreflightError, match=r"_NoLoss must implement pipeline_loss\(output"):
        check_module(_NoLoss(), configured=False)


def test_configure_model_missing():
    with pytest.raises(PreflightError) as info:
        check_module(_NoConfigure(), configured=False)
    msg = str(info.value)
    assert "_NoConfigure defines no configure_model() and holds no PipelineLayers" in msg
    assert "def configure_model(self):" in msg


def test_module_without_layers_after_configure():
    with pytest.raises(PreflightError, match=r"_NoConfigure has no pipeline layers after"):
        check_module(_NoConfigure(), configured=True)


def test_good_module_passes_both_phases():
    m = _Good()
    check_module(m, configured=False)
    m.configure_model()
    check_module(m, configured=True)
    assert m.layers.num_layers == 2


# ---- the plan -------------------------------------------------------------------------------


def test_build_resolves_everything():
    plan = _no_pipeline_warning(
        PipelinePlan.build,
        world_size=8,
        pp=4,
        vpp=2,
        microbatches=8,
        num_layers=18,
        batch_size=8,
    )
    assert (plan.dp, plan.schedule.name, plan.microbatches) == (2, "interleaved", 8)
    assert plan.split_text == "s0=2 s1=2 s2=2 s3=2 s4=2 s5=2 s6=3 s7=3"
    assert plan.warnings == ()
    assert plan.num_stages == 8 and plan.num_layers == 18


def test_plan_is_frozen():
    import dataclasses

    plan = _no_pipeline_warning(PipelinePlan.build, pp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pp = 3  # type: ignore[misc]


def test_build_collects_the_bubble_warning():
    with pytest.warns(PipelineWarning):
        plan = PipelinePlan.build(pp=4, microbatches=3)
    assert len(plan.warnings) == 1 and "microbatches=3 < pp=4" in plan.warnings[0]
    with warnings.catch_warnings():  # warn=False: kept on the plan, not emitted
        warnings.simplefilter("error", PipelineWarning)
        assert PipelinePlan.build(pp=4, microbatches=3, warn=False).warnings == plan.warnings


def test_build_checks_batch_against_resolved_microbatches():
    # microbatches=None means pp: 4 microbatches need 4 samples per replica
    with pytest.raises(PreflightError, match=r"batch size 2 per replica .* microbatches=4") as e:
        PipelinePlan.build(pp=4, world_size=8, batch_size=2)
    assert e.value.key == "batch_size"


def test_uneven_batch_split_is_accepted():
    # the engine splits 10 samples into 4 microbatches of 3, 3, 2, 2 exactly
    plan = _no_pipeline_warning(PipelinePlan.build, pp=2, microbatches=4, batch_size=10)
    plan.check_batch(10)
    assert plan.microbatch_sizes(10) == [3, 3, 2, 2]
    assert "10 per data-parallel replica = 4 microbatches of 2-3" in "\n".join(plan.describe())


def test_defaults_are_written_once():
    plan = _no_pipeline_warning(PipelinePlan.build, pp=4)
    assert (plan.schedule.name, plan.microbatches) == ("1f1b", 4)
    plan = _no_pipeline_warning(PipelinePlan.build, pp=2, vpp=2)
    assert (plan.schedule.name, plan.microbatches) == ("interleaved", 2)


def test_pp_none_is_the_whole_world():
    plan = _no_pipeline_warning(PipelinePlan.build, world_size=4)
    assert (plan.pp, plan.dp, plan.microbatches) == (4, 1, 4)
    with pytest.raises(PreflightError, match="pp=None means one pipeline over the whole world"):
        PipelinePlan.build()


def test_refinement_steps_return_new_plans():
    plan = _no_pipeline_warning(PipelinePlan.build, pp=2, vpp=2, microbatches=4)
    assert plan.dp is None and plan.layer_ranges is None
    sized = plan.with_world(6)
    assert (sized.world_size, sized.dp) == (6, 3) and plan.dp is None
    with pytest.raises(PreflightError, match="world size 5 is not divisible by pp=2") as e:
        plan.with_world(5)
    assert e.value.key == "pp"
    layered = sized.with_layers(9)
    assert layered.split_text == "s0=2 s1=2 s2=2 s3=3"
    # chunk c of rank r runs stage c*pp + r (the schedule's loop placement)
    assert layered.stage_layers(0) == [range(0, 2), range(4, 6)]
    assert layered.stage_layers(1) == [range(2, 4), range(6, 9)]
    with pytest.raises(PreflightError, match="call with_layers"):
        sized.stage_layers(0)


def test_stage_layers_follow_the_schedule_placement():
    from types import SimpleNamespace

    plan = _no_pipeline_warning(PipelinePlan.build, pp=2, vpp=2, microbatches=4, num_layers=8)
    # a schedule with V placement (rank r holds stages r and 2p-1-r) moves the chunks with it
    v = SimpleNamespace(stages_of=lambda r: (r, 3 - r))
    import dataclasses

    vplan = dataclasses.replace(plan, schedule=v)
    assert vplan.stage_layers(0) == [range(0, 2), range(6, 8)]
    assert vplan.stage_layers(1) == [range(2, 4), range(4, 6)]


@pytest.mark.parametrize(
    "kwargs, key, needle",
    [
        ({"microbatches": 0}, "microbatches", "microbatches must be a positive integer, got 0"),
        ({"vpp": 0}, "vpp", "vpp must be a positive integer, got 0"),
        ({"partition": "foo"}, "partition", "unknown partition 'foo'; use one of ['uniform'"),
        ({"partition": "uniformm"}, "partition", "Did you mean 'uniform'?"),
        ({"partition": [1, "a"]}, "partition", "list of per-stage layer counts (integers)"),
        ({"watchdog_timeout": 0}, "watchdog_timeout", "positive number of seconds or None"),
        ({"watchdog_timeout": -3.0}, "watchdog_timeout", "got -3.0"),
        ({"bucket_cap_mb": -1}, "bucket_cap_mb", "bucket_cap_mb must be a positive number of"),
        ({"recv_lookahead": 0}, "recv_lookahead", "recv_lookahead must be a positive integer"),
        ({"accumulate_grad_batches": 0}, "accumulate_grad_batches", "got 0"),
        ({"world_size": 0}, "world_size", "world_size must be a positive integer, got 0"),
        ({"num_layers": 3}, "num_layers", "cannot cut num_layers=3 into pp(4)"),
        ({"partition": [1, 1, 1], "num_layers": 3}, "partition", "explicit split has 3 entries"),
        ({"batch_size": 0}, "batch_size", "batch_size must be a positive integer, got 0"),
        ({"schedule": "1f1bb"}, "schedule", "Did you mean '1f1b'?"),
    ],
)
def test_every_rule_names_its_key(kwargs, key, needle):
    with pytest.raises(PreflightError) as e:
        _no_pipeline_warning(PipelinePlan.build, **{"pp": 4, **kwargs})
    assert e.value.key == key and needle in str(e.value)


def test_limits_accept_none_and_positive_values():
    plan = _no_pipeline_warning(
        PipelinePlan.build, pp=2, watchdog_timeout=None, bucket_cap_mb=0.5, recv_lookahead=1
    )
    assert (plan.watchdog_timeout, plan.bucket_cap_mb, plan.recv_lookahead) == (None, 0.5, 1)


def test_generator_rules_become_preflight_errors():
    with pytest.raises(PreflightError) as e:
        PipelinePlan.build(pp=4, vpp=2, microbatches=6)
    assert "6 % 4 = 2 < pp=4" in str(e.value) and e.value.key == "schedule"


def test_error_pickles_for_the_spawn_launcher():
    import pickle

    err = pickle.loads(pickle.dumps(PreflightError("x", key="pp")))
    assert isinstance(err, PreflightError) and str(err) == "x"


def test_describe_states_shape_placement_partition_schedule_and_bubble():
    plan = _no_pipeline_warning(
        PipelinePlan.build,
        world_size=8,
        pp=2,
        vpp=2,
        microbatches=4,
        num_layers=8,
        batch_size=8,
        recv_lookahead=8,
        bucket_cap_mb=25.0,
    )
    text = "\n".join(plan.describe())
    assert "pipeline: pp=2 x dp=4 (world 8), vpp=2: 4 virtual stages, loop placement" in text
    assert "schedule: interleaved, 4 microbatches, group size 2; simulated bubble" in text
    assert "partition: uniform, 8 layers: s0=2 s1=2 s2=2 s3=2" in text
    assert "rank 0 chunk 1 (stage 2): layers 4-5" in text
    assert "rank 1 chunk 0 (stage 1): layers 2-3" in text
    assert "batch: 8 per data-parallel replica = 4 microbatches of 2" in text
    assert "global batch per optimizer step 32" in text
    assert "communication: recv_lookahead=8 bucket_cap_mb=25" in text
    named = "\n".join(
        plan.describe(layer_names=["Embedding"] + ["Block"] * 6 + ["Head"], layer_params=[5] * 8)
    )
    assert "rank 0 chunk 0 (stage 0): layers 0-1 (Embedding, Block)  10 params" in named
    assert "rank 0 total: 20 params" in named


def test_describe_without_world_or_layers():
    with pytest.warns(PipelineWarning):
        plan = PipelinePlan.build(pp=4, microbatches=2)
    lines = plan.describe()
    assert lines[0].startswith("pipeline: pp=4 x dp=? (world decided at run time)")
    assert any(line.startswith("warning: microbatches=2 < pp=4") for line in lines)


def test_build_module_check():
    with pytest.raises(PreflightError, match="_Plain lacks"):
        check_module(_Plain(), configured=False)


def test_engine_rejects_nothing_the_plan_accepts_on_one_process():
    # a sanity link between the plan and the engine: an accepted pp=1 plan runs
    from engine_models import make_chunks, mlp_batch, mlp_layers, mse_loss

    from lightning_pp.layout.topology import PipelineTopology
    from lightning_pp.runtime.engine import PipelineEngine

    plan = _no_pipeline_warning(
        PipelinePlan.build,
        pp=1,
        vpp=2,
        schedule="gpipe",
        microbatches=3,
        num_layers=8,
        batch_size=5,
    )
    topo = PipelineTopology(world_size=1, pp=1, dp=1, rank=0)
    chunks = make_chunks(mlp_layers(0), 1, 2, 0)
    engine = PipelineEngine(chunks, plan.schedule, topo, None, loss_fn=mse_loss("mean"))
    loss = engine.train_step(mlp_batch(0, 5)).loss
    assert torch.isfinite(loss)
