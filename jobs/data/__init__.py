"""Data sources chosen by ``data.kind``. Each serves micro-batch ``i`` as a pure function of (seed, i)."""

from __future__ import annotations

from typing import Protocol

import torch

from jobs.data.synthetic import SyntheticRegression
from jobs.data.text import PackedText, pack, read_documents
from jobs.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer


class BatchSource(Protocol):
    """What the runner needs from data: random access to micro-batches by position."""

    batch_size: int
    batches_per_epoch: int | None  # None: endless
    tokens_per_sample: int | None  # None: not token data

    def batch(self, index: int) -> dict[str, torch.Tensor]: ...


def build_data(spec: object, *, batch_size: int, seed: int, width: int | None = None) -> tuple[BatchSource, int | None]:
    """The batch source for a ``data`` section, and the tokenizer's vocabulary size (None without one).

    Args:
        spec: The data section.
        batch_size: Micro-batch size.
        seed: Shuffling / generation seed.
        width: The model's input width (synthetic regression only).
    """
    if spec.kind == "synthetic_regression":
        return SyntheticRegression(width, batch_size, spec.offset, seed), None
    tokenizer = build_tokenizer(spec.tokenizer)
    sequences = pack(read_documents(spec.path, spec.format, spec.text_field), tokenizer, spec.seq_len)
    return PackedText(sequences, batch_size, seed), tokenizer.vocab_size


__all__ = [
    "BatchSource",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedText",
    "SyntheticRegression",
    "Tokenizer",
    "build_data",
]
