"""Byte-level language-modelling data from the corpus that ships with zerodp.

The corpus (``zerodp/demo/corpus/devils_dictionary.txt.gz``, public domain; see
``corpus/README.md``) is encoded one token per byte, so the vocabulary is the
256 byte values and no tokenizer is needed.

[Note: rank slicing of batches]
Every data-parallel rank draws the *global* batch of ``batch_size * world_size``
random offsets from an identically seeded generator and keeps rows
``rank * batch_size : (rank + 1) * batch_size``. So the generators of all ranks
advance in lockstep, the ranks see disjoint rows of one global batch, and a
single process that draws the global batch reproduces exactly what the ranks
see together, which is what lets a ZeRO run be compared step by step with a DDP
or single-process reference.
"""

from __future__ import annotations

import gzip
import logging
from dataclasses import dataclass
from importlib import resources
from typing import Literal

import torch

logger = logging.getLogger(__name__)

CORPUS_FILE = "devils_dictionary.txt.gz"
VOCAB_SIZE = 256

Split = Literal["train", "val"]


def load_corpus() -> bytes:
    """Return the bundled corpus as raw (ASCII) bytes."""
    path = resources.files("zerodp.demo") / "corpus" / CORPUS_FILE
    data = gzip.decompress(path.read_bytes())
    logger.debug("loaded corpus %s: %d bytes", CORPUS_FILE, len(data))
    return data


def encode(text: str | bytes) -> torch.Tensor:
    """Encode text as a 1-D int64 tensor of byte values (UTF-8 for ``str``)."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def decode(ids: torch.Tensor | list[int]) -> str:
    """Decode byte ids to text; invalid UTF-8 becomes U+FFFD rather than an error."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(values).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TokenSplits:
    """The encoded corpus cut into a leading train part and a trailing val part."""

    train: torch.Tensor
    val: torch.Tensor

    def get(self, split: Split) -> torch.Tensor:
        if split == "train":
            return self.train
        if split == "val":
            return self.val
        raise ValueError(f"split={split!r}: must be 'train' or 'val'")


def split_tokens(tokens: torch.Tensor, val_fraction: float = 0.1) -> TokenSplits:
    """Cut ``tokens`` into train (first ``1 - val_fraction``) and val (the rest).

    A contiguous cut, as nanoGPT does, keeps val text unseen during training.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: must be strictly between 0 and 1")
    n_train = int(len(tokens) * (1.0 - val_fraction))
    return TokenSplits(train=tokens[:n_train], val=tokens[n_train:])


def load_splits(val_fraction: float = 0.1) -> TokenSplits:
    """Encode the bundled corpus and split it 90/10 (by default) into train/val."""
    return split_tokens(encode(load_corpus()), val_fraction)


def get_batch(
    data: TokenSplits | torch.Tensor,
    split: Split,
    batch_size: int,
    block_size: int,
    generator: torch.Generator,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw this rank's ``(x, y)`` batch, each int64 of shape (batch_size, block_size).

    ``y`` is ``x`` shifted by one token. ``data`` may be a ``TokenSplits`` (then
    ``split`` picks the part) or a 1-D token tensor (then ``split`` is ignored).
    The generator advances by one global draw per call on every rank; see
    [Note: rank slicing of batches].
    """
    tokens = data.get(split) if isinstance(data, TokenSplits) else data
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size"
        )
    if len(tokens) <= block_size:
        raise ValueError(
            f"block_size={block_size} needs more than {block_size} tokens but the "
            f"{split!r} data has {len(tokens)}: use a smaller block_size or more data"
        )
    offsets = torch.randint(
        len(tokens) - block_size, (batch_size * world_size,), generator=generator
    )
    mine = offsets[rank * batch_size : (rank + 1) * batch_size]
    window = mine[:, None] + torch.arange(block_size + 1)
    rows = tokens[window]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class TokenBatches:
    """Endless iterator of one rank's batches, seeded for reproducibility.

    All ranks must use the same ``seed``; see [Note: rank slicing of batches].
    """

    def __init__(
        self,
        data: TokenSplits,
        split: Split,
        batch_size: int,
        block_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.data = data
        self.split: Split = split
        self.batch_size = batch_size
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(
            self.data,
            self.split,
            self.batch_size,
            self.block_size,
            self.generator,
            rank=self.rank,
            world_size=self.world_size,
        )
