"""Demo data that every machine already has: the Python standard library's own source code.

Character-level language modelling on real text, with no download: the ``*.py`` files directly
under ``sysconfig.get_paths()["stdlib"]``, read in sorted name order and capped at
``max_chars``. Characters map to their ASCII code (vocabulary of 128); anything outside ASCII
becomes ``?``. The text is cut into fixed-length blocks; the last ``val_fraction`` of the corpus
is the validation split.

Example:
    >>> dm = StdlibCharDataModule(block_size=32, batch_size=4, max_chars=20_000)
    >>> dm.setup("fit")
    >>> x, y = next(iter(dm.train_dataloader()))
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([4, 32]), True)
    >>> decode(encode("def f(): pass")) == "def f(): pass"
    True
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "VOCAB_SIZE",
    "BlockDataset",
    "StdlibCharDataModule",
    "decode",
    "encode",
    "generate",
    "stdlib_text",
]

#: ASCII: every stdlib file is (almost entirely) ASCII, and a fixed vocabulary lets the model's
#: size be written in the config before any data is read.
VOCAB_SIZE = 128


_PRINTABLE = torch.tensor([c in (9, 10) or 32 <= c < 127 for c in range(VOCAB_SIZE)])


def encode(text: str) -> torch.Tensor:
    """Characters -> int64 codes in ``[0, 128)`` (non-ASCII -> ``?``)."""
    raw = text.encode("ascii", errors="replace")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def decode(codes: torch.Tensor | list[int]) -> str:
    """Inverse of :func:`encode` (codes outside ASCII print as ``?``)."""
    values = codes.tolist() if isinstance(codes, torch.Tensor) else list(codes)
    return "".join(chr(c) if 0 <= c < VOCAB_SIZE else "?" for c in values)


def stdlib_text(max_chars: int = 2_000_000, root: str | None = None) -> str:
    """The concatenated source of the stdlib's top-level modules, in sorted file-name order.

    Deterministic for a given Python version; each file is prefixed with a header comment so the
    model sees file boundaries.
    """
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no *.py files under {base}: cannot build the demo corpus")
    parts: list[str] = []
    total = 0
    for path in files:
        text = f"# file: {path.name}\n" + path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


class BlockDataset(Dataset):
    """Non-overlapping blocks of ``block_size + 1`` codes -> ``(input, target)`` shifted by one."""

    def __init__(self, codes: torch.Tensor, block_size: int) -> None:
        if len(codes) < block_size + 1:
            raise ValueError(
                f"corpus of {len(codes)} characters is shorter than one block "
                f"(block_size={block_size} + 1); raise max_chars or lower block_size"
            )
        self.codes = codes
        self.block_size = block_size
        self.n = (len(codes) - 1) // block_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.codes[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class StdlibCharDataModule(pl.LightningDataModule):
    """Character-level blocks of the Python standard library's source.

    Args:
        block_size: characters per training example (the model's context length).
        batch_size: examples per batch per data-parallel replica (split into microbatches by
            the pipeline strategy).
        max_chars: corpus size cap (the first files in sorted order are used).
        val_fraction: share of the corpus, taken from its end, used for validation.
        num_workers: DataLoader workers (0 keeps CPU demos light).
        shuffle_seed: order of training blocks when no distributed sampler is injected.

    Example:
        >>> dm = StdlibCharDataModule(block_size=16, batch_size=2, max_chars=5_000)
        >>> dm.vocab_size
        128
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 32,
        max_chars: int = 2_000_000,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        shuffle_seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_chars = max_chars
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.shuffle_seed = shuffle_seed
        self.train_set: BlockDataset | None = None
        self.val_set: BlockDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        codes = encode(stdlib_text(self.max_chars))
        split = int(len(codes) * (1.0 - self.val_fraction))
        self.train_set = BlockDataset(codes[:split], self.block_size)
        self.val_set = BlockDataset(codes[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        gen = torch.Generator().manual_seed(self.shuffle_seed)
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            generator=gen,
            drop_last=True,  # every step sees a full batch: microbatches split evenly
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(
            self.val_set, batch_size=self.batch_size, drop_last=True, num_workers=self.num_workers
        )


@torch.no_grad()
def generate(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    prompt: str,
    max_new_tokens: int = 200,
    block_size: int = 128,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    printable_only: bool = True,
) -> str:
    """Continue ``prompt`` one character at a time with a model's ``(1, T) -> (1, T, V)`` logits.

    ``temperature == 0`` decodes greedily; otherwise samples from ``softmax(logits / T)``
    (optionally only among the ``top_k`` likeliest characters) with a fixed-seed generator, so a
    run's sample is reproducible. ``printable_only`` never emits control characters other than
    newline and tab (an undertrained model gives them some probability; they garble a terminal).

    Example:
        >>> uniform = lambda idx: torch.zeros(idx.shape[0], idx.shape[1], VOCAB_SIZE)
        >>> len(generate(uniform, "def ", max_new_tokens=5, block_size=8))
        5
    """
    gen = torch.Generator().manual_seed(seed)
    idx = encode(prompt or "\n").unsqueeze(0)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = logits_fn(idx[:, -block_size:])[:, -1, :].float().cpu()
        if printable_only:
            logits = logits.masked_fill(~_PRINTABLE[: logits.shape[-1]], float("-inf"))
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        out.append(int(nxt))
        idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
    return decode(out)
