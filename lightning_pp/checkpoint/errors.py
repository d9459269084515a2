"""The one error every checkpoint module raises, in a module of its own.

It lives here, not in :mod:`.sharded`, so that the DCP-format modules (:mod:`.dcp_safe`,
:mod:`.manifest`, :mod:`.meta_codec`) can raise it without importing the version-1 format.
:mod:`.sharded` re-exports it, so ``from lightning_pp.checkpoint.sharded import CheckpointError``
keeps working.

Example::

    from lightning_pp.checkpoint.errors import CheckpointError

    try:
        verify_manifest(path)
    except CheckpointError as exc:
        print(f"not loading {path}: {exc}")
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete, or does not match the model."""
