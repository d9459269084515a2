"""split_microbatches: nested structures, uneven splits, errors."""

import pytest
import torch

from lightning_pp.microbatch import batch_size_of, split_microbatches


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
