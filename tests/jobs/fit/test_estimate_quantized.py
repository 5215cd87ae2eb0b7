"""The fit check of a quantized base that loads quantized: host memory in the quantized form, and refused
with its figures where even that does not fit (as a bf16 base is).

Llama-3.1-70B's shape, from its ``config.json`` alone: NF4 stores each linear in 0.26 of its bf16 bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from jobs import PathRoots, estimate_memory
from jobs.fit.sizes import human_bytes
from offload.quant.quantized import stored_bytes_after
from tests.jobs.helpers import TINY_LM, merged, spec_from

pytest.importorskip("torchao")

LLAMA_70B = {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False}  # fmt: skip
GIB = 2**30


def job(quantize: str | None) -> dict[str, Any]:
    model: dict[str, Any] = {"kind": "hf_causal_lm", "path": "llama-70b", "init": "random"}
    if quantize:
        model["quantize"] = quantize
    return merged(
        {**TINY_LM, "model": model},
        data={"seq_len": 4096},
        lora={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
        training={"batch_size": 1, "gradient_checkpointing": True},
        offload={"enable_model_cpu_offload": True, "granularity": "block", "gpu_memory_limit": "24GiB"},
    )


@pytest.fixture
def llama_70b(roots: PathRoots) -> PathRoots:
    from transformers import LlamaConfig

    LlamaConfig(**LLAMA_70B).save_pretrained(roots.model_roots[0] / "llama-70b")
    return roots


def test_the_host_figure_of_an_nf4_base_is_its_quantized_bytes(llama_70b: PathRoots) -> None:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_70B), dtype=torch.bfloat16)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    nf4 = sum(stored_bytes_after(w, "nf4") for w in linears)
    rest = sum(p.numel() * 2 for p in model.parameters()) - sum(w.numel() * 2 for w in linears)
    estimate = estimate_memory(spec_from(job("nf4"), llama_70b))
    bf16 = estimate_memory(spec_from(job(None), llama_70b))
    assert nf4 + rest <= estimate.pinned_host_bytes <= 1.1 * (nf4 + rest)  # up to the arena's chunk rounding
    assert 33 * GIB < nf4 + rest < 40 * GIB  # 70.6B weights: 37.5 GB quantized, embeddings in bf16
    assert estimate.pinned_host_bytes < 0.3 * bf16.pinned_host_bytes
    assert any("quantized as they load" in note for note in estimate.notes)
    assert estimate.peak_device_bytes < 24 * GIB


def test_a_host_too_small_for_the_quantized_base_refuses_it_with_its_figures(llama_70b: PathRoots) -> None:
    from service.api.errors import ApiError
    from service.checking.fit import estimate_fit, refuse_if_beyond_the_host

    def on_a_host_of(gib: int, quantize: str | None) -> str:
        """Refused or not on a host of ``gib`` GiB (the job's device peak counts too: no GPU worker here)."""
        spec = spec_from(job(quantize), llama_70b)
        fit = estimate_fit(spec, [], []).model_copy(update={"host_total_bytes": gib * GIB})
        refuse_if_beyond_the_host(spec, fit)
        return human_bytes(fit.pinned_host_bytes)

    on_a_host_of(64, "nf4")  # 35 GiB quantized (+ the 23 GiB peak) fits 64 GiB; bf16's 131 GiB does not
    with pytest.raises(ApiError) as bf16:
        on_a_host_of(64, None)
    pinned = human_bytes(estimate_memory(spec_from(job(None), llama_70b)).pinned_host_bytes)
    assert f"pinned copies {pinned}) but this machine has 64.00 GiB" in str(bf16.value)
    with pytest.raises(ApiError) as nf4:
        on_a_host_of(32, "nf4")
    pinned = human_bytes(estimate_memory(spec_from(job("nf4"), llama_70b)).pinned_host_bytes)
    assert f"pinned copies {pinned}) but this machine has 32.00 GiB" in str(nf4.value)
