"""Property tests over pipeline arguments: valid combinations build and validate, invalid ones
raise ``ValueError`` naming the offending numbers. Pure (no processes), a few seconds.

The oracle below restates the rules independently (world = pp * dp, one layer per chunk, one
sample per microbatch, 1F1B cannot interleave, Megatron's interleaved group rules) so that a
plan that accepted a bad combination, or rejected a good one, fails here.
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_pp.layout.plan import PipelinePlan
from lightning_pp.layout.rules import PipelineWarning
from lightning_pp.schedules import peak_inflight, validate

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _problems(world, pp, vpp, m, schedule, group, layers, batch) -> list[tuple[int, ...]]:
    """Independent oracle: for each violated rule, the numbers its message must contain."""
    bad: list[tuple[int, ...]] = []
    name = schedule or ("1f1b" if vpp == 1 else "interleaved")
    if name == "1f1b" and vpp > 1:
        bad.append((vpp,))
    if name == "interleaved":
        n = pp if group is None else group
        if vpp < 2 or pp < 2 or m < pp or not pp <= n <= m or 0 < m % n < pp:
            bad.append((m,) if m < pp else (pp,))
    if group is not None and name != "interleaved":
        bad.append(())
    if world % pp:
        bad.append((world, pp))
    if layers < pp * vpp:
        bad.append((layers, pp * vpp))
    if batch < m:
        bad.append((batch, m))
    return bad


args = st.fixed_dictionaries(
    {
        "world": st.integers(1, 16),
        "pp": st.integers(1, 8),
        "vpp": st.integers(1, 4),
        "m": st.integers(1, 16),
        "schedule": st.sampled_from([None, "gpipe", "1f1b", "interleaved"]),
        "group": st.one_of(st.none(), st.integers(1, 16)),
        "layers": st.integers(1, 40),
        "batch": st.integers(1, 32),
    }
)


@SETTINGS
@given(args)
def test_plan_accepts_exactly_the_valid_combinations(a):
    expected = _problems(**a)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PipelineWarning)
            plan = PipelinePlan.build(
                world_size=a["world"],
                pp=a["pp"],
                vpp=a["vpp"],
                microbatches=a["m"],
                schedule=a["schedule"],
                group_size=a["group"],
                num_layers=a["layers"],
                batch_size=a["batch"],
            )
    except ValueError as e:
        assert expected, f"rejected a valid combination {a}: {e}"
        msg = str(e)
        # at least one violated rule's numbers appear in the message
        assert any(all(str(n) in msg for n in nums) for nums in expected), (a, msg)
        return
    assert not expected, f"accepted {a} although it violates {expected}"
    # what was accepted is sound: the schedule runs, the split covers every layer once
    validate(plan.schedule)
    assert plan.dp * plan.pp == a["world"]
    assert [i for r in plan.layer_ranges for i in r] == list(range(a["layers"]))
    assert all(len(r) >= 1 for r in plan.layer_ranges)
    assert len(plan.layer_ranges) == a["pp"] * a["vpp"]
    if plan.schedule.name == "1f1b":  # the memory bound that motivates 1F1B
        assert all(peak <= a["pp"] - r for r, peak in enumerate(peak_inflight(plan.schedule)))
    assert (a["m"] < a["pp"] and a["pp"] > 1) == bool(plan.warnings)


@SETTINGS
@given(
    world=st.integers(1, 64),
    pp=st.integers(1, 64),
    gbs=st.integers(1, 256),
    m=st.integers(1, 32),
)
def test_global_batch_over_dp(world, pp, gbs, m):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PipelineWarning)
            plan = PipelinePlan.build(
                world_size=world, pp=pp, microbatches=m, schedule="gpipe", global_batch_size=gbs
            )
    except ValueError as e:
        msg = str(e)
        dp = world // pp if world % pp == 0 else None
        if world % pp:
            assert str(world) in msg and str(pp) in msg
        elif gbs % dp:
            assert f"global batch size {gbs}" in msg and f"dp={dp}" in msg
        else:
            assert gbs // dp < m and str(m) in msg and str(gbs // dp) in msg
        return
    assert world % pp == 0 and gbs % plan.dp == 0 and gbs // plan.dp >= m
