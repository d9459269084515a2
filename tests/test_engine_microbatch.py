"""split_microbatches: nested structures, uneven splits, errors."""

import pytest
import torch

from lightning_pp.runtime.microbatch import batch_size_of, split_microbatches

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def test_nested_split_and_replication():
    batch = {"x": torch.arange(10).reshape(5, 2), "meta": ("name", torch.ones(5)), "k": 3}
    mbs = split_microbatches(batch, 2)
    assert [mb["x"].shape[0] for mb in mbs] == [3, 2]  # first B % m get the extra sample
    assert mbs[1]["meta"][0] == "name" and mbs[1]["k"] == 3
    assert torch.equal(torch.cat([mb["x"] for mb in mbs]), batch["x"])


def test_errors():
    with pytest.raises(
        ValueError, match="batch size 3 is smaller than the number of microbatches 4"
    ):
        split_microbatches(torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match=r"batch\[0\]: 4, batch\[1\]: 5"):
        batch_size_of((torch.zeros(4), torch.zeros(5)))
    with pytest.raises(ValueError, match="positive integer"):
        split_microbatches(torch.zeros(3), 0)


@pytest.mark.parametrize("copy_input", [False, True])
def test_saved_bytes_of_a_first_layer_on_a_batch_view_are_the_microbatch(copy_input):
    """A first Linear saves its input, a tensor_split view of the batch: counted as the
    microbatch's bytes, not the whole batch's storage once per microbatch in flight."""
    from torch import nn

    from lightning_pp.layout.partition import PipelineChunk
    from lightning_pp.layout.topology import PipelineTopology
    from lightning_pp.runtime.engine import PipelineEngine
    from lightning_pp.schedules import build_schedule

    m, mb_size, width = 4, 3, 8
    topo = PipelineTopology.from_world(1, 0, pp=1)
    engine = PipelineEngine(
        [PipelineChunk([nn.Linear(width, 1)], range(0, 1))],
        build_schedule("gpipe", pp=1, microbatches=m),  # all m forwards in flight at once
        topo,
        None,
        loss_fn=lambda out, mb: out.sum(),
        input_fn=(lambda mb: mb[0].clone()) if copy_input else None,
        measure_memory=True,
        abort_on_failure=False,
    )
    x = torch.randn(m * mb_size, width)
    record = engine.train_step((x, torch.zeros(m * mb_size))).record
    mb_bytes = mb_size * width * x.element_size()
    # A copy of the microbatch and a view of it must count the same.
    assert [e.saved_bytes for e in record.events[:m]] == [mb_bytes * (i + 1) for i in range(m)]
    assert record.peak_saved_bytes == m * mb_bytes == x.numel() * x.element_size()
