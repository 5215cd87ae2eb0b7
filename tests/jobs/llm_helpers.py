"""A tiny Llama-style model (in memory or saved) and a byte-level BPE tokenizer trained in the test, with chat and
alpaca data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "ferry",
    "streams",
    "weights",
    "to",
    "the",
    "device",
    "and",
    "back",
]


def corpus_lines(count: int = 200) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    return [
        " ".join(WORDS[i] for i in torch.randint(len(WORDS), (12,), generator=generator).tolist()) for _ in range(count)
    ]


def save_bpe_tokenizer(directory: Path, *, chat_template: str | None = CHATML, vocab_size: int = 320) -> Path:
    """Train a byte-level BPE on a small corpus (seconds) and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus_lines(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<|endoftext|>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return directory


def tiny_llama(vocab_size: int = 320, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A two-layer Llama of hidden size 32, its weights drawn from ``seed`` (float32, in memory)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    options = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    options.update(overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**options))


def save_llama(directory: Path, vocab_size: int = 320, **overrides: Any) -> Path:
    """`tiny_llama` saved as a transformers checkpoint in ``directory``."""
    tiny_llama(vocab_size, **overrides).save_pretrained(directory)
    return directory


def chat_record(index: int) -> dict[str, Any]:
    words = corpus_lines(400)
    return {
        "messages": [
            {"role": "system", "content": "answer briefly"},
            {"role": "user", "content": words[2 * index]},
            {"role": "assistant", "content": words[2 * index + 1]},
        ]
    }


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def llm_spec(**sections: Any) -> dict[str, Any]:
    """A chat LoRA job on the tiny Llama (``models/llama``, ``models/tok``, ``data/chat.jsonl``)."""
    spec: dict[str, Any] = {
        "name": "tiny-chat",
        "device": "cpu",
        "model": {"kind": "hf_causal_lm", "path": "llama", "dtype": "float32"},
        "data": {
            "kind": "text",
            "path": "chat.jsonl",
            "format": "chat",
            "seq_len": 64,
            "tokenizer": {"kind": "hf", "path": "tok"},
        },
        "lora": {"target_modules": ["q_proj", "v_proj"], "rank": 4, "alpha": 8},
        "training": {"steps": 6, "batch_size": 2, "learning_rate": 1e-2},
    }
    for key, value in sections.items():
        if value is None:
            spec.pop(key, None)
        elif isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec
