"""The checkpoint format on ``torch.distributed.checkpoint`` (format version 2).

A checkpoint is a **directory**, as in Lightning's ``ModelParallelStrategy``::

    step=5.ckpt/
      __0_0.distcp ... .metadata   DCP: {"state_dict": {name: tensor},
                                         "optimizer_0": {"state": {name: {"exp_avg": t, ...}}}, ...}
      meta.json, meta.safetensors  everything else, no pickle (:mod:`.meta_codec`): Lightning's
                                   loops/callbacks/schedulers/hparams, per name the optimizer's
                                   param-group hyperparameters and non-tensor state, every stored
                                   tensor's dtype and shape, the layout that wrote it, tied groups
      complete.json                written LAST by rank 0 (:mod:`.manifest`): the marker

**Names** are the LightningModule's own ``state_dict`` keys (``layers.3.qkv.weight``, a
``split=`` model's ``model.transformer.h.0...``), which no pipeline shape changes, so a rank of
any later shape asks DCP for the names it holds. A tied group is stored once, under its first
(canonical) name, with its optimizer state, by the rank holding that copy.

**Each rank passes what it holds**; ``dp`` replicas pass the same names and DCP's save planner
keeps one writer per name (torch 2.13 ``dedup_save_plans``: the least loaded rank), so replicas
share the writing. Only tensors go through DCP: a non-tensor DCP item is read back with
``torch.load(weights_only=False)``, so the loader (:mod:`.dcp_safe`) refuses any.

**Loading** verifies the marker and the manifest on rank 0 and reads the metadata there; every
rank then checks what it will ask for (names, shapes, optimizer groups), the ranks agree, and
only then does DCP read, into freshly allocated tensors: the module and optimizers are changed
after every rank's read succeeded. Why fresh tensors: DCP copies into the tensors it is given,
so a read failing half-way must not leave the live weights half old, half new.

Example::

    save_dcp_checkpoint(ckpt, "ckpts/step=5.ckpt", canonical=canonical, layout={"pp": 2})
    meta = load_dcp_checkpoint("ckpts/step=5.ckpt", module, canonical=canonical,
                               optimizers=[opt])           # any pp/vpp/dp/placement
    state = consolidated_dcp_state_dict("ckpts/step=5.ckpt")   # one process: a plain state_dict
"""

from __future__ import annotations

from .dcp_load import consolidated_dcp_state_dict, load_dcp_checkpoint
from .dcp_meta import FORMAT, VERSION, is_dcp_checkpoint, read_dcp_checkpoint_meta
from .dcp_save import save_dcp_checkpoint

__all__ = [
    "FORMAT",
    "VERSION",
    "consolidated_dcp_state_dict",
    "is_dcp_checkpoint",
    "load_dcp_checkpoint",
    "read_dcp_checkpoint_meta",
    "save_dcp_checkpoint",
]
