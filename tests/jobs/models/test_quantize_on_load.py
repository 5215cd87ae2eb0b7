"""Quantize on load: a meta model's frozen linears quantized one by one into the pinned arena.

Bitwise the payloads (each torchao tensor's inner tensors) and the training losses of today's path (the model
built whole, then ``quantize_frozen_weights``), for a Hugging Face checkpoint from ``save_pretrained`` and
for ``init: random``; and no more than one dense weight alive at a time, never the dense model.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jobs import PathRoots, run_job
from jobs.events import StartedEvent, StepEvent
from jobs.models.loading.weight_sources import RandomSource, WeightSource
from offload import OffloadTrainingManager
from tests.jobs.helpers import TINY_LM, merged, spec_from

pytest.importorskip("torchao")

# Every linear quantizable with NF4 (whole blocks of 64 x 256 weights), the head tied to the embedding.
CONFIG = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True}  # fmt: skip
LORA = {"target_modules": ["q_proj", "v_proj"], "rank": 4}


def save_tiny_llama(directory: Path, *, weights: bool) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**CONFIG)
    if not weights:
        config.save_pretrained(directory)
        return
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory, max_shard_size="200KB")


def inner(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each quantized weight's inner tensors (codes, scales), by parameter name."""
    from offload.quant.payload import inner_tensors, is_quantized

    return {n: [t.clone() for _, t in inner_tensors(p)] for n, p in model.named_parameters() if is_quantized(p)}


def assert_same_payloads(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a[name], b[name], strict=True)), name


def quantized_on_load(model: nn.Module, source: WeightSource, method: str) -> nn.Module:
    from jobs.models.loading.quantizing_source import QuantizingSource

    model.requires_grad_(False)
    quantizing = QuantizingSource(source, model, method, torch.device("cpu"))
    OffloadTrainingManager(model, "cpu", initialize=quantizing.fill)
    report = quantizing.finish()
    assert report.quantized == method and report.stored_bytes and report.quantize_seconds is not None
    assert not any(t.is_meta for t in model.parameters())
    return model


def materialized(model: nn.Module, source: WeightSource) -> nn.Module:
    """The meta model with every tensor filled by ``source`` in ordinary memory: the loaded dense model."""
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_meta:
                values = torch.empty(tensor.shape, dtype=tensor.dtype)
                source.fill(name, tensor, values)
                swapped = nn.Parameter(values, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else values
                torch.utils.swap_tensors(tensor, swapped)
    source.finish()
    return model


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_a_checkpoint_quantized_on_load_is_bitwise_quantize_frozen_weights(tmp_path: Path, method: str) -> None:
    from transformers import AutoModelForCausalLM

    from jobs.models.hf_causal_lm import HFCausalLMSpec, build_hf_causal_lm_on_meta
    from offload import quantize_frozen_weights

    save_tiny_llama(tmp_path / "llama", weights=True)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.bfloat16).requires_grad_(False)
    quantize_frozen_weights(whole, method)
    spec = HFCausalLMSpec(kind="hf_causal_lm", path=tmp_path / "llama")
    model, source = build_hf_causal_lm_on_meta(spec, 0, torch.device("cpu"))
    assert_same_payloads(inner(quantized_on_load(model, source, method)), inner(whole))
    embedding = "model.embed_tokens.weight"  # not quantized
    assert torch.equal(dict(model.named_parameters())[embedding], dict(whole.named_parameters())[embedding])


def test_random_init_quantized_on_load_is_bitwise_the_drawn_model_quantized(tmp_path: Path) -> None:
    from jobs.models.hf_causal_lm import HFCausalLMSpec, build_hf_causal_lm_on_meta
    from offload import quantize_frozen_weights

    save_tiny_llama(tmp_path / "llama", weights=False)
    spec = HFCausalLMSpec(kind="hf_causal_lm", path=tmp_path / "llama", init="random")
    dense = materialized(*build_hf_causal_lm_on_meta(spec, 3, torch.device("cpu"))).requires_grad_(False)
    quantize_frozen_weights(dense, "nf4")
    model, source = build_hf_causal_lm_on_meta(spec, 3, torch.device("cpu"))
    assert isinstance(source, RandomSource)
    assert_same_payloads(inner(quantized_on_load(model, source, "nf4")), inner(dense))


