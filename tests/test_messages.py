"""Messages that misled (issue 35, item 5): each names the setting, the numbers and the fix.

In-process checks of the message text; the SIGTERM one is a job in tests/test_fault_jobs.py
(``test_sigterm_to_one_rank_names_that_rank``). Every CLI case here exits 2 before anything is
profiled or launched.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from torch import nn

from lightning_pp import PipelineMixin, PipelineStrategy
from lightning_pp.autosplit.split import SplitError
from lightning_pp.layout.partition import partition_layers
from lightning_pp.layout.plan import PipelinePlan
from lightning_pp.layout.rank_layout import RankLayout
from lightning_pp.layout.recompute_spec import parse_bytes
from lightning_pp.layout.rules import PreflightError, bubble_warning
from lightning_pp.planner import ModelProfile, SearchError, SearchSpace, search
from lightning_pp.planner.profile import LayerCost
from lightning_pp.schedules import build_schedule
from lightning_pp.strategy.process_group import _rank_list
from lightning_pp.strategy.split_build import SplitPipeline, split_mixin_message

pytestmark = pytest.mark.quick

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml")


# ---- partition=[...] ------------------------------------------------------------------------


def test_explicit_partition_errors_give_a_valid_partition():
    with pytest.raises(ValueError) as info:
        partition_layers(6, 2, 1, [1, 1])
    msg = str(info.value)
    assert "partition=[1, 1]" in msg and "sums to 2 layers" in msg and "num_layers=6" in msg
    assert "give 2 positive counts summing to 6 (e.g. [3, 3]" in msg
    with pytest.raises(ValueError, match=r"has 3 entries .* = 2 virtual stages.*e\.g\. \[3, 3\]"):
        partition_layers(6, 2, 1, [1, 2, 3])
    with pytest.raises(ValueError, match=r"at least one layer.*summing to 7 \(e\.g\. \[3, 4\]"):
        partition_layers(7, 2, 1, [7, 0])


def test_wrong_entry_count_is_refused_at_construction():
    # no model is needed to count the entries: the API refuses it before any process starts
    with pytest.raises(PreflightError) as info:
        PipelinePlan.build(pp=2, microbatches=2, partition=[1, 2, 3])
    assert info.value.key == "partition"
    msg = str(info.value)
    assert "partition=[1, 2, 3]: explicit split has 3 entries but pp(2) * vpp(1) = 2" in msg
    assert "give 2 per-stage layer counts" in msg
    with pytest.raises(PreflightError, match=r"pp\(2\) \* vpp\(2\) = 4 virtual stages"):
        PipelineStrategy(pp=2, vpp=2, schedule="interleaved", microbatches=4, partition=[3, 3])


# ---- split= -----------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.head = nn.Linear(4, 8)


class _Plain(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Net()


def test_split_with_cost_partition_names_the_fix_not_layer_costs():
    layout = RankLayout(PipelinePlan.build(pp=2, microbatches=2, partition="cost"))
    module = _Plain()
    with pytest.raises(SplitError) as info:
        SplitPipeline("model.blocks")._layout(layout, module, module)
    msg = str(info.value)
    assert "needs layer_costs" not in msg  # an argument no user of split= can pass
    assert "partition='cost' with split='model.blocks'" in msg
    assert "partition='parameters'" in msg and "partition='uniform'" in msg
    assert "4 blocks'" in msg and "pp(2) * vpp(1) = 2 stages" in msg and "[2, 2]" in msg


class _MixinList(PipelineMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])


class _MixinOwnStep(_MixinList):
    def training_step(self, batch, batch_idx):
        return self.layers[0](batch).sum()


def test_split_on_a_mixin_with_a_module_list_names_both_fixes():
    module = _MixinList()
    layout = RankLayout(PipelinePlan.build(pp=2, microbatches=2))
    with pytest.raises(SplitError) as info:
        SplitPipeline("layers")._layout(layout, module, module)
    msg = str(info.value)
    assert "split='layers'" in msg and "_MixinList is a PipelineMixin" in msg
    assert "layers is a ModuleList, not PipelineLayers" in msg
    assert "drop split= and build self.layers = PipelineLayers" in msg
    assert "without PipelineMixin" in msg and "its own training_step" in msg
    # not this case: a module whose own training_step runs, or no mixin at all
    assert split_mixin_message("layers", _MixinOwnStep()) is None
    assert split_mixin_message("model.blocks", _Plain()) is None


# ---- the bubble warning --------------------------------------------------------------------


def test_zbv_warning_uses_one_unit_and_no_interleaved_formula():
    msg = bubble_warning(build_schedule("zbv", 2, 1))
    assert msg is not None
    assert "microbatches=1 < pp=2" in msg and "idles 0.67x its compute time" in msg
    assert "(pp-1)/(vpp*m)" not in msg and "1/2" not in msg  # interleaved's formula, wrong here
    assert "simulated for schedule 'zbv'" in msg and "raise microbatches to at least 2" in msg
    # where the closed form is exact it is still shown, in the same unit
    msg = bubble_warning(build_schedule("gpipe", 4, 2)) or ""
    assert "idles 1.50x" in msg and "(bubble = (pp-1)/m = 3/2)" in msg
    msg = bubble_warning(build_schedule("zb-h1", 4, 2)) or ""
    assert "simulated for schedule 'zb-h1'" in msg and "(pp-1)/m" not in msg


# ---- sizes and the planner's flags ---------------------------------------------------------


def test_parse_bytes_names_its_key_and_a_valid_value():
    with pytest.raises(ValueError) as info:
        parse_bytes("lots", key="--memory-per-device")
    msg = str(info.value)
    assert msg.startswith("--memory-per-device='lots' is not a size") and "'6GiB'" in msg
    with pytest.raises(ValueError) as info:
        parse_bytes("-1GiB")
    msg = str(info.value)
    assert "activation_budget='-1GiB': a size must be positive" in msg and "'512MiB'" in msg


def _plan(capsys, *flags: str) -> tuple[int, str]:
    from lightning_pp.commands.cli import main

    code = main(["plan", DEMO, "--search", *flags])
    return code, capsys.readouterr().err


def test_memory_per_device_errors_name_the_flag(capsys):
    code, err = _plan(capsys, "--memory-per-device", "lots")
    assert code == 2
    assert "--memory-per-device='lots' is not a size" in err and "activation_budget" not in err
    # a negative value reaches the flag's own check instead of argparse's "expected one argument"
    code, err = _plan(capsys, "--memory-per-device", "-1GiB")
    assert code == 2
    assert "expected one argument" not in err
    assert "--memory-per-device='-1GiB': a size must be positive" in err and "'6GiB'" in err


def test_top_and_max_microbatches_below_one_are_refused(capsys):
    code, err = _plan(capsys, "--top", "0")
    assert code == 2 and "--top 0" in err and "at least one row" in err and "N >= 1" in err
    code, err = _plan(capsys, "--max-microbatches", "0")
    assert code == 2 and "--max-microbatches 0" in err and "N >= 1" in err
    assert "world size" not in err  # another world would not help


def test_search_numbers_out_of_range_are_refused_before_profiling(capsys):
    # --bandwidth 0 ended in a ZeroDivisionError traceback; --verify -1 ran nothing, exit 0
    for flag, value, bound in [
        ("--bandwidth", "0", "> 0"),
        ("--latency", "-1e-5", ">= 0"),
        ("--repeats", "0", ">= 1"),
        ("--verify", "-1", ">= 0"),
        ("--verify-steps", "0", ">= 1"),
        ("--verify-timeout", "0", "> 0"),
    ]:
        code, err = _plan(capsys, flag, value)
        assert code == 2 and f"{flag} {float(value):g}: must be {bound}" in err, (flag, err)
        assert "Traceback" not in err


def test_search_options_without_search_are_refused(capsys):
    from lightning_pp.commands.cli import main

    # `plan CONFIG --devices 4` checked the config's own world and exited 0
    assert main(["plan", DEMO, "--devices", "4"]) == 2
    err = capsys.readouterr().err
    assert "--devices is an option of the shape search" in err and "add --search" in err
    assert main(["plan", DEMO, "--top", "3", "--verify", "1"]) == 2
    err = capsys.readouterr().err
    assert "--top, --verify are options of the shape search" in err


def test_an_empty_search_space_says_so():
    cost = LayerCost(
        t_f=1e-3,
        t_i=1e-3,
        t_w=1e-3,
        saved_bytes=8000,
        param_bytes=4000,
        params=1000,
        boundary_bytes=1000,
        input_bytes=1000,
    )
    profile = ModelProfile({4: [cost] * 4}, tokens_per_sample=16)
    with pytest.raises(SearchError) as info:
        search(profile, 2, 8, space=SearchSpace(max_microbatches=0))
    msg = str(info.value)
    assert "search space is empty (max_microbatches=0)" in msg and "N >= 1" in msg
    assert "nearest world size" not in msg


# ---- SIGTERM ---------------------------------------------------------------------------------


def test_rank_list_names_the_ranks():
    assert _rank_list([2], 4) == "rank 2"
    assert _rank_list([1, 3], 4) == "ranks 1, 3"
    assert _rank_list([0, 1, 2], 3) == "all 3 ranks"
