"""Tokenizers for text data: a byte-level one built in, or a Hugging Face tokenizer from a local directory."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """What packing needs from a tokenizer."""

    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; id 256 ends a document. Needs no files and covers any text."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never downloaded)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer  # slow import; only this tokenizer needs it

        self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        self.vocab_size = len(self._tokenizer)
        self.eos_id = self._tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def build_tokenizer(spec: object) -> Tokenizer:
    """The tokenizer a ``data.tokenizer`` section names."""
    return ByteTokenizer() if spec.kind == "byte" else HFTokenizer(spec.path)
