"""Text data: JSONL or plain-text files, tokenized and packed into fixed-length sequences."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from jobs.data.tokenizers import Tokenizer
from jobs.paths import data_files

_SUFFIXES = (".jsonl", ".txt", ".text", ".md")


def read_documents(path: Path, fmt: str, text_field: str) -> list[str]:
    """Documents from a file or from every ``*.jsonl``/``*.txt`` file under a directory (sorted, so stable)."""
    # Only regular files, and no link out of the directory (a FIFO would hang the job, a link read outside).
    files = data_files(path, _SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"data.path {path} holds no {'/'.join(_SUFFIXES)} files")
    documents: list[str] = []
    for file in files:
        if (fmt == "auto" and file.suffix == ".jsonl") or fmt == "jsonl":
            documents.extend(_jsonl_texts(file, text_field))
        else:
            documents.append(file.read_text(encoding="utf-8"))
    return documents


def _jsonl_texts(file: Path, text_field: str) -> list[str]:
    texts = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ValueError(
                f"{file}:{number}: expected an object with a string '{text_field}' "
                "(set data.text_field to the right key)"
            )
        texts.append(record[text_field])
    return texts


def pack(documents: list[str], tokenizer: Tokenizer, seq_len: int) -> torch.Tensor:
    """Concatenate tokenized documents (each followed by EOS) and cut into rows of ``seq_len`` tokens."""
    ids: list[int] = []
    for document in documents:
        ids.extend(tokenizer.encode(document))
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
    rows = len(ids) // seq_len
    return torch.tensor(ids[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


class PackedText:
    """Packed sequences served in a seeded shuffled order per epoch.

    Micro-batch ``i`` is a pure function of (seed, i), so the data position saved in a checkpoint (the
    number of micro-batches consumed) resumes exactly. The last partial batch of an epoch is dropped.
    """

    def __init__(self, sequences: torch.Tensor, batch_size: int, seed: int) -> None:
        if len(sequences) < batch_size:
            raise ValueError(
                f"data yields {len(sequences)} sequence(s) of data.seq_len tokens, fewer than "
                f"training.batch_size={batch_size}; add text or lower data.seq_len"
            )
        self.sequences, self.batch_size, self.seed = sequences, batch_size, seed
        self.batches_per_epoch = len(sequences) // batch_size
        self.tokens_per_sample = sequences.shape[1]
        self._order: tuple[int, torch.Tensor] | None = None

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """The ``index``-th micro-batch (CPU tensors), counting across epochs."""
        epoch, within = divmod(index, self.batches_per_epoch)
        rows = self._epoch_order(epoch)[within * self.batch_size : (within + 1) * self.batch_size]
        input_ids = self.sequences[rows]
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.sequences), generator=generator))
        return self._order[1]
