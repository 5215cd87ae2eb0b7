"""A Hugging Face causal LM's activation checkpointing: training without it, exactly, with little host work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from jobs import PathRoots
from jobs.models.hf_causal_lm import enable_hf_gradient_checkpointing
from jobs.recompute import apply_activation_checkpointing
from tests.jobs.helpers import losses_and_saved, merged, python_calls, spec_from
from tests.jobs.models.test_hf_causal_lm import TINY_HF, save_tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")


def test_a_checkpointed_lora_job_trains_and_saves_exactly_as_one_without(tmp_path: Path, roots: PathRoots) -> None:
    # LoRA on frozen embeddings: the reentrant checkpoint reaches the adapters only if the decoder layers'
    # input requires grad. Dropout: the recompute must draw the forward's masks. The offloaded run recomputes
    # each layer under the engine's saved-tensor hooks.
    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    lora = {"target_modules": ["q_proj", "v_proj", "down_proj"], "rank": 4, "alpha": 8, "dropout": 0.1}
    resident = {"enable_model_cpu_offload": False}
    runs = {
        "plain": merged(TINY_HF, lora=lora, training={"gradient_checkpointing": False}, offload=resident),
        "checkpointed": merged(TINY_HF, lora=lora, offload=resident),
        "offloaded": merged(TINY_HF, lora=lora),
    }
    losses, adapters = {}, {}
    for name, data in runs.items():
        losses[name], adapters[name] = losses_and_saved(
            spec_from(data, roots), tmp_path / name, "adapter_model.safetensors"
        )
    assert len(losses["plain"]) == 4 and len(set(losses["plain"])) > 1
    for name in ("checkpointed", "offloaded"):
        assert losses[name] == losses["plain"], name
        assert adapters[name].keys() == adapters["plain"].keys(), name
        assert all(torch.equal(adapters[name][k], adapters["plain"][k]) for k in adapters["plain"]), name


def _tiny_lora_llama(checkpointing: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if checkpointing:
        enable_hf_gradient_checkpointing(model)
        apply_activation_checkpointing(model)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=4, target_modules=targets)).train()


def test_checkpointing_adds_little_host_work_to_a_training_step() -> None:
    # Recomputing the layers costs their forward's Python calls once more: 1.95x the calls of the step without
    # checkpointing here (the forward is nearly all the step's Python). The non-reentrant checkpoint also runs
    # hooks for every tensor a layer saves: 5.9x.
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(model: nn.Module) -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    plain, checkpointed = _tiny_lora_llama(False), _tiny_lora_llama(True)
    step(plain), step(checkpointed)  # warm up: first-call imports and caches
    ratio = python_calls(lambda: step(checkpointed)) / python_calls(lambda: step(plain))
    assert ratio < 2.3, ratio
    assert all(p.grad is not None for n, p in checkpointed.named_parameters() if p.requires_grad)
