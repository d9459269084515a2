"""Lightning Fabric's ``ModelParallelStrategy`` given a lightning_pp checkpoint, as a user would.

Usage: ``python interop_fabric.py CKPT_DIR CONSOLIDATED_PT`` (``CONSOLIDATED_PT`` written by
``lightning-pp consolidate CKPT_DIR CONSOLIDATED_PT``). One process, CPU, gloo, the tiny GPT
sharded with FSDP2 (``fully_shard``), so its parameters are DTensors as the strategy requires.
Prints one JSON line: the error ``fabric.load`` and ``fabric.load_raw`` give for the directory,
and whether ``load_raw`` of the consolidated file restored every tensor (the tie kept).

A script, not a test function: Fabric initialises a process group, which must not outlive it
in the pytest process.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from pp_common import MODEL_KW
from torch.distributed.fsdp import fully_shard

from lightning_pp.models import GPT


def _shard(model: GPT, mesh) -> GPT:
    fully_shard(model.layers, mesh=mesh["data_parallel"])
    return model


def _error(fn) -> str | None:
    """``fn``'s exception as ``Type: message``, or None if it succeeded."""
    try:
        fn()
    except Exception as exc:  # any: the test reads which error it was
        return f"{type(exc).__name__}: {exc}"
    return None


def main(directory: str, consolidated: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(_shard))
    fabric.launch()
    module = GPT(**MODEL_KW)
    module.configure_model()
    model = fabric.setup_module(module)
    result = {
        "load_dir": _error(lambda: fabric.load(directory, {"state_dict": model})),
        "load_raw_dir": _error(lambda: fabric.load_raw(directory, model)),
    }
    fabric.load_raw(consolidated, model)
    want = torch.load(consolidated, weights_only=True)
    got = {k: v.full_tensor() for k, v in module.state_dict().items()}
    result["keys_equal"] = sorted(got) == sorted(want)
    result["tensors_equal"] = all(torch.equal(got[k], want[k]) for k in want)
    result["tied"] = (
        module.layers[0].wte.weight is module.layers[MODEL_KW["n_layer"] + 1].head.weight
    )
    print(json.dumps(result))
    torch.distributed.destroy_process_group()  # else torch warns at exit, after the result


if __name__ == "__main__":
    main(*sys.argv[1:3])
