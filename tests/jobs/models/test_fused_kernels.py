"""``training.kernels: liger``: Liger-Kernel's fused layers where CUDA and the library are there, the plain path
with a warning event everywhere else, and the same loss and gradients as the plain path (GPU test)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jobs import JobSpecError, run_job
from jobs.events import event_to_wire
from jobs.models import fused_kernels
from jobs.models.fused_kernels import apply_liger_kernels, fused_kernels_notice
from jobs.models.hf_causal_lm import FAMILY as HF_CAUSAL_LM
from tests.jobs.helpers import TOY, assert_same_weights, final_weights, merged, spec_from

CUDA = torch.device("cuda")


def test_kernels_default_to_none_and_take_liger() -> None:
    assert spec_from(TOY).training.kernels == "none"
    assert spec_from(merged(TOY, training={"kernels": "liger"})).training.kernels == "liger"
    with pytest.raises(JobSpecError, match="training.kernels"):
        spec_from(merged(TOY, training={"kernels": "unsloth"}))


def test_the_hf_family_applies_liger() -> None:
    assert HF_CAUSAL_LM.apply_kernels is apply_liger_kernels


def test_liger_on_the_cpu_warns_and_trains_as_the_plain_path(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    run_job(
        spec_from(merged(TOY, training={"kernels": "liger", "steps": 3})),
        output_dir=tmp_path / "liger",
        report=lambda e: events.append(event_to_wire(e)),
    )
    run_job(spec_from(merged(TOY, training={"steps": 3})), output_dir=tmp_path / "plain")
    warnings = [e["message"] for e in events if e["type"] == "log" and e["level"] == "warning"]
    assert "training.kernels: liger has no kernels for model.kind toy_mlp; the plain path runs" in warnings
    assert_same_weights(final_weights(tmp_path / "liger"), final_weights(tmp_path / "plain"))


def _applies(model: nn.Module) -> list[str]:
    return ["rope", "rms_norm"]


def test_the_notice_says_why_the_plain_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    assert fused_kernels_notice("none", "hf_causal_lm", _applies, model, CUDA) is None
    on_cpu = fused_kernels_notice("liger", "hf_causal_lm", _applies, model, torch.device("cpu"))
    assert on_cpu == (
        "warning",
        "training.kernels: liger needs a CUDA device (this job runs on cpu); the plain path runs",
    )
    monkeypatch.setattr(fused_kernels, "liger_available", lambda: False)
    missing = fused_kernels_notice("liger", "hf_causal_lm", _applies, model, CUDA)
    assert missing is not None and missing[0] == "warning" and "pip install 'ferry[kernels]'" in missing[1]
    monkeypatch.setattr(fused_kernels, "liger_available", lambda: True)
    assert fused_kernels_notice("liger", "hf_causal_lm", _applies, model, CUDA) == (
        "info",
        "training.kernels: liger: fused rope, rms_norm (Liger-Kernel)",
    )
    none_here = fused_kernels_notice("liger", "hf_causal_lm", lambda m: [], model, CUDA)
    assert none_here is not None and none_here[0] == "warning"


def _fake_liger(monkeypatch: pytest.MonkeyPatch, calls: list[dict[str, Any]]) -> None:
    """liger_kernel's table of apply functions, with one for llama that records its arguments (Liger's own
    defaults: its fused linear + cross-entropy on)."""
    import types

    def apply_liger_kernel_to_llama(
        rope: bool = True,
        cross_entropy: bool = False,
        fused_linear_cross_entropy: bool = True,
        rms_norm: bool = True,
        swiglu: bool = True,
        model: Any = None,
    ) -> None:
        calls.append({"rope": rope, "cross_entropy": cross_entropy, "rms_norm": rms_norm, "swiglu": swiglu,
                      "fused_linear_cross_entropy": fused_linear_cross_entropy, "model": model})  # fmt: skip

    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply_liger_kernel_to_llama}  # type: ignore[attr-defined]
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)


def test_liger_never_fuses_the_head_with_the_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its fused linear + cross-entropy reads lm_head.weight inside its own kernel, past the head's forward: past
    # the engine's hooks that bring a streamed head to the device and the NF4 layer's dequantization (QLoRA
    # quantizes the frozen head too). Ferry's loss takes the logits the head's own forward computes.
    calls: list[dict[str, Any]] = []
    _fake_liger(monkeypatch, calls)
    model = nn.Linear(2, 2)
    model.config = type("Config", (), {"model_type": "llama"})()  # type: ignore[assignment]
    assert apply_liger_kernels(model) == ["rope", "rms_norm", "swiglu"]
    assert calls == [{"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": False, "rms_norm": True,
                      "swiglu": True, "model": model}]  # fmt: skip
    model.config.model_type = "toy"  # type: ignore[union-attr]
    assert apply_liger_kernels(model) == [] and len(calls) == 1  # no kernels for it: the plain path


@pytest.mark.gpu
def test_liger_matches_the_plain_llama_loss_and_gradients() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("liger_kernel")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).to(CUDA)
    fused = copy.deepcopy(plain)
    assert set(apply_liger_kernels(fused)) >= {"rope", "rms_norm", "swiglu"}
    tokens = torch.randint(0, 300, (2, 32), device=CUDA)
    losses = []
    for model in (plain, fused):
        logits = model(input_ids=tokens).logits
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    # float32 throughout: the fused kernels reorder the sums, nothing more
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-4)
    for (name, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-4, msg=name)