def test_no_more_than_one_dense_weight_is_ever_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense values each placeholder is quantized from are freed before the next is drawn; the arena
    holds the quantized bytes, not the dense ones."""
    from jobs.models.hf_causal_lm import HFCausalLMSpec, build_hf_causal_lm_on_meta

    save_tiny_llama(tmp_path / "llama", weights=False)
    alive, peak = [0], [0]

    def tracked(self: RandomSource, name: str, tensor: torch.Tensor) -> torch.Tensor:
        values = torch.empty(tensor.shape, dtype=tensor.dtype)
        self.fill(name, tensor, values)
        nbytes = values.numel() * values.element_size()
        alive[0] += nbytes
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(values, lambda: alive.__setitem__(0, alive[0] - nbytes))
        return values

    monkeypatch.setattr(RandomSource, "dense", tracked)
    spec = HFCausalLMSpec(kind="hf_causal_lm", path=tmp_path / "llama", init="random")
    model, source = build_hf_causal_lm_on_meta(spec, 0, torch.device("cpu"))
    linears = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    dense_bytes = sum(w.numel() * w.element_size() for w in linears)
    largest = max(w.numel() * w.element_size() for w in linears)
    model.requires_grad_(False)
    from jobs.models.loading.quantizing_source import QuantizingSource

    quantizing = QuantizingSource(source, model, "nf4", torch.device("cpu"))
    manager = OffloadTrainingManager(model, "cpu", initialize=quantizing.fill)
    quantizing.finish()
    assert 0 < peak[0] <= largest < dense_bytes / 5
    assert alive[0] == 0
    embedding = dict(model.named_parameters())["model.embed_tokens.weight"].numel() * 2  # bf16: not a linear
    assert manager.arena.requested_bytes < 0.3 * dense_bytes + embedding + 2**16


def llama_job(roots: PathRoots, init: str, quantize: str) -> dict[str, Any]:
    model = {"kind": "hf_causal_lm", "path": "llama", "init": init, "quantize": quantize}
    return merged(
        {**TINY_LM, "model": model},
        lora=LORA,
        offload={"enable_model_cpu_offload": True, "granularity": "block"},
        training={"steps": 3, "gradient_checkpointing": True},
        checkpoint={"save_final": False},
    )


def job_losses(data: dict[str, Any], roots: PathRoots, output: Path) -> tuple[list[float], StartedEvent]:
    events: list[Any] = []
    run_job(spec_from(data, roots), output_dir=output, report=events.append)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert len(steps) == 3, events[-1]
    return [e.loss for e in steps], next(e for e in events if isinstance(e, StartedEvent))


@pytest.mark.parametrize("init", ["checkpoint", "random"])
def test_a_job_quantized_on_load_trains_as_the_model_built_whole_and_quantized(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch, init: str
) -> None:
    import jobs.train.session as session
    from jobs.models.hf_causal_lm import build_hf_causal_lm_on_meta
    from jobs.models.transformer_lm import lm_loss

    save_tiny_llama(roots.model_roots[0] / "llama", weights=init == "checkpoint")
    data = llama_job(roots, init, "nf4")
    on_load, started = job_losses(data, roots, tmp_path / "on-load")
    assert started.load is not None and started.load.quantized == "nf4" and started.load.stored_bytes

    # Today's path: the dense model built whole in memory, then quantize_frozen_weights before the engine.
    monkeypatch.setattr(session, "_loads_into_pinned_memory", lambda spec, family: False)
    if init == "random":  # the values the meta path draws (RandomSource), in ordinary memory
        monkeypatch.setattr(
            session,
            "build_model",
            lambda spec, seed: (materialized(*build_hf_causal_lm_on_meta(spec, seed, torch.device("cpu"))), lm_loss),
        )
    whole, started = job_losses(data, roots, tmp_path / "whole")
    assert started.load is not None and started.load.source == "in_memory"
    assert on_load == whole
