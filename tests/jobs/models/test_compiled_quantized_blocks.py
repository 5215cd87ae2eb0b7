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
from jobs.fit.checks import UNSAFE_COMPILE_SWITCH
from jobs.models import compiled_blocks
from jobs.models.compiled_blocks import compile_repeated_blocks
from jobs.models.hf_causal_lm import enable_hf_gradient_checkpointing
from jobs.recompute import apply_activation_checkpointing
from offload import OffloadOptions, OffloadTrainingManager
from offload.quant.payload import is_quantized
from tests.jobs.helpers import merged, spec_from
from tests.jobs.models.test_compiled_blocks import train_streamed

pytest.importorskip("torchao")
pytestmark = pytest.mark.filterwarnings("ignore")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_qlora_llama(layers: int, checkpointing: bool, quantize: str, patch: Any = None) -> nn.Module:
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
    if patch is not None:  # as training.kernels does: before checkpointing, adapters and quantization
        patch(model)
    if checkpointing:
        enable_hf_gradient_checkpointing(model)
        apply_activation_checkpointing(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False)).train()
    assert quantize_frozen_weights(model, quantize)
    return model


def _train(
    layers: int,
    *,
    compiled: bool,
    quantize: str,
    checkpointing: bool,
    steps: int = 2,
    patch: Any = None,
    device: str = "cpu",
    backend: str = "aot_eager",
    **options: Any,
) -> tuple[list[float], list[dict[str, torch.Tensor]], int]:
    """Losses and LoRA gradients of each step with every block streamed (to the CPU target unless ``device``
    says otherwise); the graphs compiled. ``patch``: applied to the plain model first (fused kernels)."""
    torch._dynamo.reset()
    model = _tiny_qlora_llama(layers, checkpointing, quantize, patch)
    blocks = compile_repeated_blocks(model, backend=backend) if compiled else None
    offload = OffloadOptions(granularity="block", gpu_memory_budget=None, **options)
    manager = OffloadTrainingManager(model, device, options=offload)
    losses, grads = train_streamed(model, manager, steps, device)
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


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_a_quantized_base_job_with_compiled_blocks_trains_as_eager(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch, quantize: str
) -> None:
    # Quantized as it loads into the pinned arena (a meta model: hf_causal_lm's build on meta), streamed block
    # units, checkpointed: with NF4, bench/big_models.py's qlora70b row, tiny.
    from jobs import run_job
    from tests.jobs.models.test_quantize_on_load import llama_job, save_tiny_llama

    monkeypatch.setattr(compiled_blocks, "BACKEND", "aot_eager")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    save_tiny_llama(roots.model_roots[0] / "llama", weights=False)
    data = merged(llama_job(roots, "random", quantize), offload={"gpu_memory_budget": None})

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


class _FusedSwiGLU(nn.Module):
    """Stands in for Liger's ``LigerSwiGLUMLP.forward`` (its Triton kernel needs CUDA): the same calls of the
    MLP's projections around one fused activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_silu_mul(self.gate_proj(x), self.up_proj(x)))  # type: ignore[operator]


def _silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(a) * b


class _FusedRMSNorm(nn.Module):
    """Stands in for ``LigerRMSNorm.forward``: the norm's own weight, read directly."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        variance = h.float().pow(2).mean(-1, keepdim=True)
        normed = h.float() * torch.rsqrt(variance + self.variance_epsilon)  # type: ignore[operator]
        return (self.weight.float() * normed).to(h.dtype)  # type: ignore[operator]


