"""A deep model is estimated from shallow copies of it: the same figures, without building every layer."""

from __future__ import annotations

import pytest

import jobs.fit.estimate as estimate
from jobs import load_job_spec

DEEP = """name: deep
model: {kind: transformer_lm, hidden_size: 128, num_heads: 4, num_layers: %d, vocab_size: 500, max_seq_len: 64}
data: {kind: text, path: tiny_corpus.txt, seq_len: 64}
training: {steps: 1, batch_size: 2}
%s
"""


@pytest.mark.parametrize(
    "offload",
    [
        "",
        "offload: {enable_model_cpu_offload: true}",
        "lora: {target_modules: [to_q, to_v], rank: 4}\noffload: {enable_model_cpu_offload: true, enable_optimizer_cpu_offload: true}",
    ],
)
def test_a_deep_model_is_estimated_from_two_shallow_ones(offload: str) -> None:
    spec = load_job_spec(DEEP % (150, offload))
    built = estimate._estimate_built(spec)
    quick = estimate.estimate_memory(spec)
    assert quick.peak_device_bytes == pytest.approx(built.peak_device_bytes, rel=0.01)
    assert quick.pinned_host_bytes == pytest.approx(built.pinned_host_bytes, rel=0.01)


def test_200000_layers_never_build_200000_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    real = estimate._shapes_only_model
    monkeypatch.setattr(estimate, "_shapes_only_model", lambda spec: built.append(spec.model.num_layers) or real(spec))
    result = estimate.estimate_memory(load_job_spec(DEEP % (200_000, "")))
    assert built == [32, 64] and result.peak_device_bytes > 200_000 * 12 * 128 * 128 * 4
