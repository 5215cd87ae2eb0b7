"""Packed rows served in a seeded shuffled order per epoch (see packing.py for how rows are made)."""

from __future__ import annotations

import torch


class PackedText:
    """Fixed-length rows (``input_ids`` and, optionally, ``labels`` and ``position_ids``) in batches.

    Micro-batch ``i`` is a pure function of (seed, i), so the data position saved in a checkpoint (the
    number of micro-batches consumed) resumes exactly. An epoch's last batch may be smaller: no row is
    dropped.
    """

    def __init__(self, sequences: torch.Tensor | dict[str, torch.Tensor], batch_size: int, seed: int) -> None:
        tensors = sequences if isinstance(sequences, dict) else {"input_ids": sequences}
        rows = len(tensors["input_ids"])
        if rows < batch_size:
            raise ValueError(
                f"data yields {rows} sequence(s) of data.seq_len tokens, fewer than "
                f"training.batch_size={batch_size}; add data or lower data.seq_len"
            )
        self.tensors, self.batch_size, self.seed = tensors, batch_size, seed
        self.batches_per_epoch = -(-rows // batch_size)
        self.tokens_per_sample = tensors["input_ids"].shape[1]
        self._order: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """The ``index``-th micro-batch (CPU tensors), counting across epochs."""
        epoch, within = divmod(index, self.batches_per_epoch)
        rows = self._epoch_order(epoch)[within * self.batch_size : (within + 1) * self.batch_size]
        batch = {name: tensor[rows] for name, tensor in self.tensors.items()}
        if "labels" not in batch:
            batch["labels"] = batch["input_ids"].clone()
        return batch

    def in_order(self, index: int) -> dict[str, torch.Tensor]:
        """Batch ``index`` of the rows in their stored order (evaluation: the same batches every time)."""
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        batch = {name: tensor[rows] for name, tensor in self.tensors.items()}
        batch.setdefault("labels", batch["input_ids"].clone())
        return batch

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self), generator=generator))
        return self._order[1]