def _liger_style_patch(model: nn.Module) -> None:
    """What ``_apply_liger_kernel_to_instance`` does to a Llama instance: a forward bound on each layer's MLP and
    norms (``_bind_method_to_module``: ``module.__dict__["forward"] = function.__get__(module)``)."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.mlp.__dict__["forward"] = _FusedSwiGLU.forward.__get__(layer.mlp, type(layer.mlp))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.__dict__["forward"] = _FusedRMSNorm.forward.__get__(norm, type(norm))


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "whole"])
def test_kernels_bound_on_each_layers_modules_compile_once_over_an_nf4_base(checkpointing: bool) -> None:
    # Each layer's MLP and norms carry a forward bound to themselves, as Liger's kernels patch an instance: the
    # guards must not tell the layers apart by those bound methods.
    eager = _train(4, compiled=False, quantize="nf4", checkpointing=checkpointing, patch=_liger_style_patch)
    compiled = _train(4, compiled=True, quantize="nf4", checkpointing=checkpointing, patch=_liger_style_patch)
    assert compiled[0] == eager[0]
    assert all(torch.equal(a[n], b[n]) for a, b in zip(compiled[1], eager[1], strict=True) for n in a)
    assert compiled[2] == 2
    shallow = _train(2, compiled=True, quantize="nf4", checkpointing=checkpointing, steps=1, patch=_liger_style_patch)
    assert shallow[2] == 2


class _BrokenSwiGLU(nn.Module):
    """An MLP forward with a graph break in it, as Liger's autograd functions (their Triton kernels) make on CUDA:
    dynamo restarts its analysis of the layer there, and the attempt it drops leaves weak references on the
    layer's weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)  # type: ignore[operator]
        torch._dynamo.graph_break()
        return self.down_proj(_silu_mul(gate, self.up_proj(x)))  # type: ignore[operator]


def _graph_break_patch(model: nn.Module) -> None:
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.mlp.__dict__["forward"] = _BrokenSwiGLU.forward.__get__(layer.mlp, type(layer.mlp))


def _resident_compiled(quantize: str, patch: Any) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """``_train``'s losses and gradients, compiled the same way, without the engine."""
    torch._dynamo.reset()
    model = _tiny_qlora_llama(2, checkpointing=True, quantize=quantize, patch=patch)
    blocks = compile_repeated_blocks(model, backend="aot_eager")
    assert blocks is not None
    result = train_streamed(model, None, 2, "cpu")
    blocks.remove()
    return result


@pytest.mark.parametrize(("quantize", "options"), CASES)
def test_a_graph_break_in_each_layer_leaves_the_quantized_base_swappable(
    quantize: str, options: dict[str, Any]
) -> None:
    # The engine swaps each quantized weight to its device contents and back (swap_tensors) while weak references
    # from dynamo's dropped attempts are on it, and, in the checkpoint's recompute, those of the grad-mode graphs
    # whose backward is not compiled yet (offload/quant/swap.py).
    resident = _resident_compiled(quantize, _graph_break_patch)
    streamed = _train(2, compiled=True, quantize=quantize, checkpointing=True, patch=_graph_break_patch, **options)
    # Against the same compiled graphs without the engine (around a break, aot_eager's ops round bf16 unlike eager's).
    assert streamed[0] == resident[0]
    assert all(torch.equal(a[n], b[n]) for a, b in zip(streamed[1], resident[1], strict=True) for n in a)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.gpu
@pytest.mark.xfail(
    reason="on an H100 (torch 2.11, commit f02ebe7) this failed: the NF4 payload could not be swapped back (weak references dynamo leaves at graph breaks, here Liger's autograd functions; mended since on the CPU, offload/quant/swap.py, not rerun there); training.compile over the offload engine is refused on CUDA until it passes (jobs/fit/checks.py)",
    strict=False,
)
def test_on_the_gpu_liger_and_inductor_over_a_streamed_nf4_base_train_as_the_plain_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(UNSAFE_COMPILE_SWITCH, "1")  # the job runs the refused path: this test measures it
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("liger_kernel")
    from transformers.models.llama import modeling_llama

    from jobs.models.fused_kernels import apply_liger_kernels

    # Liger also patches transformers' Llama module (RoPE, the classes): restored after the test.
    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    plain = _train(4, compiled=False, quantize="nf4", checkpointing=True, device="cuda")
    applied: list[str] = []

    def liger(model: nn.Module) -> None:
        applied.extend(apply_liger_kernels(model))

    fused = _train(4, compiled=True, quantize="nf4", checkpointing=True, device="cuda", backend="inductor", patch=liger)
    assert {"rope", "rms_norm", "swiglu"} <= set(applied)
    # bf16 throughout: the fused kernels and inductor's fusions round differently; within 2 % of the plain path
    assert fused[0] == pytest.approx(plain[0], rel=2e-2)
    for step, reference in zip(fused[1], plain[1], strict=True):
        assert all(_relative_error(step[n], reference[n]) < 5e-2 for n in step), step.keys()
    # Liger's autograd functions may break the block into a few graphs; their number does not grow with depth
    shallow = _train(2, compiled=True, quantize="nf4", checkpointing=True, steps=1, device="cuda", backend="inductor",
                     patch=liger)  # fmt: skip
    assert shallow[2] == fused[2]
