"""Property tests: every shape Megatron-core accepts builds, validates and simulates (and every
shape the zero-bubble schedules accept); every other shape is rejected up front with the
numbers in the message."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_pp.schedules import Costs, Op, build_schedule, simulate, validate

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

SETTINGS = settings(max_examples=200, deadline=None)
NAMES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]


def accepted(name: str, pp: int, vpp: int, m: int, n: int | None) -> bool:
    """The rules, restated from Megatron-core (see docs/schedules.md)."""
    if min(pp, vpp, m) < 1 or (n is not None and n < 1):
        return False
    if name == "gpipe":
        return n is None
    if name in ("1f1b", "zb-h1"):
        return vpp == 1 and n is None
    if name == "zbv":  # exactly 2 chunks per rank; vpp unset (None) is zbv's own 2
        return vpp == 2 and n is None
    nn = pp if n is None else n
    return vpp >= 2 and pp >= 2 and pp <= nn <= m and not (0 < m % nn < pp)


@st.composite
def valid_shapes(draw):
    name = draw(st.sampled_from(NAMES))
    if name == "interleaved":
        pp = draw(st.integers(2, 6))
        vpp = draw(st.integers(2, 4))
        m = draw(st.integers(pp, 16))
        n = draw(st.sampled_from([None, *range(pp, m + 1)]))
        if not accepted(name, pp, vpp, m, n):
            n = m  # N = m is always accepted (one group)
    else:
        pp = draw(st.integers(1, 6))
        vpp = {"1f1b": 1, "zb-h1": 1, "zbv": 2}.get(name) or draw(st.integers(1, 3))
        m = draw(st.integers(1, 16))
        n = None
    return name, pp, vpp, m, n


@SETTINGS
@given(valid_shapes(), st.floats(0.1, 3.0), st.floats(0.1, 3.0), st.floats(0.0, 1.0))
def test_valid_shapes_validate_and_simulate(shape, t_f, t_b, latency):
    name, pp, vpp, m, n = shape
    s = build_schedule(name, pp=pp, microbatches=m, vpp=vpp, group_size=n)
    validate(s)
    steps_per_chunk = 3 if s.split_backward else 2  # F, I, W or F, B
    for actions in s.ranks:
        assert len(actions) == steps_per_chunk * m * vpp
    r = simulate(s, Costs(t_f=t_f, t_b=t_b, latency=latency))
    # Per rank: m microbatches through vpp chunks of cost t/vpp; I + W cost t_b by default.
    work = m * (t_f + t_b)
    for busy, idle in zip(r.busy, r.idle):
        assert abs(busy - work) <= 1e-9 * work
        assert idle >= -1e-9
    assert r.bubble_ratio >= -1e-12
    assert r.makespan >= work - 1e-9
    # Latency can only delay: the latency-free run is never slower.
    assert simulate(s, Costs(t_f=t_f, t_b=t_b)).makespan <= r.makespan + 1e-9
    # Every rank's peak in-flight lies between 1 and all of its microbatch-chunks.
    assert all(1 <= p <= m * vpp for p in r.peak_inflight)
    # Timelines respect each rank's order and never overlap on a rank.
    for actions, steps in zip(s.ranks, r.timeline):
        assert [a for a, _, _ in steps] == list(actions)
        ends = [0.0] + [e for _, _, e in steps]
        assert all(st >= prev - 1e-12 for (_, st, _), prev in zip(steps, ends))
        assert sum(a.op is Op.F for a in actions) == m * vpp


@SETTINGS
@given(
    st.sampled_from(NAMES),
    st.integers(-1, 7),
    st.integers(-1, 4),
    st.integers(-1, 14),
    st.one_of(st.none(), st.integers(-1, 15)),
)
def test_invalid_shapes_are_rejected_with_numbers(name, pp, vpp, m, n):
    try:
        s = build_schedule(name, pp=pp, microbatches=m, vpp=vpp, group_size=n)
    except ValueError as exc:
        assert not accepted(name, pp, vpp, m, n), (name, pp, vpp, m, n, str(exc))
        msg = str(exc)
        # The message names at least one offending number, with its name.
        named = [
            f"pp={pp}",
            f"vpp={vpp}",
            f"microbatches={m}",
            f"N={n}",
            f"got {pp}",
            f"got {vpp}",
            f"got {m}",
            f"got {n}",
            "group_size",
        ]
        assert any(x in msg for x in named), msg
    else:
        assert accepted(name, pp, vpp, m, n), (name, pp, vpp, m, n)
        validate(s)


@SETTINGS
@given(
    st.integers(1, 6),
    st.integers(1, 16),
    st.floats(0.05, 3.0),
    st.floats(0.05, 3.0),
    st.floats(0.0, 1.0),
)
def test_zb_h1_idle_closed_form_at_random_costs(pp, m, t_f, t_i, w_fraction):
    """Each rank idles (p-1)(t_f+t_i) - (min(m,p)-1)·t_w whenever t_w <= min(t_f, t_i): the
    paper's (p-1)(t_f+t_i-t_w) once m >= p (docs/schedules.md)."""
    t_w = w_fraction * min(t_f, t_i)
    r = simulate(
        build_schedule("zb-h1", pp=pp, microbatches=m),
        Costs(t_f=t_f, t_b=t_i + t_w, t_i=t_i, t_w=t_w),
    )
    want = (pp - 1) * (t_f + t_i) - (min(m, pp) - 1) * t_w
    scale = max(1.0, r.makespan)
    assert all(abs(idle - want) <= 1e-9 * scale for idle in r.idle), (r.idle, want)
