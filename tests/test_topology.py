"""PipelineTopology: layout (pp outermost), neighbours, validation messages."""

import pytest

from lightning_pp.layout.topology import PipelineTopology

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def test_pp_outermost_layout():
    grid = [PipelineTopology.from_world(8, r, pp=4) for r in range(8)]
    assert [(t.pp_rank, t.dp_rank) for t in grid] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]
    t = grid[5]
    assert t.dp == 2 and t.pipeline_ranks == [1, 3, 5, 7] and t.dp_ranks == [4, 5]
    assert (t.prev_rank, t.next_rank) == (3, 7)
    assert t.global_rank(0) == 1 and t.global_rank(3, 0) == 6


def test_neighbours_wrap_for_interleaving():
    first, last = (PipelineTopology.from_world(4, r, pp=4) for r in (0, 3))
    assert first.is_first_stage and first.prev_rank == 3
    assert last.is_last_stage and last.next_rank == 0


def test_every_rank_in_exactly_one_pipeline_and_one_dp_group():
    t = PipelineTopology.from_world(12, 0, pp=3)
    flat = sorted(r for p in t.all_pipelines() for r in p)
    assert flat == list(range(12))
    assert sorted(r for g in t.all_dp_groups() for r in g) == list(range(12))


def test_errors_print_every_number():
    with pytest.raises(ValueError, match=r"pp\(4\) \* dp\(2\) \* tp\(1\) != world_size\(6\)"):
        PipelineTopology(world_size=6, pp=4, dp=2, rank=0)
    with pytest.raises(ValueError, match=r"world_size\(8\) is not divisible by pp\(2\) \* tp\(3\)"):
        PipelineTopology.from_world(8, 0, pp=2, tp=3)
    with pytest.raises(ValueError, match=r"world_size\(6\) is not divisible by pp\(4\)"):
        PipelineTopology.from_world(6, 0, pp=4)
    with pytest.raises(ValueError, match=r"rank\(8\) must lie in \[0, world_size\(8\)\)"):
        PipelineTopology.from_world(8, 8, pp=2)
    with pytest.raises(ValueError, match="pp must be a positive integer"):
        PipelineTopology(world_size=4, pp=0, dp=4, rank=0)


def test_tensor_parallel_is_innermost_and_peers_share_coordinates():
    """pp2 x dp2 x tp2: a stage's tp ranks are neighbours; a rank's pipeline peers and replicas
    keep its other coordinates; every rank is in exactly one group of each kind."""
    world = 8
    topos = [PipelineTopology.from_world(world, r, pp=2, tp=2) for r in range(world)]
    assert [(t.pp_rank, t.dp_rank, t.tp_rank) for t in topos[:4]] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    ]
    t5 = topos[5]  # (pp 1, dp 0, tp 1)
    assert (t5.tp_ranks, t5.dp_ranks, t5.pipeline_ranks) == ([4, 5], [5, 7], [1, 5])
    assert (t5.prev_rank, t5.next_rank) == (1, 1)
    for lists in (t5.all_pipelines(), t5.all_dp_groups()):
        assert sorted(r for group in lists for r in group) == list(range(world))
    for t in topos:
        lists, mine = t.stage_lists([0, 1])
        assert lists[mine] == t.pipeline_ranks
        assert t.rank in t.tp_ranks and t.rank in t.dp_ranks
