"""``lightning-pp consolidate``: merge a sharded pipeline checkpoint into one ordinary file.

Example::

    # plain state_dict for inference: model.load_state_dict(torch.load("gpt.pt"))
    lightning-pp consolidate ckpts/step=500.ckpt gpt.pt

    # a Hugging Face model held as self.model (PipelineStrategy(split=...)):
    #   hf_model.load_state_dict(torch.load("hf.pt")); hf_model.save_pretrained("out/")
    lightning-pp consolidate ckpts/step=500.ckpt hf.pt --submodule model

    # full Lightning checkpoint (weights, optimizer, schedulers, loops) for a plain Trainer:
    #   trainer.fit(GPT(...), ckpt_path="gpt-full.ckpt")
    lightning-pp consolidate ckpts/step=500.ckpt gpt-full.ckpt --lightning
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``consolidate`` subcommand to the ``lightning-pp`` parser."""
    p = subparsers.add_parser(
        "consolidate",
        help="merge a sharded pipeline checkpoint directory into one file",
        description=(
            "Read every stage's shard of a PipelineStrategy checkpoint directory and write one "
            "file: a plain state_dict (original parameter names, tied names all present) that "
            "loads with load_state_dict(strict=True) into the unpipelined module; with "
            "--lightning, a full Lightning checkpoint a plain Trainer can resume from."
        ),
    )
    p.add_argument("checkpoint", help="checkpoint directory written by PipelineStrategy")
    p.add_argument("output", help="file to write")
    p.add_argument(
        "--lightning",
        action="store_true",
        help="write a full Lightning checkpoint (state_dict + optimizer states + schedulers + "
        "loops); rebuilds the module from its saved class and hyperparameters",
    )
    p.add_argument(
        "--submodule",
        default=None,
        metavar="ATTR",
        help="write only the keys under this LightningModule attribute, without the prefix "
        "(e.g. 'model': a state dict HFModel.load_state_dict(strict=True) accepts)",
    )
    p.add_argument(
        "--module",
        default=None,
        metavar="PKG.MOD:CLASS",
        help="LightningModule class for --lightning (default: the class recorded at save time)",
    )
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"lightning-pp consolidate: error: {message}", file=sys.stderr)
    return 2


def _import_class(path: str) -> Any:
    module_name, _, qualname = path.partition(":")
    if not qualname:
        raise ValueError(f"--module must look like 'package.module:Class', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def build_module(checkpoint_dir: str, class_path: str | None = None) -> Any:
    """Instantiate the unpipelined LightningModule from the checkpoint's class and hparams."""
    import torch

    from lightning_pp.checkpoint import read_index

    index = read_index(checkpoint_dir)
    meta = torch.load(
        f"{checkpoint_dir}/{index['meta_file']}", map_location="cpu", weights_only=False
    )
    class_path = class_path or meta.get("lightning_pp", {}).get("module_class")
    if class_path is None:
        raise ValueError("the checkpoint does not record its module class: pass --module")
    if class_path.startswith("__main__:"):
        raise ValueError(
            f"the module class was defined in a script ({class_path}); pass --module "
            "pkg.mod:Class naming an importable class"
        )
    cls = _import_class(class_path)
    hparams = dict(meta.get("hyper_parameters", {}))
    return cls(**hparams)


def run(args: argparse.Namespace) -> int:
    from lightning_pp.checkpoint import CheckpointError, consolidate_checkpoint, read_index

    try:
        index = read_index(args.checkpoint)
        module = build_module(args.checkpoint, args.module) if args.lightning else None
        if args.lightning and args.submodule:
            raise ValueError("--submodule writes a plain state dict; it cannot go with --lightning")
        result = consolidate_checkpoint(
            args.checkpoint, args.output, module=module, submodule=args.submodule
        )
    except (CheckpointError, ValueError, ImportError, AttributeError) as exc:
        return _fail(str(exc))
    state = result["state_dict"] if args.lightning else result
    numel = sum(v.numel() for v in state.values() if hasattr(v, "numel"))
    lay = index["layout"]
    print(
        f"wrote {args.output}: {len(state)} tensors ({numel:,} values) from a pp={lay['pp']} "
        f"vpp={lay['vpp']} dp={lay['dp']} checkpoint"
        + (" with optimizer and scheduler state" if args.lightning else "")
    )
    return 0
