"""The built-in GPT-style decoder."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from jobs import PathRoots
from jobs.models import build_model
from jobs.models.names import builtin_module_names
from jobs.models.transformer_lm import TransformerLMSpec
from jobs.recompute import apply_activation_checkpointing
from tests.jobs.helpers import TINY_LM, merged, python_calls, spec_from

SPEC = TransformerLMSpec(
    kind="transformer_lm", vocab_size=260, hidden_size=16, num_layers=2, num_heads=2, max_seq_len=8
)


def test_loss_and_logits() -> None:
    model, loss_fn = build_model(SPEC, seed=0)
    ids = torch.randint(260, (3, 8))
    assert model(ids).shape == (3, 8, 260)
    loss = loss_fn(model, {"input_ids": ids, "labels": ids})
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(260.0)).item()) < 0.5


def test_init_is_seeded_and_dtype_applies() -> None:
    a, _ = build_model(SPEC, seed=1)
    b, _ = build_model(SPEC, seed=1)
    c, _ = build_model(SPEC.model_copy(update={"dtype": "bfloat16"}), seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert all(p.dtype == torch.bfloat16 for p in c.parameters())
    assert torch.equal(a.blocks[0].norm1.weight, torch.ones(16))


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    ids = torch.randint(260, (2, 8))
    grads = []
    for checkpointing in (False, True):
        model, loss_fn = build_model(SPEC, seed=0)
        model.gradient_checkpointing = checkpointing
        apply_activation_checkpointing(model)  # Ferry's reentrant checkpoint, as the trainer applies it
        loss_fn(model, {"input_ids": ids, "labels": ids}).backward()
        grads.append(model.blocks[0].attn.to_q.weight.grad)
    assert torch.allclose(grads[0], grads[1])


def test_checkpointing_with_frozen_embeddings_gives_the_same_gradients_bitwise() -> None:
    # LoRA's case: nothing before the first block trains, so the reentrant checkpoint reaches the blocks only
    # if their input is made to require grad.
    ids = torch.randint(260, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        model, loss_fn = build_model(SPEC.model_copy(update={"num_layers": 3}), seed=0)
        model.train().requires_grad_(False)
        for block in model.blocks:
            block.requires_grad_(True)
        model.gradient_checkpointing = checkpointing
        apply_activation_checkpointing(model)  # Ferry's reentrant checkpoint, as the trainer applies it
        loss_fn(model, {"input_ids": ids, "labels": ids}).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    assert all(grads[1][n] is not None and torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_checkpointing_adds_little_host_work_to_a_training_step() -> None:
    # The non-reentrant checkpoint ran hooks for every tensor a block saves: 10.5x the Python calls of this
    # tiny model's step without checkpointing; the reentrant one (jobs/recompute/checkpoint.py) 2.8x.
    ids = torch.randint(260, (2, 8), generator=torch.Generator().manual_seed(0))
    calls = []
    for checkpointing in (False, True):
        model, loss_fn = build_model(SPEC, seed=0)
        model.train().gradient_checkpointing = checkpointing
        apply_activation_checkpointing(model)  # Ferry's reentrant checkpoint, as the trainer applies it

        def step(model=model, loss_fn=loss_fn) -> None:
            loss_fn(model, {"input_ids": ids, "labels": ids}).backward()

        step()  # warm up: first-call imports and caches
        calls.append(python_calls(step))
    assert calls[1] / calls[0] < 4, calls


def test_module_names_follow_the_seed_lora_targets() -> None:
    names = builtin_module_names(SPEC)
    for suffix in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "mlp.net.0", "mlp.net.2"):
        assert f"blocks.0.{suffix}" in names


def test_weights_from_a_safetensors_file(tmp_path: Path, roots: PathRoots) -> None:
    source, _ = build_model(SPEC, seed=3)
    save_file(source.state_dict(), str(roots.model_roots[0] / "lm.safetensors"))
    spec = spec_from(
        merged(
            TINY_LM, model={**SPEC.model_dump(exclude={"weights"}), "weights": "lm.safetensors"}, data={"seq_len": 8}
        ),
        roots,
    )
    loaded, _ = build_model(spec.model, seed=0)
    assert torch.equal(loaded.lm_head.weight, source.lm_head.weight)
