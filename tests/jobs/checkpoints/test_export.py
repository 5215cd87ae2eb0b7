"""Exports: a full fine-tune loads with from_pretrained; a merged LoRA equals adapter-on-base; precision."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

import jobs.train.runner
from jobs import PathRoots, load_job_spec, run_job
from jobs.checkpoints.export import merge_lora_checkpoint
from jobs.cli import main
from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, save_llama, write_jsonl


@pytest.fixture
def llm_roots(tmp_path: Path) -> PathRoots:
    models, data = tmp_path / "models", tmp_path / "data"
    save_bpe_tokenizer(models / "tok")
    save_llama(models / "llama")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(16)])
    return PathRoots(model_roots=[models], data_roots=[data])


def train(data: dict[str, Any], roots: PathRoots, output: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run the job; return its trained model as the runner held it at the end."""
    held: dict[str, Any] = {}
    close = jobs.train.runner.close_session

    def keep_model(session: Any) -> None:
        held["model"] = session.model
        close(session)

    monkeypatch.setattr(jobs.train.runner, "close_session", keep_model)
    outcome = run_job(load_job_spec(yaml.safe_dump(data), roots), output_dir=output)
    return Path(outcome.checkpoint), held["model"]


IDS = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12]])


def test_full_fine_tune_loads_with_from_pretrained_and_gives_the_same_logits(
    tmp_path: Path, llm_roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = llm_spec(lora=None, offload={"enable_model_cpu_offload": True, "enable_optimizer_cpu_offload": True})
    checkpoint, trained = train(data, llm_roots, tmp_path / "out", monkeypatch)
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    loaded = AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    base = AutoModelForCausalLM.from_pretrained(str(llm_roots.model_roots[0] / "llama")).eval()
    with torch.no_grad():
        expected = trained.eval()(input_ids=IDS).logits
        assert torch.equal(loaded(input_ids=IDS).logits, expected)
        assert not torch.allclose(base(input_ids=IDS).logits, expected)  # it did train
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    assert tokenizer.chat_template and tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )


def test_merged_lora_equals_the_adapter_on_its_base(
    tmp_path: Path, llm_roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    data = llm_spec(lora={"target_modules": ["q_proj", "v_proj", "o_proj"], "use_rslora": True})
    checkpoint, _ = train(data, llm_roots, tmp_path / "out", monkeypatch)
    assert main(["merge", str(checkpoint)]) == 0  # python -m jobs merge CHECKPOINT
    merged_dir = tmp_path / "out" / "exports" / f"{checkpoint.name}-merged"
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    monkeypatch.chdir(llm_roots.model_roots[0])  # the adapter names its base portably: "llama"
    adapter = AutoPeftModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, adapter(input_ids=IDS).logits, rtol=0, atol=1e-5)
    assert not any("lora_" in name for name in load_file(str(merged_dir / "model.safetensors")))
    with tarfile.open(merged_dir.with_name(merged_dir.name + ".tar")) as archive:
        members = set(archive.getnames())
    assert {
        f"{merged_dir.name}/config.json",
        f"{merged_dir.name}/model.safetensors",
        f"{merged_dir.name}/tokenizer.json",
    } <= members


