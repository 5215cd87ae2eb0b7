"""Tokenizers for text data: a byte-level one built in, or a Hugging Face tokenizer from a local directory."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

# ChatML (Qwen's, OpenAI's): ``data.chat_template: chatml`` for a tokenizer that ships no template.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' test for an assistant-mask template


class Tokenizer(Protocol):
    """What data preparation and sampling need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int | None: ...
    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; id 256 ends a document. Needs no files and covers any text."""

    vocab_size = 257
    eos_id = 256
    pad_id = 256  # padded positions never train (label -100), so any valid id serves

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never downloaded).

    Args:
        path: The tokenizer's directory.
        chat_template: A Jinja template (or ``"chatml"``) replacing the tokenizer's own, if any.
    """

    def __init__(self, path: Path, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer  # slow import; only this tokenizer needs it

        self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        if chat_template is not None:
            self.hf.chat_template = CHATML if chat_template == "chatml" else chat_template
        self.vocab_size = len(self.hf)
        self.eos_id = self.hf.eos_token_id
        pad = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id
        self.pad_id = int(pad) if pad is not None else 0

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def marks_generation(self) -> bool:
        """Whether the chat template marks assistant text with ``{% generation %}`` (transformers' assistant
        mask; the mask needs a fast tokenizer's offsets)."""
        template = getattr(self.hf, "chat_template", None)
        return isinstance(template, str) and bool(GENERATION_MARK.search(template)) and bool(self.hf.is_fast)

    def assistant_mask(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], list[int]]:
        """The conversation's ids through the chat template and transformers' assistant mask (1 on each token
        of a ``{% generation %}`` block), from ``apply_chat_template(return_assistant_tokens_mask=True)``."""
        given: Any = tools
        out: Any = self.hf.apply_chat_template(
            messages, tools=given, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), list(out["assistant_masks"])

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The conversation as text through the chat template (``apply_chat_template``, untokenized), with
        ``tools`` (tool definitions) where the record has them."""
        given: Any = tools  # transformers types it list[dict | Callable]; a list is invariant
        text = self.hf.apply_chat_template(
            messages, tools=given, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)


def build_tokenizer(spec: Any, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer a ``data.tokenizer`` section names."""
    return ByteTokenizer() if spec.kind == "byte" else HFTokenizer(spec.path, chat_template)
