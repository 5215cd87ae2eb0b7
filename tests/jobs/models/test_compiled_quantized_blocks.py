"""``training.compile`` over a quantized frozen base (QLoRA's NF4, int8): the same losses and adapter gradients as
eager with streamed block units, checkpointed or not, and graphs that do not grow with the layers (a 70B has
80, each with its own quantized weights: no guard may tell them apart).

Compiled with ``aot_eager`` (the graphs inductor would get, without code generation; test_compiled_blocks.py says
why). A streamed NF4 weight computes as the plain tensor the engine dequantized it into on arrival; with
``dequantize_on_arrival: false``, or kept quantized by the budget, torchao's ``NF4Tensor`` itself enters the
compiled block; an int8 weight enters it as torchao's ``Int8Tensor`` through ``Int8Linear``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jobs import PathRoots
from jobs.events import event_to_wire
from jobs.models import compiled_blocks
from jobs.models.compiled_blocks import compile_repeated_blocks
from jobs.models.hf_causal_lm import enable_hf_gradient_checkpointing
from jobs.recompute import apply_activation_checkpointing
from offload import OffloadOptions, OffloadTrainingManager
from offload.quant.payload import is_quantized
from tests.jobs.helpers import merged, spec_from

pytest.importorskip("torchao")
pytestmark = pytest.mark.filterwarnings("ignore")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_qlora_llama(layers: int, checkpointing: bool, quantize: str) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from offload.quant.quantized import quantize_frozen_weights

    torch.manual_seed(0)
    # Widths of whole NF4 blocks (64 x 256 weights) for q, o, the MLP and the head; k and v stay bf16.
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    if checkpointing:
        enable_hf_gradient_checkpointing(model)
        apply_activation_checkpointing(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False)).train()
    assert quantize_frozen_weights(model, quantize)
    return model


def _train(
    layers: int, *, compiled: bool, quantize: str, checkpointing: bool, steps: int = 2, **options: Any
) -> tuple[list[float], list[dict[str, torch.Tensor]], int]:
    """Losses and LoRA gradients of each step with every block streamed on the CPU target; the graphs compiled."""
    torch._dynamo.reset()
    model = _tiny_qlora_llama(layers, checkpointing, quantize)
    blocks = compile_repeated_blocks(model, backend="aot_eager") if compiled else None
    offload = OffloadOptions(granularity="block", gpu_memory_budget=None, **options)
    manager = OffloadTrainingManager(model, "cpu", options=offload)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        manager.after_backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert manager.stats().ring_overflows == 0
    manager.remove()
    assert any(is_quantized(p) for p in model.parameters())  # the base stayed quantized throughout
    graphs = blocks.graphs if blocks is not None else 0
    if blocks is not None:
        blocks.remove()
    return losses, grads, graphs


CASES = [
    pytest.param("nf4", {}, id="nf4-dequantized-on-arrival"),
    pytest.param("nf4", {"dequantize_on_arrival": False}, id="nf4-in-the-layer"),
    pytest.param("int8", {}, id="int8"),
]


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "whole"])
@pytest.mark.parametrize(("quantize", "options"), CASES)
def test_compiled_streamed_quantized_lora_trains_as_eager_with_graphs_independent_of_depth(
    quantize: str, options: dict[str, Any], checkpointing: bool
) -> None:
    eager_losses, eager_grads, _ = _train(4, compiled=False, quantize=quantize, checkpointing=checkpointing, **options)
    losses, grads, graphs = _train(4, compiled=True, quantize=quantize, checkpointing=checkpointing, **options)
    # aot_eager runs the same aten ops (torchao's dequantization among them): equal bit for bit on torch 2.13.
    assert losses == eager_losses
    for step, eager in zip(grads, eager_grads, strict=True):
        assert step.keys() == eager.keys()
        assert all(torch.equal(step[name], eager[name]) for name in step)
    # The two modes a block runs in (test_compiled_blocks.py), never one graph per layer: the layers' quantized
    # weights (their codes and scales, their host payloads) are graph inputs that the guards see alike.
    assert graphs == 2
    shallow = _train(2, compiled=True, quantize=quantize, checkpointing=checkpointing, steps=1, **options)
    assert shallow[2] == graphs


def test_a_qlora_job_with_compiled_blocks_trains_as_eager(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NF4 quantized as it loads into the pinned arena (a meta model: hf_causal_lm's build on meta), streamed
    # block units, checkpointed: bench/big_models.py's qlora70b row, tiny.
    from jobs import run_job
    from tests.jobs.models.test_quantize_on_load import llama_job, save_tiny_llama

    monkeypatch.setattr(compiled_blocks, "BACKEND", "aot_eager")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    save_tiny_llama(roots.model_roots[0] / "llama", weights=False)
    data = merged(llama_job(roots, "random", "nf4"), offload={"gpu_memory_budget": None})

    def job(spec: dict[str, Any], output: str) -> tuple[list[float], list[str]]:
        events: list[dict[str, Any]] = []
        run_job(spec_from(spec, roots), output_dir=tmp_path / output, report=lambda e: events.append(event_to_wire(e)))
        assert events[-1]["type"] == "finished" and events[-1].get("status", "succeeded") == "succeeded", events[-1]
        return [e["loss"] for e in events if e["type"] == "step"], [e["message"] for e in events if e["type"] == "log"]

    eager, _ = job(data, "eager")
    torch._dynamo.reset()
    compiled, messages = job(merged(data, training={"compile": True}), "compiled")
    assert len(compiled) == 3 and compiled == eager
    summary = next(m for m in messages if m.startswith("training.compile"))
    assert summary.startswith(
        "training.compile: 2 LlamaDecoderLayer blocks share one compiled forward (aot_eager): 2 graphs"
    )
