"""``training.compile``: one compiled forward for every decoder layer, with streamed weights, Ferry's reentrant
checkpoint and LoRA; the same losses and adapter gradients as eager, and graphs that do not grow with the layers.

Most checks compile with ``aot_eager``: dynamo and AOTAutograd capture the same graphs as with inductor (what the
guards, the engine's storage swaps and its saved-tensor hooks meet), without code generation, which takes minutes
on a small CPU. One test runs inductor itself, on two layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jobs import JobSpecError, PathRoots
from jobs.events import event_to_wire
from jobs.models import compiled_blocks
from jobs.models.compiled_blocks import compile_repeated_blocks, repeated_blocks, use_inductor_cache
from jobs.models.hf_causal_lm import enable_hf_gradient_checkpointing
from jobs.recompute import apply_activation_checkpointing
from offload import OffloadOptions, OffloadTrainingManager
from tests.jobs.helpers import merged, spec_from
from tests.jobs.models.test_hf_causal_lm import TINY_HF, save_tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_lora_llama(layers: int, checkpointing: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if checkpointing:
        enable_hf_gradient_checkpointing(model)
        apply_activation_checkpointing(model)
    # Non-zero B: every adapter gets a gradient that depends on the frozen weights of the layers after it.
    return get_peft_model(model, LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False)).train()


def train_streamed(
    model: torch.nn.Module, manager: OffloadTrainingManager | None, steps: int, device: str
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """``steps`` SGD steps on one fixed batch through ``manager`` (None: a resident model): each step's loss and
    LoRA gradients."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    losses, grads = [], []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if manager is not None:
            manager.after_backward()
        grads.append({n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _train(
    layers: int,
    *,
    backend: str | None,
    checkpointing: bool = True,
    steps: int = 3,
    device: str = "cpu",
    offload: bool = True,
    **options: Any,
) -> tuple[list[float], list[dict[str, torch.Tensor]], int, int]:
    """Losses and LoRA gradients of each step, streamed on the CPU target with block units (``offload=False``:
    resident on ``device``, no engine; ``options``: more ``OffloadOptions``); the graphs compiled (0 eager) and
    the bytes the engine copied to the device."""
    torch._dynamo.reset()
    model = _tiny_lora_llama(layers, checkpointing)
    compiled = compile_repeated_blocks(model, backend=backend) if backend else None
    manager = None
    if offload:  # every block streams through the ring
        chosen = OffloadOptions(granularity="block", gpu_memory_budget=None, **options)
        manager = OffloadTrainingManager(model, device, options=chosen)
    else:
        model.to(device)
    losses, grads = train_streamed(model, manager, steps, device)
    h2d = 0
    if manager is not None:
        stats = manager.stats()
        assert stats.ring_overflows == 0
        manager.remove()
        h2d = stats.h2d_bytes
    graphs = compiled.graphs if compiled is not None else 0
    if compiled is not None:
        compiled.remove()
    return losses, grads, graphs, h2d


def _assert_close(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]], atol: float) -> None:
    for step_a, step_b in zip(a, b, strict=True):
        assert step_a.keys() == step_b.keys()
        for name in step_a:
            torch.testing.assert_close(step_a[name], step_b[name], atol=atol, rtol=1e-5, msg=name)


def test_the_decoder_layers_are_the_repeated_blocks() -> None:
    model = _tiny_lora_llama(3, checkpointing=False)
    blocks = repeated_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 3  # peft's linears inside are not listed


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "whole"])
def test_compiled_streamed_lora_trains_as_eager_with_graphs_independent_of_depth(checkpointing: bool) -> None:
    eager_losses, eager_grads, _, eager_h2d = _train(4, backend=None, checkpointing=checkpointing)
    losses, grads, graphs, h2d = _train(4, backend="aot_eager", checkpointing=checkpointing)
    # Tolerance 1e-6 (aot_eager runs the same aten ops: measured bitwise equal on torch 2.13).
    assert losses == pytest.approx(eager_losses, abs=1e-6)
    _assert_close(grads, eager_grads, atol=1e-6)
    # The backward re-onloaded every streamed weight as eager does: the compiled graph saved the engine's tokens,
    # not views of ring slots that later layers overwrite.
    assert h2d == eager_h2d
    # Checkpointed: the no-grad forward and the recompute's. Whole: the first layer's input needs no gradient, the
    # others' do. Never one per layer: two layers compile as many graphs as four.
    assert graphs == 2
    assert _train(2, backend="aot_eager", checkpointing=checkpointing, steps=1)[2] == graphs


