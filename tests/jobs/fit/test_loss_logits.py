"""A job's loss keeps its logits whole where the fit check's estimate with them fits its device, and chunks them
(the head recomputed in backward) where it does not; the two give the same losses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import jobs.models.decoder_activations as decoder_activations
import jobs.recompute.chunked_loss as chunked_loss
from jobs import PathRoots, estimate_memory
from jobs.fit.loss_logits import decide_loss_logits
from jobs.models.decoder_activations import loss_bytes_per_logit
from tests.jobs.helpers import merged, spec_from
from tests.jobs.models.test_hf_causal_lm import TINY_HF, save_tiny_llama
from tests.jobs.recompute.test_tiled_mlp import LONG, QWEN_32B

LLAMA_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)  # fmt: skip
LORA_4K = merged(LONG, model={"path": "llama-3b"}, data={"seq_len": 4096},
                 offload={"gpu_memory_limit": None, "activations": False})  # fmt: skip


def save_config(roots: PathRoots, name: str, config: Any) -> None:
    config.save_pretrained(roots.model_roots[0] / name)


def test_a_3b_lora_at_4096_tokens_keeps_its_logits_whole_on_an_80_gb_card(
    roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import LlamaConfig

    save_config(roots, "llama-3b", LlamaConfig(**LLAMA_3B))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the H100 is the edge patched
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=80 * 10**9))
    spec = spec_from(LORA_4K, roots)
    decision = decide_loss_logits(spec)
    assert decision is not None and decision.whole
    assert decision.message.startswith("loss: transformers' own") and "the GPU's memory 74.51 GiB" in decision.message
    estimate = estimate_memory(spec)
    assert estimate.peak_device_bytes == estimate.whole_logits_peak_bytes  # the peak counts what the job does
    # The loss's phase is the peak: 4096 x 128256 logits, 12 bytes each in its backward.
    assert estimate.peak_device_bytes > 4096 * 128256 * loss_bytes_per_logit(2)


def test_a_32b_lora_at_32k_tokens_under_24_gib_chunks_its_logits(roots: PathRoots) -> None:
    from transformers import Qwen2Config

    save_config(roots, "qwen-32b", Qwen2Config(**QWEN_32B))
    spec = spec_from(LONG, roots)
    decision = decide_loss_logits(spec)
    assert decision is not None and not decision.whole
    assert "exceed offload.gpu_memory_limit 24.00 GiB" in decision.message
    estimate = estimate_memory(spec)
    assert estimate.peak_device_bytes < 24 * 2**30 < estimate.whole_logits_peak_bytes


def test_a_cpu_job_without_a_limit_decides_nothing_and_chunks_large_logits(roots: PathRoots) -> None:
    from transformers import LlamaConfig

    save_config(roots, "llama-3b", LlamaConfig(**LLAMA_3B))
    spec = spec_from(merged(LORA_4K, device="cpu"), roots)
    assert decide_loss_logits(spec) is None  # the job builds no meta model to ask: its loss chunks above the threshold
    estimate = estimate_memory(spec)  # the fit check says so
    assert estimate.loss_logits is not None and not estimate.loss_logits.whole
    assert "no offload.gpu_memory_limit and no GPU here" in estimate.loss_logits.message
    assert estimate.peak_device_bytes < estimate.whole_logits_peak_bytes


def test_transformers_loss_holds_the_bytes_per_logit_the_estimate_counts() -> None:
    """Live storages counted around transformers' causal-LM loss, forward and backward, against the estimate's
    bytes per logit (the head's weight gradient the only other tensor)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from transformers.loss.loss_utils import ForCausalLMLoss

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, int] = {}
            self.now = self.peak = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for tensor in tree_flatten(out)[0]:
                storage = tensor.untyped_storage() if isinstance(tensor, torch.Tensor) else None
                if storage is not None and storage.data_ptr() and storage.data_ptr() not in self.live:
                    self.live[storage.data_ptr()] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self.free, storage.data_ptr())
            return out

        def free(self, address: int) -> None:
            self.now -= self.live.pop(address, 0)

    positions, vocab, width = 512, 4096, 64
    for dtype in (torch.bfloat16, torch.float32):
        head = torch.nn.Linear(width, vocab, bias=False, dtype=dtype)
        hidden = torch.randn(1, positions, width, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, vocab, (1, positions))
        with LiveBytes() as counted:
            loss = ForCausalLMLoss(head(hidden), labels, vocab)  # the logits freed once the loss is taken
            loss.backward()
        weight_gradient = width * vocab * dtype.itemsize
        per_logit = (counted.peak - weight_gradient) / (positions * vocab)
        assert per_logit == pytest.approx(loss_bytes_per_logit(dtype.itemsize), abs=0.1)


def trained(roots: PathRoots, output: Path, limit: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], Any]:
    """Losses of a tiny LoRA job under ``limit``, its log events, and how often the loss ran chunk by chunk."""
    from jobs import run_job
    from jobs.events import LogEvent, StepEvent

    chunk_calls: list[int] = []
    real = chunked_loss.chunked_nll
    monkeypatch.setattr(chunked_loss, "chunked_nll", lambda *a: chunk_calls.append(1) or real(*a))
    events: list[Any] = []
    job = merged(TINY_HF, offload={"gpu_memory_limit": limit}, checkpoint={"save_final": False})
    run_job(spec_from(job, roots), output_dir=output, report=events.append)
    logs = [e.message for e in events if isinstance(e, LogEvent) and e.message.startswith("loss: ")]
    return [e.loss for e in events if isinstance(e, StepEvent)], SimpleNamespace(logs=logs, chunked=len(chunk_calls))


def test_a_job_whose_logits_fit_its_limit_keeps_them_whole_and_one_whose_do_not_chunks_them(
    tmp_path: Path, roots: PathRoots, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    for module in (chunked_loss, decoder_activations):  # every batch's logits count as large
        monkeypatch.setattr(module, "CHUNK_ABOVE_BYTES", 0)
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 300 * 4 * 7)  # 7 positions a chunk
    # 1 GiB holds the tiny job's peak and the 512 MiB margin; 512 MiB is the margin alone.
    whole, fitting = trained(roots, tmp_path / "whole", "1GiB", monkeypatch)
    chunked, tight = trained(roots, tmp_path / "chunked", "512MiB", monkeypatch)
    assert fitting.chunked == 0 and len(fitting.logs) == 1 and fitting.logs[0].startswith("loss: transformers' own")
    assert tight.chunked == 4 and len(tight.logs) == 1 and tight.logs[0].startswith("loss: chunked")
    assert "exceed offload.gpu_memory_limit 512.0 MiB" in tight.logs[0]
    assert len(whole) == 4 and chunked == pytest.approx(whole, rel=1e-5)
