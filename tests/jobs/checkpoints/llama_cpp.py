"""llama.cpp itself, through llama-cpp-py-sync's bindings: load a GGUF, tokenize, read logits, apply its template.

The bindings are llama.cpp's C API called through CFFI; :class:`LlamaCpp` calls that API directly (decode a
batch, ``llama_get_logits_ith``, ``llama_chat_apply_template``) so the tests compare llama.cpp's numbers, not
a wrapper's sampling. Greedy decoding is the argmax of those logits, one token at a time through the KV cache,
as llama.cpp's own generation does it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.jobs.checkpoints.c23_imports import relink_c23_imports

WARN = 3  # ggml_log_level: llama.cpp's warnings and errors reach stderr, its load chatter does not
_keep: list[Any] = []  # CFFI callbacks must outlive their registration


def load_llama_cpp(cache_dir: Path) -> Any:
    """``llama_cpp_py_sync`` with its library loaded; skips when the package is not installed."""
    package = pytest.importorskip("llama_cpp_py_sync", reason="needs the llamacpp extra: pip install '.[llamacpp]'")
    bindings = package._cffi_bindings
    try:
        bindings.get_lib()
    except RuntimeError as error:
        if "GLIBC_2.38" not in str(error):
            raise
        relinked = relink_c23_imports(Path(bindings.__file__).parent, cache_dir / "llama-cpp-libs")
        bindings._lib = bindings.ffi.dlopen(str(relinked / "libllama.so"))
    lib, ffi = bindings._lib, bindings.ffi

    @ffi.callback("ggml_log_callback")
    def log(level: int, text: Any, _: Any) -> None:
        if level >= WARN and level != 5:  # 5: a continuation of the previous line
            sys.stderr.write(ffi.string(text).decode(errors="replace"))

    _keep.append(log)
    lib.llama_log_set(log, ffi.NULL)
    return package


class LlamaCpp:
    """One GGUF file loaded by llama.cpp on the CPU, with a context of ``n_ctx`` tokens."""

    def __init__(self, package: Any, path: Path, n_ctx: int = 256) -> None:
        self.llm = package.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=2)
        self.lib, self.ffi, self.ctx = self.llm._lib, self.llm._ffi, self.llm._ctx
        self.n_vocab = self.llm.n_vocab

    def close(self) -> None:
        self.llm.close()

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's tokens for ``text``: its BOS if the file says to add one, special tokens matched whole."""
        return list(self.llm.tokenize(text, add_special=True, parse_special=True))

    def meta(self, key: str) -> str | None:
        buffer = self.ffi.new("char[4096]")
        size = self.lib.llama_model_meta_val_str(self.llm._model, key.encode(), buffer, 4096)
        return None if size < 0 else self.ffi.string(buffer).decode()

    def _decode(self, ids: list[int], start: int, all_logits: bool) -> np.ndarray:
        batch = self.lib.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or i == len(ids) - 1
            assert self.lib.llama_decode(self.ctx, batch) == 0, "llama_decode failed"
        finally:
            self.lib.llama_batch_free(batch)
        rows = range(len(ids)) if all_logits else [len(ids) - 1]
        return np.stack([self._logits_row(i) for i in rows])

    def _logits_row(self, i: int) -> np.ndarray:
        pointer = self.lib.llama_get_logits_ith(self.ctx, i)
        return np.frombuffer(self.ffi.buffer(pointer, self.n_vocab * 4), dtype=np.float32).copy()

    def logits(self, ids: list[int]) -> np.ndarray:
        """The logits at every position of ``ids``, a fresh sequence: shape (len(ids), vocabulary)."""
        self.llm._clear_context_state()
        return self._decode(ids, 0, all_logits=True)

    def greedy(self, ids: list[int], new_tokens: int) -> list[int]:
        """``new_tokens`` greedy continuations of ``ids`` through llama.cpp's KV cache."""
        self.llm._clear_context_state()
        logits = self._decode(ids, 0, all_logits=False)[-1]
        out: list[int] = []
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            logits = self._decode([out[-1]], len(ids) + len(out) - 1, all_logits=False)[-1]
        return out

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """llama.cpp's rendering of ``messages`` with the file's ``tokenizer.chat_template``, assistant turn open."""
        template = self.lib.llama_model_chat_template(self.llm._model, self.ffi.NULL)
        assert template != self.ffi.NULL, "the GGUF has no tokenizer.chat_template"
        keep = [
            (self.ffi.new("char[]", m["role"].encode()), self.ffi.new("char[]", m["content"].encode()))
            for m in messages
        ]
        array = self.ffi.new("llama_chat_message[]", len(messages))
        for i, (role, content) in enumerate(keep):
            array[i].role, array[i].content = role, content
        size = 8192
        out = self.ffi.new(f"char[{size}]")
        written = self.lib.llama_chat_apply_template(template, array, len(messages), True, out, size)
        assert 0 <= written <= size, f"llama.cpp does not know this chat template ({written})"
        return str(self.ffi.string(out, written).decode())
