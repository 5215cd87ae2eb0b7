"""A tokenized training example and the error a record that does not fit ``data.format`` raises.

Shared by the formats (formats.py, chat.py) and the batchers (packing.py, padded.py).
"""

from __future__ import annotations

from dataclasses import dataclass

IGNORE = -100  # the label of a token the loss skips (PyTorch's and Hugging Face's ignore index)


@dataclass
class Example:
    """One tokenized record: ids and their labels (same length)."""

    input_ids: list[int]
    labels: list[int]

    @property
    def trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE)


class RecordError(ValueError):
    """A record does not fit ``data.format``; ``field`` names the offending field (``messages[1].role``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"field '{field}': {message}")
        self.field, self.message = field, message
