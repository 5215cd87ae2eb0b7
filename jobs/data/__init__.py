"""Data sources chosen by ``data.kind``. Each serves micro-batch ``i`` as a pure function of (seed, i).

The names below are imported on first use (PEP 562), so that the record checks of ``jobs.data.formats``
(which the service's API process runs on uploaded files) import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from jobs.data.padded import PaddedBatches
    from jobs.data.prepare import TextData, model_keeps_documents_apart, prepare_text_data
    from jobs.data.synthetic import SyntheticRegression
    from jobs.data.text import PackedText
    from jobs.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

_HOME = {
    "PaddedBatches": "jobs.data.padded",
    "TextData": "jobs.data.prepare",
    "model_keeps_documents_apart": "jobs.data.prepare",
    "prepare_text_data": "jobs.data.prepare",
    "SyntheticRegression": "jobs.data.synthetic",
    "PackedText": "jobs.data.text",
    "ByteTokenizer": "jobs.data.tokenizers",
    "HFTokenizer": "jobs.data.tokenizers",
    "Tokenizer": "jobs.data.tokenizers",
    "build_tokenizer": "jobs.data.tokenizers",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'jobs.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


class BatchSource(Protocol):
    """What the runner needs from data: random access to micro-batches by position."""

    @property
    def batch_size(self) -> int: ...
    @property
    def batches_per_epoch(self) -> int | None: ...  # None: endless
    @property
    def tokens_per_sample(self) -> int | None: ...  # None: not token data

    def batch(self, index: int) -> dict[str, torch.Tensor]: ...


def build_data(
    spec: Any,
    *,
    batch_size: int,
    seed: int,
    width: int | None = None,
    packed_path: bool = False,
    eval_spec: Any = None,
) -> tuple[BatchSource, int | None]:
    """The training batch source for a ``data`` section, and the tokenizer's vocabulary size (None without one).

    Args:
        spec: The data section.
        batch_size: Micro-batch size.
        seed: Shuffling / generation seed.
        width: The model's input width (synthetic regression only).
        packed_path: The model keeps packed documents apart (see `prepare_text_data`).
        eval_spec: The ``eval`` section, whose held-out records the training source leaves out.
    """
    from jobs.data.prepare import prepare_text_data
    from jobs.data.synthetic import SyntheticRegression

    if spec.kind == "synthetic_regression":
        if width is None:
            raise ValueError("data.kind=synthetic_regression needs a model with an input width (e.g. toy_mlp)")
        return SyntheticRegression(width, batch_size, spec.offset, seed), None
    text = prepare_text_data(spec, batch_size=batch_size, seed=seed, packed_path=packed_path, eval_spec=eval_spec)
    return text.train, text.tokenizer.vocab_size


__all__ = [
    "BatchSource",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedText",
    "PaddedBatches",
    "SyntheticRegression",
    "TextData",
    "Tokenizer",
    "build_data",
    "build_tokenizer",
    "model_keeps_documents_apart",
    "prepare_text_data",
]
