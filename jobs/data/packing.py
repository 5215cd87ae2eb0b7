"""Examples into fixed-length rows (packing) or into length-grouped padded batches.

Packed rows carry ``position_ids`` that restart at 0 for every document. With no ``attention_mask``,
transformers (>= 4.47's ``masking_utils.find_packed_sequence_indices``) reads those restarts and builds a
block-diagonal causal mask for sdpa/eager attention (flash-attention uses them as ``cu_seqlens``), so a
token never attends to another document. The first token of each document gets label -100: nothing before
it in its own document predicts it. Models without that path get length-grouped padding instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jobs.data.formats.examples import IGNORE, Example


@dataclass
class PackingCounts:
    """What preparation did to the examples, reported at job start (nothing is dropped silently)."""

    examples: int = 0
    truncated: int = 0  # longer than data.seq_len: cut to it
    skipped: int = 0  # no trained token left (empty, or the response cut away by truncation)
    sequences: int = 0
    padding_tokens: int = 0
    notes: list[str] = field(default_factory=list)


def concatenate(
    examples: list[Example], seq_len: int, pad_id: int, *, restart_positions: bool
) -> tuple[dict[str, torch.Tensor], PackingCounts]:
    """Plain text: documents back to back, cut every ``seq_len`` tokens; the last row is padded, not dropped."""
    counts = PackingCounts(examples=len(examples))
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for example in examples:
        ids += example.input_ids
        labels += [IGNORE, *example.labels[1:]] if restart_positions else example.labels
        positions += range(len(example.input_ids))
    rows = -(-len(ids) // seq_len)
    counts.padding_tokens = rows * seq_len - len(ids)
    ids += [pad_id] * counts.padding_tokens
    labels += [IGNORE] * counts.padding_tokens
    positions += range(counts.padding_tokens)
    counts.sequences = rows
    tensors = {"input_ids": _rows(ids, seq_len), "labels": _rows(labels, seq_len)}
    if restart_positions:
        # A document cut at a row boundary goes on at position 0 in the next row: a row is its own context.
        tensors["position_ids"] = _restart_at_row_start(_rows(positions, seq_len))
    return tensors, counts


def pack(examples: list[Example], seq_len: int, pad_id: int) -> tuple[dict[str, torch.Tensor], PackingCounts]:
    """Whole examples into rows of ``seq_len`` (first fit in order); a longer example is truncated to one row."""
    counts = PackingCounts()
    rows: list[tuple[list[int], list[int], list[int]]] = []
    current: tuple[list[int], list[int], list[int]] = ([], [], [])
    for example in _fitted(examples, seq_len, counts):
        if len(current[0]) + len(example.input_ids) > seq_len:
            rows.append(current)
            current = ([], [], [])
        current[0].extend(example.input_ids)
        current[1].extend([IGNORE, *example.labels[1:]])
        current[2].extend(range(len(example.input_ids)))
    if current[0]:
        rows.append(current)
    for ids, labels, positions in rows:
        pad = seq_len - len(ids)
        counts.padding_tokens += pad
        ids.extend([pad_id] * pad)
        labels.extend([IGNORE] * pad)
        positions.extend(range(pad))
    counts.sequences = len(rows)
    as_tensor = lambda index: torch.tensor([row[index] for row in rows], dtype=torch.long).view(-1, seq_len)  # noqa: E731
    return {"input_ids": as_tensor(0), "labels": as_tensor(1), "position_ids": as_tensor(2)}, counts


def fit_examples(examples: list[Example], seq_len: int) -> tuple[list[Example], PackingCounts]:
    """Examples truncated to ``seq_len``, those with nothing left to train on skipped (for padded batches)."""
    counts = PackingCounts()
    fitted = list(_fitted(examples, seq_len, counts))
    counts.sequences = len(fitted)
    return fitted, counts


def _fitted(examples: list[Example], seq_len: int, counts: PackingCounts) -> list[Example]:
    kept = []
    for example in examples:
        if len(example.input_ids) > seq_len:
            counts.truncated += 1
            example = Example(example.input_ids[:seq_len], example.labels[:seq_len])
        # The first label never trains (nothing precedes it), so a lone trained first token counts as none.
        if not any(label != IGNORE for label in example.labels[1:]):
            counts.skipped += 1
            continue
        kept.append(example)
    counts.examples = len(kept)
    return kept


def _rows(values: list[int], seq_len: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).view(-1, seq_len)


def _restart_at_row_start(positions: torch.Tensor) -> torch.Tensor:
    """Position ids counted from the row start for the document the row begins inside."""
    out = positions.clone()
    for row in out:
        first_restart = (row == 0).nonzero()
        head = int(first_restart[0]) if len(first_restart) else len(row)
        row[:head] = torch.arange(head)
    return out
