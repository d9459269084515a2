"""partition_layers / local placement / PipelineChunk."""

import pytest
import torch
from torch import nn

from lightning_pp.layout.partition import (
    PipelineChunk,
    local_layer_indices,
    partition_layers,
    stage_of,
)

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def sizes(ranges):
    return [len(r) for r in ranges]


def test_uniform_puts_remainder_on_later_stages():
    assert sizes(partition_layers(10, pp=4, vpp=1)) == [2, 2, 3, 3]
    r = partition_layers(16, pp=4, vpp=2)
    assert r[0] == range(0, 2) and r[-1] == range(14, 16)
    assert [x for rg in r for x in rg] == list(range(16))  # contiguous and complete


def test_loop_placement():
    r = partition_layers(16, pp=4, vpp=2)
    assert stage_of(1, 1, 4) == 5
    assert local_layer_indices(r, rank=0, pp=4, vpp=2) == [range(0, 2), range(8, 10)]
    assert local_layer_indices(r, rank=3, pp=4, vpp=2) == [range(6, 8), range(14, 16)]


def test_balanced_methods():
    params = [10, 1, 1, 1, 1, 1, 1, 1, 1, 10]
    assert sizes(partition_layers(10, 2, 2, "parameters", layer_params=params)) == [1, 4, 4, 1]
    costs = [1.0, 1.0, 1.0, 3.0]
    assert sizes(partition_layers(4, 2, 1, "cost", layer_costs=costs)) == [3, 1]


def test_explicit_counts():
    assert sizes(partition_layers(8, 2, 2, [1, 3, 3, 1])) == [1, 3, 3, 1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_layers=3, pp=2, vpp=2), r"num_layers=3 into pp\(2\) \* vpp\(2\) = 4"),
        (dict(num_layers=8, pp=2, vpp=2, method=[2, 2, 2, 1]), r"sums to 7 .* s3=1"),
        (
            dict(num_layers=8, pp=2, vpp=1, method=[4, 2, 2]),
            r"3 entries but pp\(2\) \* vpp\(1\) = 2",
        ),
        (dict(num_layers=8, pp=2, vpp=1, method="parameters"), "needs layer_params"),
        (dict(num_layers=8, pp=2, vpp=1, method="cost", layer_costs=[1.0]), "1 entries"),
        (dict(num_layers=8, pp=2, vpp=1, method="bogus"), "unknown partition method"),
    ],
)
def test_errors_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        partition_layers(**kwargs)


def test_chunk_passes_tuples_whole_and_keeps_indices():
    class Pair(nn.Module):
        def forward(self, x):
            h, mask = x
            return h + 1, mask

    chunk = PipelineChunk([Pair(), Pair()], indices=[4, 5])
    h, mask = chunk((torch.zeros(2), torch.ones(2, dtype=torch.long)))
    assert h.tolist() == [2.0, 2.0] and mask.dtype == torch.long
    assert chunk.layer_indices == [4, 5]