class _AdaptedBlock(nn.Module):
    """A frozen projection with a trainable low-rank adapter and a norm: a decoder layer's parts, few kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.base = nn.Linear(16, 16).requires_grad_(False)
        self.down, self.up = nn.Linear(16, 2, bias=False), nn.Linear(2, 16, bias=False)
        self.norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + torch.nn.functional.silu(self.base(h) + self.up(self.down(h)))


def _train_blocks(backend: str | None) -> tuple[list[torch.Tensor], int]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList(_AdaptedBlock() for _ in range(3)))
    compiled = compile_repeated_blocks(model, backend=backend) if backend else None
    manager = OffloadTrainingManager(model, "cpu", options=OffloadOptions(granularity="block", gpu_memory_budget=None))
    grads = []
    for step in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step), requires_grad=True)
        for block in model[0]:
            x = block(x)
        x.pow(2).mean().backward()
        manager.after_backward()
        grads += [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
    manager.remove()
    return grads, compiled.graphs if compiled is not None else 0


def test_inductor_compiles_once_into_the_cache_and_matches_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # restored after the test; use_inductor_cache sets it
    use_inductor_cache(tmp_path / "inductor")
    eager, _ = _train_blocks(None)
    compiled, graphs = _train_blocks("inductor")
    # Inductor fuses float32 arithmetic differently: equal within 1e-5.
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert graphs == 1  # three streamed blocks, one graph
    assert any((tmp_path / "inductor").iterdir())  # the compiled code is where later jobs look for it


def test_a_compiled_job_reports_its_compile_and_trains_as_eager(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.jobs.helpers import losses_and_saved

    monkeypatch.setattr(compiled_blocks, "BACKEND", "aot_eager")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    block = {"enable_model_cpu_offload": True, "granularity": "block"}
    plain = merged(TINY_HF, offload=block)
    losses, adapter = losses_and_saved(spec_from(plain, roots), tmp_path / "eager", "adapter_model.safetensors")
    torch._dynamo.reset()
    events: list[dict[str, Any]] = []
    from jobs import run_job

    spec = spec_from(merged(plain, training={"compile": True}), roots)
    run_job(
        spec,
        output_dir=tmp_path / "compiled",
        report=lambda e: events.append(event_to_wire(e)),
        cache_dir=tmp_path / "srv",
    )
    compiled_losses = [e["loss"] for e in events if e["type"] == "step"]
    assert compiled_losses == pytest.approx(losses, abs=1e-6)
    messages = [e["message"] for e in events if e["type"] == "log"]
    summary = next(m for m in messages if m.startswith("training.compile"))
    assert summary.startswith(
        "training.compile: 2 LlamaDecoderLayer blocks share one compiled forward (aot_eager): 2 graphs, compiled in "
    )
    assert summary.endswith(f"s; inductor cache {tmp_path / 'srv' / 'inductor'}")
    assert adapter  # the eager run saved its adapter (the compiled one's equal losses say the weights matched)


def test_compile_under_model_offload_needs_block_units(roots: PathRoots) -> None:
    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    with pytest.raises(JobSpecError) as caught:
        spec_from(merged(TINY_HF, training={"compile": True}), roots)
    assert "- training.compile (line 21): " in str(caught.value)
    assert str(caught.value).endswith(
        "with offload.enable_model_cpu_offload the engine's leaf units hook every layer inside a "
        "compiled block; set offload.granularity: block (the engine then hooks the block, outside what is compiled)"
    )
    block = merged(
        TINY_HF, training={"compile": True}, offload={"enable_model_cpu_offload": True, "granularity": "block"}
    )
    assert spec_from(block, roots).training.compile
    resident = merged(TINY_HF, training={"compile": True}, offload={"enable_model_cpu_offload": False})
    assert spec_from(resident, roots).training.compile


def _job(data: dict[str, Any], output_dir: Path, roots: PathRoots | None = None) -> tuple[list[float], list[str]]:
    from jobs import run_job

    events: list[dict[str, Any]] = []
    run_job(spec_from(data, roots), output_dir=output_dir, report=lambda e: events.append(event_to_wire(e)))
    return [e["loss"] for e in events if e["type"] == "step"], [e["message"] for e in events if e["type"] == "log"]


def test_ferrys_own_lm_compiles_its_checkpointed_streamed_blocks(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformer_lm checkpoints through checkpoint_block (the block's __call__, hooks inside the recompute) and
    # draws dropout masks that the recompute must replay.
    from tests.jobs.helpers import TINY_LM

    monkeypatch.setattr(compiled_blocks, "BACKEND", "aot_eager")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    lm = merged(
        TINY_LM,
        training={"steps": 3, "gradient_checkpointing": True},
        offload={"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_budget": None},
    )
    eager, _ = _job(lm, tmp_path / "eager", roots)
    torch._dynamo.reset()
    compiled, messages = _job(merged(lm, training={"compile": True}), tmp_path / "compiled", roots)
    assert compiled == pytest.approx(eager, abs=1e-6)
    assert any(m.startswith("training.compile: 2 ") and " graphs, compiled in " in m for m in messages), messages


def test_a_model_without_repeated_blocks_runs_eagerly_and_says_so(tmp_path: Path) -> None:
    from tests.jobs.helpers import TOY

    one_layer = merged(TOY, model={"num_layers": 1}, training={"steps": 2, "compile": True})
    _, messages = _job(one_layer, tmp_path)
    assert "training.compile: ToyMLP has no repeated blocks; it runs eagerly" in messages


@pytest.mark.slow
def test_inductor_over_streamed_decoder_layers_trains_as_eager_on_the_cpu() -> None:
    # Real code generation (C++ kernels) over weights that are views into the ring, whose slots the layers take
    # turns in: the losses, the adapter gradients and the bytes copied are eager's.
    eager_losses, eager_grads, _, eager_h2d = _train(2, backend=None)
    losses, grads, graphs, h2d = _train(2, backend="inductor")
    assert losses == pytest.approx(eager_losses, abs=1e-5)
    _assert_close(grads, eager_grads, atol=1e-5)  # inductor's fusions reorder float32 sums
    assert h2d == eager_h2d and graphs == 2


@pytest.mark.gpu
@pytest.mark.xfail(
    reason="on an H100 (torch 2.11, commit f02ebe7) the default variant failed: NaN losses from the second step; training.compile over the offload engine is refused on CUDA until it passes (jobs/fit/checks.py)",
    strict=False,
)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="default"),
        # Which part of the engine's CUDA path, if any: every copy on the compute stream (no copy stream, no
        # events); every visit copied again (no slot reused on the strength of its version counters).
        pytest.param({"prefetch": 0}, id="no-prefetch"),
        pytest.param({"reuse_ring_slots": False}, id="no-slot-reuse"),
    ],
)
def test_on_the_gpu_inductor_compiles_streamed_blocks_once_and_trains_as_eager(options: dict[str, Any]) -> None:
    # The ring is device memory here, the copies run on the copy stream and the saved weights are tokens over it.
    eager_losses, eager_grads, _, eager_h2d = _train(4, backend=None, device="cuda", **options)
    losses, grads, graphs, h2d = _train(4, backend="inductor", device="cuda", **options)
    assert losses == pytest.approx(eager_losses, abs=1e-4)
    _assert_close(grads, eager_grads, atol=1e-4)  # float32 without TF32; inductor's fusions reorder the sums
    assert h2d == eager_h2d and graphs == 2


@pytest.mark.gpu
def test_on_the_gpu_inductor_trains_the_resident_decoder_layers_as_eager() -> None:
    # No engine: the model resident on the device, compiled the same way. Should this fail as the streamed test
    # does, the NaN is inductor's on CUDA, not the engine's.
    eager_losses, eager_grads, _, _ = _train(4, backend=None, device="cuda", offload=False)
    losses, grads, graphs, _ = _train(4, backend="inductor", device="cuda", offload=False)
    assert losses == pytest.approx(eager_losses, abs=1e-4)
    _assert_close(grads, eager_grads, atol=1e-4)
    assert graphs == 2


def test_a_forward_bound_on_the_block_is_compiled_once_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    # A kernel library binds a fused forward on each instance (Liger does so for norms and MLPs): that function is
    # compiled, once for every block that has it; another wrapper is left alone.
    import types

    torch._dynamo.reset()

    def fused(self: _AdaptedBlock, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(self.down(x))

    model = nn.Sequential(nn.ModuleList(_AdaptedBlock() for _ in range(3)))
    first, second, third = model[0]
    first.forward = types.MethodType(fused, first)
    second.forward = types.MethodType(fused, second)
    third.forward = lambda x: x  # not a method of the block: runs as it is
    compiled = compile_repeated_blocks(model, backend="aot_eager")
    assert compiled is not None and compiled.blocks == [first, second]
    x = torch.randn(2, 16)
    expected = x + first.up(first.down(x))
    torch.testing.assert_close(first(x), expected)
    second(x)
    assert compiled.graphs == 1 and third(x) is x
    compiled.remove()
    assert first.forward.__func__ is fused and second.forward.__func__ is fused
