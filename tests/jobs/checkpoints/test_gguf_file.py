"""GGUF export: transformers' GGUF loader and llama.cpp's reader (the ``gguf`` package) read what Ferry writes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from jobs import PathRoots
from jobs.checkpoints.gguf_file import export_gguf, pre_tokenizer_name, write_gguf
from jobs.checkpoints.gguf_quants import check_quant
from jobs.checkpoints.ollama_modelfile import CHATML, LLAMA3, map_chat_template, write_modelfile
from jobs.cli import main
from tests.jobs.checkpoints.test_export import train
from tests.jobs.llm_helpers import CHATML as CHATML_JINJA
from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl

gguf = pytest.importorskip("gguf")

IDS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12]])
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def save_tiny(directory: Path, model_type: str, dtype: torch.dtype = torch.float32) -> Path:
    """A random tiny model of ``model_type`` with the test BPE tokenizer beside it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=320, max_position_embeddings=256, **TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # norms of ones would hide a norm written as the wrong tensor
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    save_bpe_tokenizer(directory)
    return directory


def load_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def fields(path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_f32_gguf_loads_in_transformers_with_the_same_weights_and_logits(tmp_path: Path, model_type: str) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny(tmp_path / f"tiny-{model_type}", model_type)
    written = write_gguf(model_dir, tmp_path / "model.gguf", "f32")
    loaded = load_gguf(written.path)
    original = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    expected = original.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():  # q/k permuted for llama.cpp and back: bit for bit
        assert torch.equal(got[name], tensor), name
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, original(input_ids=IDS).logits)
    assert written.architecture == {"mistral": "llama"}.get(model_type, model_type)


def test_the_metadata_and_tensors_are_what_llama_cpp_reads(tmp_path: Path) -> None:
    model_dir = save_tiny(tmp_path / "llama", "llama")
    written = write_gguf(model_dir, tmp_path / "model.gguf", "f16")
    meta = fields(written.path)
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    assert meta["general.architecture"] == "llama"
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    assert meta["llama.context_length"] == 256
    assert meta["llama.block_count"] == 2
    assert meta["llama.attention.head_count_kv"] == 2
    assert meta["llama.rope.dimension_count"] == 8
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert len(meta["tokenizer.ggml.tokens"]) == config["vocab_size"]
    assert meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"
    assert meta["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 3]  # the special tokens are CONTROL
    assert len(meta["tokenizer.ggml.merges"]) == len(tokenizer["model"]["merges"])
    assert meta["tokenizer.ggml.eos_token_id"] == 2
    assert meta["tokenizer.chat_template"] == CHATML_JINJA
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(written.path)).tensors}
    assert types["token_embd.weight"] == "F16" and types["blk.1.attn_q.weight"] == "F16"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["output_norm.weight"] == "F32"
    assert len(types) == written.tensor_count == 2 * 9 + 3


