"""Length-grouped padded batches, for models that cannot keep packed documents apart.

As transformers' ``LengthGroupedSampler``: shuffle by the seed, then sort by length inside windows of
``50 * batch_size`` examples, so each batch holds examples of similar length and little padding, while the
order still changes every epoch. Batch ``i`` is a pure function of (seed, i), so resume is exact.
"""

from __future__ import annotations

import torch

from jobs.data.formats.examples import IGNORE, Example

WINDOW_BATCHES = 50


class PaddedBatches:
    """Examples right-padded to the longest of their batch, with an ``attention_mask``; no example dropped."""

    def __init__(self, examples: list[Example], batch_size: int, seed: int, pad_id: int) -> None:
        if len(examples) < batch_size:
            raise ValueError(
                f"data yields {len(examples)} example(s), fewer than training.batch_size={batch_size}; "
                "add data or lower the batch size"
            )
        self.examples, self.batch_size, self.seed, self.pad_id = examples, batch_size, seed, pad_id
        self.batches_per_epoch = -(-len(examples) // batch_size)
        self.tokens_per_sample = round(sum(len(e.input_ids) for e in examples) / len(examples))
        self._order: tuple[int, list[list[int]]] | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """The ``index``-th micro-batch (CPU tensors), counting across epochs."""
        epoch, within = divmod(index, self.batches_per_epoch)
        return self._collate(self._epoch_batches(epoch)[within])

    def in_order(self, index: int) -> dict[str, torch.Tensor]:
        """Batch ``index`` in stored order (evaluation: the same batches every time)."""
        return self._collate(list(range(index * self.batch_size, min(len(self), (index + 1) * self.batch_size))))

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self), generator=generator).tolist()
            window = WINDOW_BATCHES * self.batch_size
            grouped: list[int] = []
            for start in range(0, len(order), window):
                chunk = order[start : start + window]
                grouped += sorted(chunk, key=lambda i: -len(self.examples[i].input_ids))
            batches = [grouped[i : i + self.batch_size] for i in range(0, len(grouped), self.batch_size)]
            self._order = (epoch, batches)
        return self._order[1]

    def _collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return pad_examples([self.examples[i] for i in indices], self.pad_id)


def pad_examples(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels`` (-100 on padding) and ``attention_mask`` of ``examples``, right-padded to the
    longest."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
