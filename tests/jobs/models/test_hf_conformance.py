"""Checkpoints as users have them: eleven architectures transformers ships, each written by ``save_pretrained``
(one sharded with an index), trained through the offload path.

For each: LoRA with model offload gives the losses and adapter of the same job without offload (which loads
with ``from_pretrained``); QLoRA (``quantize: nf4``) trains; a full fine-tune under model and optimizer offload
saves a checkpoint that ``from_pretrained`` loads. The architectures cover tied and untied heads, grouped-query
attention, fused qkv and gate/up (Phi-3), Conv1D (GPT-2), soft-capping (Gemma 2), sliding windows (Mistral,
Gemma 3), mixtures of experts stored per expert and fused on load (Mixtral, Qwen3-MoE), parallel residual and a
renamed head (GPT-NeoX). docs/model-families.md lists them from this table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from jobs import PathRoots, load_job_spec
from tests.jobs.helpers import losses_and_saved, merged, spec_from

VOCAB = 320  # the byte tokenizer's 257 ids fit
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _config(arch: str) -> Any:
    import transformers as t

    gqa = dict(SMALL, num_key_value_heads=2, max_position_embeddings=128)
    if arch == "llama":
        return t.LlamaConfig(**gqa, tie_word_embeddings=True)
    if arch == "qwen2":
        return t.Qwen2Config(**gqa, tie_word_embeddings=True)
    if arch == "qwen3":
        return t.Qwen3Config(**gqa, head_dim=16, tie_word_embeddings=False)
    if arch == "mistral":
        return t.MistralConfig(**gqa, sliding_window=16, tie_word_embeddings=False)
    if arch == "phi3":
        return t.Phi3Config(**gqa, pad_token_id=0, tie_word_embeddings=False)
    if arch == "gpt2":
        return t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    if arch == "gemma2":
        return t.Gemma2Config(
            **gqa, head_dim=16, sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
        )
    if arch == "gemma3":
        return t.Gemma3TextConfig(**gqa, head_dim=16, sliding_window=16)
    if arch == "mixtral":
        return t.MixtralConfig(**gqa, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return t.Qwen3MoeConfig(
            **gqa,
            head_dim=16,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    if arch == "gpt_neox":
        return t.GPTNeoXConfig(
            **dict(SMALL, max_position_embeddings=128), use_parallel_residual=True, tie_word_embeddings=False
        )
    raise AssertionError(arch)


# Architecture → (LoRA targets, what it exercises). The Llama checkpoint is the sharded one.
ARCHITECTURES: dict[str, tuple[list[str], str]] = {
    "llama": (["q_proj", "v_proj"], "tied head, grouped-query attention, sharded with an index"),
    "qwen2": (["q_proj", "v_proj"], "tied head, attention biases"),
    "qwen3": (["q_proj", "v_proj"], "untied head, q/k norms"),
    "mistral": (["q_proj", "v_proj"], "sliding-window attention"),
    "phi3": (["qkv_proj", "gate_up_proj"], "fused qkv and gate/up projections"),
    "gpt2": (["c_attn"], "Conv1D layers, tied head, learned positions"),
    "gemma2": (["q_proj", "v_proj"], "logit soft-capping, sliding windows, tied head"),
    "gemma3": (["q_proj", "v_proj"], "text-only Gemma 3: sliding/global layers, tied head"),
    "mixtral": (["q_proj", "v_proj"], "MoE stored per expert (block_sparse_moe), fused on load"),
    "qwen3_moe": (["q_proj", "v_proj"], "MoE stored per expert, fused gate_up on load"),
    "gpt_neox": (["query_key_value"], "parallel residual, head stored as embed_out"),
}


def save_architecture(arch: str, directory: Path) -> Path:
    """A seeded random model of ``arch`` written by ``save_pretrained`` (transformers' own layout)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch))
    shard = {"max_shard_size": "100KB"} if arch == "llama" else {}
    model.save_pretrained(directory, **shard)
    return directory


def _job(arch: str, **sections: Any) -> dict[str, Any]:
    targets, _ = ARCHITECTURES[arch]
    base = {
        "name": f"conformance-{arch}",
        "device": "cpu",
        "model": {"kind": "hf_causal_lm", "path": arch, "dtype": "float32"},
        "data": {"kind": "text", "path": "corpus", "seq_len": 32, "packing": "padded"},
        "lora": {"target_modules": targets, "rank": 4, "alpha": 8},
        "training": {"steps": 3, "batch_size": 2, "learning_rate": 1e-2},
        "offload": {"enable_model_cpu_offload": True},
    }
    return merged(base, **sections)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for arch in ARCHITECTURES:
        save_architecture(arch, root / arch)
    return root


@pytest.fixture
def hf_roots(model_root: Path, roots: PathRoots) -> PathRoots:
    return PathRoots(model_roots=[model_root], data_roots=roots.data_roots)


def test_the_llama_checkpoint_is_sharded(model_root: Path) -> None:
    index = json.loads((model_root / "llama" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_offloaded_lora_equals_resident_lora(arch: str, hf_roots: PathRoots, tmp_path: Path) -> None:
    offloaded = spec_from(_job(arch), hf_roots)
    resident = spec_from(_job(arch, offload={"enable_model_cpu_offload": False}), hf_roots)
    losses, adapter = losses_and_saved(offloaded, tmp_path / "offloaded", "adapter_model.safetensors")
    expected, expected_adapter = losses_and_saved(resident, tmp_path / "resident", "adapter_model.safetensors")
    print(f"{arch}: offloaded losses {losses}, resident {expected}")
    assert losses[0] == pytest.approx(expected[0], rel=1e-5, abs=1e-6)
    assert losses == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert adapter.keys() == expected_adapter.keys()
    for name, value in adapter.items():
        torch.testing.assert_close(value, expected_adapter[name], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_qlora_trains(arch: str, hf_roots: PathRoots, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    spec = spec_from(_job(arch, model={"quantize": "nf4", "dtype": "bfloat16"}), hf_roots)
    losses, adapter = losses_and_saved(spec, tmp_path, "adapter_model.safetensors")
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert any(bool(value.abs().sum()) for name, value in adapter.items() if "lora_B" in name)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_full_fine_tune_saves_what_from_pretrained_loads(arch: str, hf_roots: PathRoots, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    data = _job(
        arch,
        offload={"enable_model_cpu_offload": True, "enable_optimizer_cpu_offload": True},
        training={"steps": 2, "optimizer": "adamw"},
    )
    data.pop("lora")
    spec = spec_from(data, hf_roots)
    losses, _ = losses_and_saved(spec, tmp_path, "model.safetensors")
    assert all(torch.isfinite(torch.tensor(losses))), losses
    checkpoint = next((tmp_path / "checkpoints").glob("step-*"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    original = AutoModelForCausalLM.from_pretrained(str(hf_roots.model_roots[0] / arch))
    changed = [n for n, p in reloaded.state_dict().items() if not torch.equal(p, original.state_dict()[n])]
    assert changed, "the fine-tuned weights equal the base model's"
    with torch.no_grad():
        assert torch.isfinite(reloaded(input_ids=torch.arange(8).unsqueeze(0)).logits).all()


def test_every_architecture_in_the_matrix_is_documented() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "model-families.md").read_text()
    for arch, (_, what) in ARCHITECTURES.items():
        assert f"| {arch} | {what} |" in text, f"docs/model-families.md lacks the row of {arch}"


def test_a_spec_from_yaml_names_the_family(hf_roots: PathRoots) -> None:
    assert load_job_spec(json.dumps(_job("llama")), roots=hf_roots).model.kind == "hf_causal_lm"


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3_moe"])
def test_the_fit_check_sizes_what_from_pretrained_loads(arch: str, hf_roots: PathRoots) -> None:
    """The estimate's meta model has the loaded model's tensors: a tied head counted once, experts fused."""
    from transformers import AutoModelForCausalLM

    from jobs.models.hf_causal_lm import meta_hf_causal_lm

    spec = spec_from(_job(arch), hf_roots)
    meta = meta_hf_causal_lm(spec.model)
    loaded = AutoModelForCausalLM.from_pretrained(str(hf_roots.model_roots[0] / arch))
    shapes = lambda model: {n: tuple(p.shape) for n, p in model.named_parameters()}  # noqa: E731
    assert shapes(meta) == shapes(loaded)
