"""A tiny Hugging Face model saved locally, trained with LoRA through the engine, reloaded with peft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jobs import PathRoots, run_job
from tests.jobs.helpers import merged, spec_from

TINY_HF = {
    "name": "tiny-hf",
    "device": "cpu",
    "model": {"kind": "hf_causal_lm", "path": "tiny-llama", "dtype": "float32"},
    "data": {"kind": "text", "path": "corpus", "seq_len": 32},
    "lora": {"target_modules": ["q_proj", "v_proj"], "rank": 4, "alpha": 8},
    "training": {"steps": 4, "batch_size": 2, "learning_rate": 1e-2, "gradient_checkpointing": True},
    "offload": {"enable_model_cpu_offload": True},
}


def save_tiny_llama(directory: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def test_lora_adapter_trains_and_reloads_with_peft(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    outcome = run_job(spec_from(TINY_HF, roots), output_dir=tmp_path / "out")
    checkpoint = Path(outcome.checkpoint)
    assert {p.name for p in checkpoint.iterdir()} == {
        "adapter_model.safetensors",
        "adapter_config.json",
        "training_state.pt",
        "manifest.json",
    }
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    # Portable: the base model's directory name; the full path stays in Ferry's own manifest.
    assert config["base_model_name_or_path"] == "tiny-llama" and config["r"] == 4
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["spec"]["model"]["path"] == str(model_dir)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["task_type"] == "CAUSAL_LM"

    saved = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert saved and all("lora_" in name for name in saved)
    monkeypatch.chdir(model_dir.parent)  # where a user keeps the base model: under its own name
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(checkpoint))
    live = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    for name, tensor in saved.items():
        suffix = name.removeprefix("base_model.model.")
        match = [p for n, p in live.items() if n.replace(".default", "").endswith(suffix)]
        assert len(match) == 1 and torch.equal(match[0].detach(), tensor), name

    ids = torch.arange(16).unsqueeze(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        assert not torch.allclose(reloaded(input_ids=ids).logits, base(input_ids=ids).logits)


def test_full_fine_tuning_of_an_hf_model_without_offload(tmp_path: Path, roots: PathRoots) -> None:
    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    data = merged(
        TINY_HF,
        lora=None,
        offload={"enable_model_cpu_offload": False},
        training={"gradient_checkpointing": False, "steps": 2},
    )
    data.pop("lora")
    outcome = run_job(spec_from(data, roots), output_dir=tmp_path)
    weights = load_file(str(Path(outcome.checkpoint) / "model.safetensors"))
    assert "model.embed_tokens.weight" in weights and len(weights) > 10
