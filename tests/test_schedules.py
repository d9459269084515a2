"""Generators against an independent re-derivation of Megatron-core's loops.

The reference below does not reuse our table or warmup helpers: it rebuilds Megatron-core's
``get_schedule_table`` by group membership, applies its warmup rule, then *runs its loop
structure* (warmup forwards, steady forward k+W / backward k, cooldown backwards) with one FIFO
stash per chunk, the way Megatron pops ``input_tensors[chunk].pop(0)``. The backward's microbatch
therefore comes from the stash, not from the table.
"""

from __future__ import annotations

from collections import deque

import pytest

from lightning_pp.schedules import (
    Action,
    Op,
    build_schedule,
    check_schedule_name,
    gpipe,
    interleaved,
    interleaved_table,
    one_f_one_b,
)

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def megatron_accepts(pp: int, vpp: int, m: int, n: int) -> bool:
    """Shapes current Megatron-core runs (interleaving is only selected for pp > 1)."""
    if vpp == 1:
        return True
    return pp >= 2 and pp <= n <= m and not (0 < m % n < pp)


def megatron_order(pp: int, vpp: int, m: int, n: int, rank: int) -> list[tuple[str, int, int]]:
    if vpp == 1:
        table = [(k, 0) for k in range(m)]
        warmup = min(pp - rank - 1, m)
    else:
        groups = -(-m // n)
        table = []
        for g in range(groups):
            members = [mb for mb in range(m) if mb // n == g]
            for chunk in range(vpp):
                table += [(mb, chunk) for mb in members]
        warmup = (pp - rank - 1) * 2 + (vpp - 1) * n
    total = m * vpp
    if warmup >= total:  # are_all_microbatches_in_warmup
        warmup = total
    stash: dict[int, deque[int]] = {c: deque() for c in range(vpp)}
    order: list[tuple[str, int, int]] = []

    def forward(k: int) -> None:
        mb, chunk = table[k]  # get_microbatch_id_in_model_chunk / get_model_chunk_id(forward)
        stash[chunk].append(mb)
        order.append(("F", mb, chunk))

    def backward(k: int) -> None:
        chunk = vpp - 1 - table[k % total][1]  # get_model_chunk_id(k, forward=False)
        order.append(("B", stash[chunk].popleft(), chunk))

    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(k + warmup)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    return order


def as_tuples(actions) -> list[tuple[str, int, int]]:
    return [(a.op.value, a.mb, a.chunk) for a in actions]


def test_table_matches_megatron_documented_example():
    # Megatron-core's comment: PP2 N3 M5 VP2 -> microbatch ids 0 1 2 0 1 2 3 4 3 4,
    # chunks 0 0 0 1 1 1 0 0 1 1.
    table = interleaved_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_1f1b_matches_megatron_including_fewer_microbatches_than_ranks(pp):
    for m in range(1, 11):
        s = one_f_one_b(pp, m)
        for r in range(pp):
            assert as_tuples(s.ranks[r]) == megatron_order(pp, 1, m, 1, r), (pp, m, r)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("vpp", [2, 3, 4])
def test_interleaved_matches_megatron_or_rejects(pp, vpp):
    accepted = rejected = 0
    for m in range(1, 13):
        for n in [None, *range(1, 14)]:
            nn = pp if n is None else n
            if megatron_accepts(pp, vpp, m, nn):
                s = interleaved(pp, m, vpp=vpp, group_size=n)
                assert s.group_size == nn
                for r in range(pp):
                    assert as_tuples(s.ranks[r]) == megatron_order(pp, vpp, m, nn, r), (
                        pp,
                        vpp,
                        m,
                        nn,
                        r,
                    )
                accepted += 1
            else:
                with pytest.raises(ValueError) as err:
                    interleaved(pp, m, vpp=vpp, group_size=n)
                msg = str(err.value)
                for number in (f"pp={pp}", f"vpp={vpp}", f"microbatches={m}", f"N={nn}"):
                    assert number in msg, (number, msg)
                rejected += 1
    # The grid must exercise both sides (pp=1 only rejects: no interleaving without a pipeline).
    assert rejected > 0
    assert accepted > 0 or pp == 1


def test_all_warmup_follows_current_megatron_rule():
    # m == pp: only ranks whose warmup count reaches m*vpp run everything forward first.
    s = interleaved(4, 4, vpp=2)
    assert [a.op for a in s.ranks[0]] == [Op.F] * 8 + [Op.B] * 8  # 2*3 + 4 = 10 >= 8
    last = s.ranks[3]  # warmup (2-1)*4 = 4, then steady 1F1B
    assert [a.op for a in last[:6]] == [Op.F] * 5 + [Op.B]


def test_remainder_group_is_shorter_not_merged():
    # m=6, N=4 with pp=2: the last group holds microbatches 4, 5 (remainder 2 >= pp).
    table = interleaved_table(6, 2, 4)
    assert table[8:] == [(4, 0), (5, 0), (4, 1), (5, 1)]
    s = interleaved(2, 6, vpp=2, group_size=4)
    assert len(s.ranks[0]) == 24


def test_gpipe_shape_and_looped_bfs():
    s = gpipe(3, 2, vpp=2)
    expected = [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 0, 1),
        ("F", 1, 1),
        ("B", 0, 1),
        ("B", 1, 1),
        ("B", 0, 0),
        ("B", 1, 0),
    ]
    assert all(as_tuples(r) == expected for r in s.ranks)


def test_build_schedule_errors_name_the_numbers():
    with pytest.raises(ValueError, match="vpp=2"):
        build_schedule("1f1b", pp=4, microbatches=8, vpp=2)
    with pytest.raises(ValueError, match="group_size"):
        build_schedule("gpipe", pp=4, microbatches=8, group_size=4)
    with pytest.raises(ValueError, match="microbatches must be a positive integer, got 0"):
        build_schedule("gpipe", pp=4, microbatches=0)
    with pytest.raises(ValueError, match="Did you mean '1f1b'"):
        check_schedule_name("1fb1")


def test_forward_only_drops_backwards():
    s = build_schedule("interleaved", pp=2, vpp=2, microbatches=4).forward_only()
    assert all(a.op is Op.F for r in s.ranks for a in r)
    assert Action(Op.F, 3, 1) in s.ranks[1]


def test_placement_loop_and_v_are_inverse():
    from lightning_pp.schedules import Schedule

    for placement, pp in (("loop", 4), ("v", 4), ("v", 2)):
        s = Schedule("x", pp, 2, 4, tuple(() for _ in range(pp)), placement=placement)
        seen = set()
        for r in range(pp):
            for c in range(2):
                st = s.stage(r, c)
                assert s.locate(st) == (r, c)
                seen.add(st)
            assert s.stages_of(r) == tuple(s.stage(r, c) for c in range(2))
        assert seen == set(range(2 * pp))
    v = Schedule("x", 4, 2, 4, tuple(() for _ in range(4)), placement="v")
    assert v.stages_of(0) == (0, 7) and v.stages_of(3) == (3, 4)
    loop = Schedule("x", 4, 2, 4, tuple(() for _ in range(4)))
    assert loop.stages_of(0) == (0, 4)
    with pytest.raises(ValueError, match="vpp=3"):
        Schedule("x", 2, 3, 4, ((), ()), placement="v")
