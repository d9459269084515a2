"""LayerPlacement: which rank holds which layers and tied weights, without processes."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_pp.layout.partition import partition_layers
from lightning_pp.layout.placement import LayerPlacement
from lightning_pp.schedules import build_schedule

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def _place(name: str, pp: int, vpp: int, num_layers: int) -> LayerPlacement:
    if name == "zbv":  # V placement: only the schedule's placement is read here
        schedule = dataclasses.replace(
            build_schedule("interleaved", pp=pp, microbatches=2 * pp, vpp=vpp), placement="v"
        )
    else:
        schedule = build_schedule(name, pp=pp, microbatches=2 * pp, vpp=vpp)
    return LayerPlacement(schedule, partition_layers(num_layers, pp, vpp))


def test_loop_placement_interleaves_chunks():
    place = _place("interleaved", pp=4, vpp=2, num_layers=16)
    assert place.chunk_ranges(0) == [range(0, 2), range(8, 10)]
    assert place.chunk_ranges(3) == [range(6, 8), range(14, 16)]
    assert place.local_indices(1) == [2, 3, 10, 11]
    assert [place.rank_of_layer(i) for i in (0, 7, 8, 15)] == [0, 3, 0, 3]
    assert place.output_rank == 3


def test_v_placement_comes_back_up_the_ranks():
    place = _place("zbv", pp=4, vpp=2, num_layers=16)
    # rank r holds stages r and 2p-1-r: rank 0 holds the first AND the last layers
    assert place.chunk_ranges(0) == [range(0, 2), range(14, 16)]
    assert place.chunk_ranges(3) == [range(6, 8), range(8, 10)]
    assert place.output_rank == 0
    assert place.tied_ranks([0, 15]) == ([0], 0)  # embedding and head on one rank: no group


def test_every_layer_is_held_exactly_once():
    for name, pp, vpp in [("1f1b", 3, 1), ("interleaved", 2, 3), ("zbv", 3, 2), ("gpipe", 4, 2)]:
        place = _place(name, pp, vpp, num_layers=13)
        held = sorted(i for r in range(pp) for i in place.local_indices(r))
        assert held == list(range(13)), (name, pp, vpp)
        for r in range(pp):
            assert all(place.rank_of_layer(i) == r for i in place.local_indices(r))


def test_tied_ranks_and_owner():
    place = _place("1f1b", pp=4, vpp=1, num_layers=8)
    # the first listed member's rank owns the weight, whatever the order of ranks
    assert place.tied_ranks([7, 0]) == ([0, 3], 3)
    assert place.tied_ranks([0, 1]) == ([0], 0)
    assert place.tied_ranks([0, 3, 7]) == ([0, 1, 3], 0)


def test_errors_name_the_numbers():
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    with pytest.raises(ValueError, match=r"got 3 layer ranges for pp\(2\) \* vpp\(1\) = 2"):
        LayerPlacement(schedule, [range(0, 1), range(1, 2), range(2, 3)])
    place = LayerPlacement(schedule, [range(0, 2), range(2, 4)])
    with pytest.raises(ValueError, match=r"pipeline rank 2 must lie in \[0, pp\(2\)\)"):
        place.chunk_ranges(2)
    with pytest.raises(ValueError, match="layer 4 is outside the model's 4 layers"):
        place.rank_of_layer(4)


def test_layout_and_describe():
    place = _place("interleaved", pp=2, vpp=2, num_layers=5)
    assert place.layout() == {
        "pp": 2,
        "vpp": 2,
        "num_layers": 5,
        "layer_ranges": [[0, 1], [1, 2], [2, 3], [3, 5]],
    }
    assert place.describe() == [
        "rank 0: chunk 0 = stage 0, layers 0; chunk 1 = stage 2, layers 2",
        "rank 1: chunk 0 = stage 1, layers 1; chunk 1 = stage 3, layers 3-4",
    ]
