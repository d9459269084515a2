"""``lightning-pp consolidate``: merge a sharded pipeline checkpoint into one ordinary file.

Trust: the checkpoint's files are loaded with ``weights_only=True`` (no pickled code runs; see
docs/checkpoints.md "Trust"); ``--lightning`` imports the module class recorded in the checkpoint
(or ``--module``) and calls it only if it is a LightningModule subclass.

Example::

    # plain state_dict for inference: model.load_state_dict(torch.load("gpt.pt"))
    lightning-pp consolidate ckpts/step=500.ckpt gpt.pt

    # a Hugging Face model held as self.model (PipelineStrategy(split=...)):
    #   hf_model.load_state_dict(torch.load("hf.pt")); hf_model.save_pretrained("out/")
    lightning-pp consolidate ckpts/step=500.ckpt hf.pt --submodule model

    # the same model as a Hugging Face directory (safetensors + config.json):
    #   AutoModelForCausalLM.from_pretrained("hf-out/")
    lightning-pp consolidate ckpts/step=500.ckpt --hf hf-out/

    # full Lightning checkpoint (weights, optimizer, schedulers, loops) for a plain Trainer:
    #   trainer.fit(GPT(...), ckpt_path="gpt-full.ckpt")
    lightning-pp consolidate ckpts/step=500.ckpt gpt-full.ckpt --lightning
"""

from __future__ import annotations

import argparse
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
    p.add_argument("output", nargs="?", default=None, help="file to write (optional with --hf)")
    p.add_argument(
        "--hf",
        default=None,
        metavar="DIR",
        help="write the Hugging Face model of a PipelineStrategy(split=...) run to DIR with its "
        "save_pretrained (safetensors, config.json, generation_config.json): "
        "AutoModelForCausalLM.from_pretrained(DIR) loads it; --submodule picks the model when "
        "the module holds several",
    )
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
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load meta.pt with weights_only=False: unpickles any type, which RUNS any code the "
        "file names; only for checkpoints you wrote (default: tensors, containers and the types "
        "Lightning's metadata holds)",
    )
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"lightning-pp consolidate: error: {message}", file=sys.stderr)
    return 2


def build_module(checkpoint_dir: str, class_path: str | None = None, trust: bool = False) -> Any:
    """Instantiate the unpipelined LightningModule from the checkpoint's class and hparams."""
    from lightning_pp.checkpoint.consolidate import module_from_checkpoint

    return module_from_checkpoint(checkpoint_dir, class_path, weights_only=not trust)


def _export_hf(checkpoint: str, out: str, submodule: str | None, lay: dict) -> None:
    from lightning_pp.checkpoint.by_name import describe_layout
    from lightning_pp.checkpoint.hf_export import export_hf, hf_record_of

    name, record = hf_record_of(checkpoint, submodule)
    export_hf(checkpoint, out, name)
    print(
        f"wrote {out}: {record['class']} ({name!r} of the LightningModule) from a "
        f"{describe_layout(lay, ' ')} checkpoint; load it with "
        f"AutoModelForCausalLM.from_pretrained({out!r})"
    )


def run(args: argparse.Namespace) -> int:
    from lightning_pp.checkpoint.by_name import describe_layout
    from lightning_pp.checkpoint.consolidate import checkpoint_layout, consolidate_checkpoint
    from lightning_pp.checkpoint.errors import CheckpointError

    if args.output is None and args.hf is None:
        return _fail("give an output file, --hf DIR, or both")
    if args.hf is not None and args.lightning:
        return _fail("--hf writes a Hugging Face directory; it cannot go with --lightning")
    try:
        lay = checkpoint_layout(args.checkpoint)
        if args.hf is not None:
            _export_hf(args.checkpoint, args.hf, args.submodule, lay)
            if args.output is None:
                return 0
        module = (
            build_module(args.checkpoint, args.module, args.trust_checkpoint)
            if args.lightning
            else None
        )
        if args.lightning and args.submodule:
            raise ValueError("--submodule writes a plain state dict; it cannot go with --lightning")
        result = consolidate_checkpoint(
            args.checkpoint,
            args.output,
            module=module,
            weights_only=not args.trust_checkpoint,
            submodule=args.submodule,
        )
    except (CheckpointError, ValueError, ImportError, AttributeError) as exc:
        return _fail(str(exc))
    state = result["state_dict"] if args.lightning else result
    numel = sum(v.numel() for v in state.values() if hasattr(v, "numel"))
    print(
        f"wrote {args.output}: {len(state)} tensors ({numel:,} values) from a "
        f"{describe_layout(lay, ' ')} checkpoint"
        + (" with optimizer and scheduler state" if args.lightning else "")
    )
    return 0
