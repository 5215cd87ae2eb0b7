"""The GGUF export proven in llama.cpp itself: a model trained by a Ferry job, exported as f16, q8_0 and q4_k_m,
loaded by llama.cpp (llama-cpp-py-sync's build), gives the safetensors checkpoint's tokens in transformers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from jobs import PathRoots
from jobs.cli import main
from tests.jobs.checkpoints.llama_cpp import LlamaCpp, load_llama_cpp
from tests.jobs.checkpoints.test_export import train
from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl

RECORDS = [chat_record(i) for i in range(8)]
QUANTS = ("f16", "q8_0", "q4_k_m")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A full fine-tune that learns its chats, its checkpoint, and the checkpoint's three GGUF exports."""
    package = load_llama_cpp(tmp_path_factory.mktemp("llama-cpp"))
    tmp = tmp_path_factory.mktemp("trained")
    models, data = tmp / "models", tmp / "data"
    save_bpe_tokenizer(models / "tok")
    # Rows 256 wide (hidden) and 512 (ffn_down's input): Q4_K's super-blocks, no fallback types.
    save_llama(models / "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    write_jsonl(data / "chat.jsonl", RECORDS)
    roots = PathRoots(model_roots=[models], data_roots=[data])
    training = {"steps": 30, "batch_size": 4, "learning_rate": 3e-3}
    with pytest.MonkeyPatch.context() as monkeypatch:
        checkpoint, _ = train(llm_spec(lora=None, training=training), roots, tmp / "out", monkeypatch)
    for quant in QUANTS:
        assert main(["export", str(checkpoint), "--quant", quant, "--output", str(tmp / f"{quant}.gguf")]) == 0
    return {"package": package, "checkpoint": checkpoint, "dir": tmp}


@pytest.fixture(scope="module")
def reference(exported: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = str(exported["checkpoint"])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(checkpoint)


def open_gguf(exported: dict[str, Any], quant: str) -> Iterator[LlamaCpp]:
    model = LlamaCpp(exported["package"], exported["dir"] / f"{quant}.gguf")
    try:
        yield model
    finally:
        model.close()


@pytest.fixture(scope="module", params=QUANTS)
def llama_cpp(request: pytest.FixtureRequest, exported: dict[str, Any]) -> Iterator[tuple[str, LlamaCpp]]:
    for model in open_gguf(exported, request.param):
        yield request.param, model


def prompts(tokenizer: Any) -> list[list[int]]:
    """Each training chat's system and user turns with the assistant's turn opened: what the model learnt."""
    out = []
    for record in RECORDS:
        text = tokenizer.apply_chat_template(record["messages"][:2], tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def hf_greedy(model: Any, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=3)
    return [int(t) for t in out[0, len(ids) :]]


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return np.asarray(model(input_ids=torch.tensor([ids])).logits[0].numpy())


# Logit tolerance against the float32 checkpoint, by weight type: f16 rounds each weight to 11 bits, q8_0 to
# 8 bits per 32-weight block, q4_k_m to 4 and 6 bits per super-block (measured on this model with llama.cpp
# b11739: 0.003, 0.04 and 0.5 at worst).
ATOL = {"f16": 0.05, "q8_0": 0.15, "q4_k_m": 1.0}


def test_llama_cpp_loads_the_file_as_the_architecture_and_vocabulary_written(
    llama_cpp: tuple[str, LlamaCpp], reference: tuple[Any, Any]
) -> None:
    _, model = llama_cpp
    _, tokenizer = reference
    assert model.meta("general.architecture") == "llama"
    assert model.n_vocab == len(tokenizer) == 320
    assert model.llm.n_layer == 2


def test_llama_cpp_tokenizes_as_the_hugging_face_tokenizer(
    llama_cpp: tuple[str, LlamaCpp], reference: tuple[Any, Any]
) -> None:
    _, model = llama_cpp
    _, tokenizer = reference
    texts = [
        "the quick brown fox",
        " ferry streams weights to the device and back",
        "<|im_start|>user\nover a lazy dog<|im_end|>\n",  # special tokens matched whole, as CONTROL tokens
        "unseen words: Zürich, 1234, tabs\tand  double  spaces",  # byte-level fallback, digits, whitespace
    ]
    for text in texts:
        assert model.tokenize(text) == tokenizer(text).input_ids, text


def test_llama_cpp_applies_the_chat_template_as_transformers_does(
    llama_cpp: tuple[str, LlamaCpp], reference: tuple[Any, Any]
) -> None:
    _, model = llama_cpp
    _, tokenizer = reference
    chat = RECORDS[0]["messages"] + [{"role": "user", "content": "the lazy dog"}]
    expected = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert model.apply_chat_template(chat) == expected


def test_llama_cpp_logits_match_the_checkpoint_within_the_quant_error(
    llama_cpp: tuple[str, LlamaCpp], reference: tuple[Any, Any]
) -> None:
    """Every position of every prompt: a wrong tensor name, q/k order or norm would be off by whole units."""
    quant, model = llama_cpp
    hf, tokenizer = reference
    worst = 0.0
    for ids in prompts(tokenizer):
        got, expected = model.logits(ids), hf_logits(hf, ids)
        assert got.shape == expected.shape
        worst = max(worst, float(np.abs(got - expected).max()))
        assert (got[-1].argmax() == expected[-1].argmax()).all()  # the first reply token
    assert worst < ATOL[quant], f"{quant}: logits off by {worst:.3f}"


def test_llama_cpp_generates_the_checkpoint_greedy_tokens(
    llama_cpp: tuple[str, LlamaCpp], reference: tuple[Any, Any]
) -> None:
    """f16 and q8_0: the same 8 greedy tokens on every prompt. q4_k_m: identical up to the first difference in
    at least 90% of them: its 4-bit weights may flip a near tie late in a reply, never the learnt replies."""
    quant, model = llama_cpp
    hf, tokenizer = reference
    agree = total = 0
    for ids in prompts(tokenizer):
        expected, got = hf_greedy(hf, ids, 8), model.greedy(ids, 8)
        if quant != "q4_k_m":
            assert got == expected, tokenizer.decode(ids)
        agree += next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), len(expected))
        total += len(expected)
    assert agree >= 0.9 * total, f"{quant}: {agree} of {total} greedy tokens as the checkpoint's"
