"""The chunked next-token loss equals transformers' (to float rounding), with its gradients, under LoRA and
under the offload engine; the fit check's logits term shrinks to a chunk's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import jobs.recompute.chunked_loss as chunked
from jobs import PathRoots
from jobs.models.hf_causal_lm import hf_lm_loss
from jobs.models.transformer_lm import lm_loss
from jobs.recompute.chunked_loss import chunked_lm_loss
from offload import OffloadTrainingManager


def tiny_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    return get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    )


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 300, (2, 40), generator=generator)
    labels = input_ids.clone()
    labels[1, 30:] = -100  # padding is not counted
    return {"input_ids": input_ids, "labels": labels}


def loss_and_grads(model: torch.nn.Module, loss_fn: object) -> tuple[float, dict[str, torch.Tensor]]:
    loss = loss_fn(model, batch())  # type: ignore[operator]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.item(), grads


@pytest.mark.parametrize("engine", [False, True], ids=["resident", "offloaded"])
def test_the_chunked_loss_is_transformers_loss(monkeypatch: pytest.MonkeyPatch, engine: bool) -> None:
    model = tiny_llama()
    manager = OffloadTrainingManager(model, "cpu") if engine else None
    expected, expected_grads = loss_and_grads(model, lm_loss)
    assert chunked_lm_loss(model, batch()) is None  # 40 x 300 float32 logits: made at once
    monkeypatch.setattr(chunked, "CHUNK_ABOVE_BYTES", 0)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 300 * 4 * 7)  # 7 positions a chunk: the last one short
    got, grads = loss_and_grads(model, hf_lm_loss)
    assert got == pytest.approx(expected, rel=1e-6)
    assert grads.keys() == expected_grads.keys() and len(grads) == 10
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-6)
    if manager is not None:
        manager.remove()


def test_the_fit_check_counts_one_chunk_of_logits(roots: PathRoots) -> None:
    from jobs.models.decoder_activations import DecoderDims, decoder_activation_bytes
    from tests.jobs.helpers import TINY_LM, merged, spec_from

    long = merged(TINY_LM, model={"max_seq_len": 32768}, data={"seq_len": 32768}, training={"batch_size": 1})
    spec = spec_from(long, roots)
    dims = DecoderDims(5120, 27648, 64, 152064, (10, 4))
    whole = decoder_activation_bytes(spec, dims)
    chunked_bytes = decoder_activation_bytes(spec, DecoderDims(5120, 27648, 64, 152064, (10, 4), chunked_logits=True))
    assert whole - chunked_bytes > 30 * 2**30  # the 32768 x 152064 logits gone; a block's backward is the peak


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_preference_log_probs_are_made_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch, objective: str) -> None:
    """DPO's doubled batch (policy rows, reference rows) at 2 x 2048 tokens made 8192 positions of float32
    logits at once, 4.6 GiB at Qwen2.5's vocabulary: out of memory at step 1 of a 32B job under 24 GiB, where
    the SFT step on the same tokens fits. Its log-probs come from the head chunk by chunk now, with the loss
    and gradients of the whole-logits computation."""
    from types import SimpleNamespace

    from jobs.objectives.preference import PreferenceLoss

    training = SimpleNamespace(
        objective=objective,
        dpo=SimpleNamespace(beta=0.1, loss_type="sigmoid", label_smoothing=0.0),
        orpo=SimpleNamespace(beta=0.1),
    )
    model = tiny_llama()
    loss_fn = PreferenceLoss(training, model)
    expected, expected_grads = loss_and_grads(model, loss_fn)
    positions: list[int] = []
    rows_with_grad: set[int] = set()  # rows of the head's calls that build a graph (the chunk's recompute)

    def seen(_m: Any, inputs: tuple[torch.Tensor, ...], _out: Any) -> None:
        positions.append(inputs[0].shape[1])
        if torch.is_grad_enabled():
            rows_with_grad.add(inputs[0].shape[0])

    head = model.get_base_model().get_output_embeddings()
    head.register_forward_hook(seen)
    monkeypatch.setattr(chunked, "CHUNK_ABOVE_BYTES", 0)
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 300 * 4 * 7)  # 7 positions a chunk
    got, grads = loss_and_grads(model, loss_fn)
    assert positions and max(positions) <= 7  # the whole sequence's logits never exist
    # DPO's reference rows (the second half) are detached: the head runs them without a graph, and only the
    # policy rows are recomputed for the backward.
    assert rows_with_grad == {2}  # two pairs of rows: DPO's policy rows, or ORPO's chosen and rejected
    assert got == pytest.approx(expected, rel=1e-5)
    assert grads.keys() == expected_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-6)
