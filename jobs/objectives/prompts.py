"""The prompts of ``training.objective: grpo`` (``data.format: prompt``) in the order a job samples them.

A row is TRL's prompt-only row or OpenAI's reinforcement row (jobs/data/formats/prompt.py reads either). Every
other column (``answer``, ``solution``, ...) travels with the prompt to the graders as ``{{item.<column>}}``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from jobs.data.formats.prompt import prompt_ids
from jobs.data.records import iter_records
from jobs.data.tokenizers import Tokenizer


@dataclass
class PromptData:
    """The job's prompts in a seeded order, ``batch_size`` a micro-batch, endless (each epoch reshuffled).

    Prompts that leave no room for ``max_new_tokens`` within ``data.seq_len`` are skipped and counted."""

    rows: list[tuple[list[int], dict[str, Any]]]
    batch_size: int
    seed: int
    skipped_long: int = 0

    @classmethod
    def from_spec(cls, spec: Any, tokenizer: Tokenizer) -> PromptData:
        data, grpo = spec.data, spec.training.grpo
        if data.path is None:
            raise ValueError("data.path: grpo reads prompt rows from a file (data.mix is not supported for grpo)")
        room = data.seq_len - grpo.max_new_tokens
        rows, long = [], 0
        for record in iter_records(data.path, data.file_type):
            try:
                ids = prompt_ids(record.fields, tokenizer)
            except ValueError as error:  # a RecordError naming the field
                raise ValueError(f"data.path: {record.file} row {record.row}: {error}") from None
            if not ids or len(ids) > room:
                long += 1
                continue
            rows.append((ids, dict(record.fields)))
        if not rows:
            raise ValueError(
                f"data.seq_len: no prompt fits in {data.seq_len} tokens with training.grpo.max_new_tokens "
                f"{grpo.max_new_tokens} ({long} rows too long); raise data.seq_len or lower max_new_tokens"
            )
        return cls(rows, spec.training.batch_size, spec.training.seed, long)

    @property
    def batches_per_epoch(self) -> int | None:
        return max(1, len(self.rows) // self.batch_size)

    @property
    def tokens_per_sample(self) -> int | None:
        return None  # a step's tokens are the sampled completions', reported with its grpo figures

    def prompts(self, index: int) -> list[tuple[list[int], dict[str, Any]]]:
        """Micro-batch ``index``'s prompts and their rows."""
        per_epoch = self.batches_per_epoch or 1
        epoch, within = divmod(index, per_epoch)
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        start = within * self.batch_size
        return [self.rows[order[(start + i) % len(order)]] for i in range(self.batch_size)]

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        raise TypeError("grpo data has prompts, not batches: the step samples its batch (GRPOLoss.rollout)")

    @property
    def summary(self) -> str:
        return f"{len(self.rows)} prompts; {self.skipped_long} skipped: longer than data.seq_len - max_new_tokens"