def test_a_merged_model_in_shards_loads_with_from_pretrained_as_the_adapter_on_model(
    tmp_path: Path, llm_roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    checkpoint, _ = train(
        llm_spec(lora={"target_modules": ["q_proj", "v_proj", "o_proj"]}), llm_roots, tmp_path / "out", monkeypatch
    )
    merged_dir = tmp_path / "merged"
    # The tiny model is ~250 KB in float32: 100KB shards make it three files, as 5GB ones split a 7B model.
    assert main(["merge", str(checkpoint), "--output", str(merged_dir), "--max-shard-size", "100KB"]) == 0
    index = json.loads((merged_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((merged_dir / shard).is_file() for shard in shards)
    assert not (merged_dir / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    monkeypatch.chdir(llm_roots.model_roots[0])  # the adapter names its base portably: "llama"
    adapter = AutoPeftModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, adapter(input_ids=IDS).logits, rtol=0, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
    stops = GenerationConfig.from_pretrained(str(merged_dir)).eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stops and tokenizer.eos_token_id in stops
    assert 'from_pretrained("merged")' in (merged_dir / "README.md").read_text()
    with tarfile.open(merged_dir.with_name("merged.tar")) as archive:
        assert {f"merged/{shard}" for shard in shards} | {"merged/model.safetensors.index.json"} <= set(
            archive.getnames()
        )


def test_a_quantized_base_is_merged_dequantized_into_bf16_as_it_trained(
    tmp_path: Path, llm_roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter trained on an int8 base (NF4 needs 16384-weight blocks the tiny model lacks) merges into that
    base dequantized into bf16: the trained model's outputs within bf16 rounding."""
    from transformers import AutoModelForCausalLM

    pytest.importorskip("torchao")
    data = llm_spec(model={"quantize": "int8"}, lora={"target_modules": ["q_proj", "v_proj", "o_proj"]})
    checkpoint, trained = train(data, llm_roots, tmp_path / "out", monkeypatch)
    merged_dir = merge_lora_checkpoint(checkpoint, tmp_path / "merged", archive=False)
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    assert "quantized to int8 (QLoRA)" in (merged_dir / "README.md").read_text()
    with torch.no_grad():
        expected = trained.eval()(input_ids=IDS).logits
        error = (merged(input_ids=IDS).logits.float() - expected).abs().max().item()
    assert error < 0.02 * expected.abs().max().item()  # measured 0.0024 of 0.37: the bf16 rounding of the merge
    # A linear the adapter leaves alone holds the int8 weights as training computed with them, in bf16.
    from offload.quant.int8_linear import dequantize
    from offload.quant.quantized import quantizer

    original = load_file(str(llm_roots.model_roots[0] / "llama" / "model.safetensors"))[
        "model.layers.0.mlp.up_proj.weight"
    ]
    as_trained = dequantize(quantizer("int8")(original), torch.bfloat16)
    kept = merged.model.layers[0].mlp.up_proj.weight
    assert torch.equal(kept, as_trained) and not torch.equal(kept, original.bfloat16())


def test_merge_refuses_a_checkpoint_that_is_not_lora(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a Ferry checkpoint"):
        merge_lora_checkpoint(tmp_path)


@pytest.mark.parametrize("use_dora", [False, True])
def test_peft_options_reach_the_adapter(
    tmp_path: Path, llm_roots: PathRoots, monkeypatch: pytest.MonkeyPatch, use_dora: bool
) -> None:
    import json

    lora = {
        "target_modules": ["q_proj"],
        "use_dora": use_dora,
        "modules_to_save": ["lm_head"],
        "init_lora_weights": "gaussian",
    }
    checkpoint, _ = train(llm_spec(lora=lora, training={"steps": 2}), llm_roots, tmp_path / "out", monkeypatch)
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["use_dora"] is use_dora and config["modules_to_save"] == ["lm_head"]
    assert config["init_lora_weights"] == "gaussian"
    saved = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert any("lm_head" in name for name in saved) and any("lora_magnitude" in n for n in saved) is use_dora


def changed_fraction(checkpoint: Path, base: Path, name: str) -> float:
    trained = load_file(str(checkpoint / "model.safetensors"))[name].float()
    initial = load_file(str(base / "model.safetensors"))[name].bfloat16().float()  # as the job loaded it
    return (trained != initial).float().mean().item()


def test_bf16_mixed_precision_keeps_float32_master_weights(
    tmp_path: Path, llm_roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a low learning rate, pure bf16 weights round every update away; float32 masters keep them."""
    base = llm_roots.model_roots[0] / "llama"
    common = {"steps": 2, "learning_rate": 1e-6}
    model = {"dtype": "bfloat16"}
    mixed, trained = train(
        llm_spec(lora=None, model=model, training={**common, "mixed_precision": "bf16"}),
        llm_roots,
        tmp_path / "a",
        monkeypatch,
    )
    assert {p.dtype for p in trained.parameters()} == {torch.float32}
    pure, trained = train(
        llm_spec(lora=None, model=model, training={**common, "mixed_precision": "no"}),
        llm_roots,
        tmp_path / "b",
        monkeypatch,
    )
    assert {p.dtype for p in trained.parameters()} == {torch.bfloat16}
    name = "model.layers.0.mlp.up_proj.weight"
    assert changed_fraction(mixed, base, name) > 0.9
    assert changed_fraction(pure, base, name) < 0.1


def test_a_merged_export_event_says_a_quantized_base_was_dequantized() -> None:
    from jobs.checkpoints.export import merge_note

    assert merge_note({"model": {"kind": "hf_causal_lm", "quantize": None}}) is None
    assert merge_note({"model": {"quantize": "nf4"}}) == (
        "the adapter was trained on a nf4 base: merged into that base dequantized into bf16 (a bf16 model)"
    )