def test_q8_0_and_bf16(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny(tmp_path / "llama", "llama", dtype=torch.bfloat16)
    original = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    bf16 = load_gguf(write_gguf(model_dir, tmp_path / "bf16.gguf", "bf16").path)
    q8 = write_gguf(model_dir, tmp_path / "q8.gguf", "q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(q8.path)).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    with torch.no_grad():
        expected = original(input_ids=IDS).logits
        assert torch.equal(bf16(input_ids=IDS).logits, expected)  # bf16 weights stored as they are
        torch.testing.assert_close(load_gguf(q8.path)(input_ids=IDS).logits, expected, rtol=0, atol=0.05)
    assert q8.size_bytes < 0.6 * (tmp_path / "bf16.gguf").stat().st_size


def save_spm_tokenizer(directory: Path) -> Path:
    """A Llama 2 / Mistral style tokenizer: BPE over "▁"-marked words with byte fallback (<0x00>..<0xFF>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.jobs.llm_helpers import corpus_lines

    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    backend.train_from_iterator(corpus_lines(), trainer)
    data = json.loads(backend.to_str())  # the byte tokens are vocabulary, not added tokens, as in Llama 2's
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in byte_tokens]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(directory)
    return directory


def test_a_sentencepiece_style_vocabulary_is_written_as_llama_cpp_llama_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "tiny-mistral-spm"
    torch.manual_seed(0)
    config = AutoConfig.for_model("mistral", vocab_size=400, max_position_embeddings=256, **TINY)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    save_spm_tokenizer(model_dir)
    written = write_gguf(model_dir, tmp_path / "spm.gguf", "f32")
    meta = fields(written.path)
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.pre"] == "default"
    assert meta["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 6]  # <unk> <s> </s> are CONTROL, <0x00> BYTE
    assert meta["tokenizer.ggml.add_bos_token"] is False  # this tokenizer adds none; a reader must not either
    scores = meta["tokenizer.ggml.scores"]
    assert scores[300] > scores[350]  # earlier merges score higher: llama.cpp merges them first
    original = AutoTokenizer.from_pretrained(str(model_dir))
    from_gguf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ("the quick fox", "ferry streams ü weights", "a lazy dog jumps over"):  # ü: byte fallback
        assert from_gguf(text).input_ids == original(text).input_ids, text
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()(input_ids=IDS).logits
        assert torch.equal(load_gguf(written.path)(input_ids=IDS).logits, expected)


def test_quant_names() -> None:
    assert check_quant("Q8_0") == "q8_0"
    assert check_quant("Q4_K_M") == "q4_k_m"
    with pytest.raises(ValueError, match=re.escape("llama-quantize model-f16.gguf model-q5_k_m.gguf Q5_K_M")):
        check_quant("q5_k_m")
    with pytest.raises(ValueError, match="unknown quant 'q9'.*f32, f16, bf16, q8_0, q4_k_m"):
        check_quant("q9")


def test_bad_input_names_the_field_and_leaves_nothing(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=320)).save_pretrained(gpt2)
    with pytest.raises(ValueError, match="model_type 'gpt2'.*llama, mistral, qwen2, qwen3"):
        write_gguf(gpt2, tmp_path / "out" / "x.gguf")
    llama = save_tiny(tmp_path / "llama", "llama")
    (llama / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no readable tokenizer.json"):
        write_gguf(llama, tmp_path / "out" / "x.gguf")
    with pytest.raises(ValueError, match="still being written"):
        export_gguf(tmp_path / ".tmp-step-00000010-abcd")
    adapter_only = tmp_path / "adapter"
    adapter_only.mkdir()
    (adapter_only / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no model.safetensors"):
        write_gguf(adapter_only, tmp_path / "out" / "x.gguf")
    assert [p.name for p in (tmp_path / "out").iterdir()] == []  # no partial file, no temp file


def test_pre_tokenizer_names() -> None:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert pre_tokenizer_name({"pre_tokenizer": byte_level}) == "gpt-2"
    digits = {"type": "Digits", "individual_digits": True}
    assert (
        pre_tokenizer_name({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [digits, byte_level]}}) == "smollm"
    )
    split = {"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX}, "behavior": "Isolated"}
    plain = {**byte_level, "use_regex": False}
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, plain]}}) == "qwen2"
    with pytest.raises(ValueError, match="convert_hf_to_gguf.py"):
        pre_tokenizer_name({"pre_tokenizer": {"type": "Whitespace"}})


def render_go_template(template: str, messages: list[dict[str, str]]) -> str:
    """Ollama's Go template, for the only constructs the Modelfile's uses: ``range .Messages`` over turns."""
    match = re.fullmatch(r"\{\{- range \.Messages \}\}(.*?)\{\{ end \}\}(.*)", template, re.S)
    assert match, template
    body, tail = match.groups()
    assert "{{" not in tail and set(re.findall(r"\{\{.*?\}\}", body)) <= {"{{ .Role }}", "{{ .Content }}"}
    turns = "".join(body.replace("{{ .Role }}", m["role"]).replace("{{ .Content }}", m["content"]) for m in messages)
    return turns + tail


LLAMA3_JINJA = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@pytest.mark.parametrize(("jinja", "turns"), [(CHATML_JINJA, CHATML), (LLAMA3_JINJA, LLAMA3)])
def test_the_ollama_template_renders_chats_as_the_chat_template_does(tmp_path: Path, jinja: str, turns: Any) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(save_bpe_tokenizer(tmp_path / "tok", chat_template=jinja)))
    mapping = map_chat_template(tokenizer)
    assert mapping.format is turns and mapping.default_system is None
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the quick fox"},
        {"role": "assistant", "content": "jumps"},
        {"role": "user", "content": "over the dog"},
    ]
    expected = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    # This tokenizer adds no BOS itself: the Go template writes the one the Llama 3 template writes.
    assert mapping.lead == ("<|endoftext|>" if turns is LLAMA3 else "")
    assert mapping.lead + render_go_template(turns.ollama_template(), chat) == expected


def test_the_modelfile_has_the_template_default_system_and_stops(tmp_path: Path) -> None:
    default = (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are Ferry.<|im_end|>\n' }}{% endif %}"
    )
    model_dir = save_bpe_tokenizer(tmp_path / "tok", chat_template=default + CHATML_JINJA)
    text = write_modelfile(model_dir, tmp_path / "chat-q8_0.gguf").read_text()
    assert "FROM ./chat-q8_0.gguf\n" in text
    assert 'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n' in text
    assert 'SYSTEM """You are Ferry."""' in text
    assert 'PARAMETER stop "<|im_end|>"' in text
    odd = save_bpe_tokenizer(tmp_path / "odd", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    text = write_modelfile(odd, tmp_path / "odd.gguf").read_text()
    assert "TEMPLATE" not in text.replace("# TEMPLATE not written", "") and 'PARAMETER stop "<|im_end|>"' in text


def test_a_trained_lora_checkpoint_exports_through_the_cli_and_generates_as_merged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    models, data = tmp_path / "models", tmp_path / "data"
    save_bpe_tokenizer(models / "tok")
    save_llama(models / "llama")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(16)])
    roots = PathRoots(model_roots=[models], data_roots=[data])
    checkpoint, _ = train(llm_spec(), roots, tmp_path / "out", monkeypatch)

    assert main(["export", str(checkpoint), "--format", "gguf", "--quant", "f32"]) == 0
    exports = tmp_path / "out" / "exports"
    path = exports / f"{checkpoint.name}-f32.gguf"
    assert sorted(p.name for p in exports.iterdir()) == sorted([path.name, f"{checkpoint.name}-f32.Modelfile"])
    assert str(path.with_suffix(".Modelfile")) in capsys.readouterr().out
    assert main(["merge", str(checkpoint), "--no-archive"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(exports / f"{checkpoint.name}-merged")).eval()
    loaded = load_gguf(path)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, merged(input_ids=IDS).logits)
        for prompt in (IDS[:, :3], IDS[:, 3:], IDS[:, 1:6]):
            kwargs: dict[str, Any] = dict(max_new_tokens=8, do_sample=False, pad_token_id=3)
            assert torch.equal(loaded.generate(prompt, **kwargs), merged.generate(prompt, **kwargs))

    assert main(["export", str(checkpoint), "--quant", "q5_k_m"]) == 2
    assert "llama-quantize" in capsys.readouterr().err
    shutil.rmtree(models / "llama")  # the adapter's base is gone: nothing to merge into
    assert main(["export", str(checkpoint), "--quant", "q8_0"]) == 2
    assert "is gone" in capsys.readouterr().err
    assert not any(p.name.endswith("q8_0.gguf") or p.name.startswith(".tmp") for p in exports.iterdir())


def test_a_trained_model_as_q4_k_m_generates_as_its_f16_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Q4_K_M through transformers' GGUF loader: llama.cpp's mix of tensor types, a third of the f16 file, and
    on the prompts the model was trained on the same greedy tokens as the f16 export (measured: 64 of 64)."""
    from transformers import AutoTokenizer

    models, data = tmp_path / "models", tmp_path / "data"
    save_bpe_tokenizer(models / "tok")
    # Rows 256 wide (hidden) and 512 (ffn_down's input): Q4_K's super-blocks, no fallback types.
    save_llama(models / "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    records = [chat_record(i) for i in range(8)]
    write_jsonl(data / "chat.jsonl", records)
    roots = PathRoots(model_roots=[models], data_roots=[data])
    training = {"steps": 30, "batch_size": 4, "learning_rate": 3e-3}  # a full fine-tune that learns its chats
    checkpoint, _ = train(llm_spec(lora=None, training=training), roots, tmp_path / "out", monkeypatch)

    for quant in ("f16", "q4_k_m"):
        assert main(["export", str(checkpoint), "--quant", quant, "--output", str(tmp_path / f"{quant}.gguf")]) == 0
    assert "(llama, q4_k_m," in capsys.readouterr().out
    meta = fields(tmp_path / "q4_k_m.gguf")
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q4_k_m.gguf")).tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert [types[f"blk.{i}.attn_v.weight"] for i in (0, 1)] == ["Q4_K", "Q6_K"]  # use_more_bits(i, 2)
    assert [types[f"blk.{i}.ffn_down.weight"] for i in (0, 1)] == ["Q4_K", "Q6_K"]
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_up.weight"] == "Q4_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert (tmp_path / "q4_k_m.gguf").stat().st_size < 0.35 * (tmp_path / "f16.gguf").stat().st_size

    f16, q4 = load_gguf(tmp_path / "f16.gguf"), load_gguf(tmp_path / "q4_k_m.gguf")
    tokenizer = AutoTokenizer.from_pretrained(str(models / "tok"))
    agree = total = 0
    with torch.no_grad():
        for record in records:
            prompt = tokenizer.apply_chat_template(record["messages"][:2], add_generation_prompt=True)
            prompt = torch.tensor([prompt["input_ids"] if hasattr(prompt, "keys") else prompt])
            kwargs: dict[str, Any] = dict(max_new_tokens=8, do_sample=False, pad_token_id=3)
            expected = f16.generate(prompt, **kwargs)[0, prompt.shape[1] :]
            got = q4.generate(prompt, **kwargs)[0, prompt.shape[1] :]
            agree += next((i for i in range(len(expected)) if got[i] != expected[i]), len(expected))
            total += len(expected)
    assert agree >= 0.9 * total, f"{agree} of {total} greedy tokens as the f16 export's before the first difference"
