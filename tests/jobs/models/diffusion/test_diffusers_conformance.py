"""Diffusers checkpoints as users have them: each DiT family's pipeline written by diffusers' ``save_pretrained``
with every part sharded (``diffusion_pytorch_model.safetensors.index.json`` beside several shards), trained
through the offload path from a cache.

For each family: LoRA with model offload gives the losses and adapter of the same job without offload (equal on
the CPU in float32); QLoRA (``quantize: nf4``) trains (expected to fail while the model section has no
``quantize`` field); a full fine-tune under model and optimizer offload saves a ``transformer/`` that the
family's diffusers class loads with ``from_pretrained``. The DiTs are 128 wide (two heads of 64) so their
attention and MLP weights hold whole NF4 blocks. docs/model-families.md lists the classes from this table.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from jobs import PathRoots, run_job
from tests.jobs.helpers import losses_and_saved
from tests.jobs.models.diffusion.conftest import SIZES
from tests.jobs.models.diffusion.helpers import cache_job, spec_from, train_job
from tests.jobs.models.diffusion.pipelines import image_folder, qwen_image_pipeline, wan_pipeline

pytestmark = pytest.mark.filterwarnings("ignore")
SHARD = "500KB"  # a DiT of 0.5M-1.3M float32 weights: several shards
HEAD_DIM = 64
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"

# Family (the pipeline's folder under the model root) → (its diffusers transformer class, what it exercises).
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen": ("QwenImageTransformer2DModel", "MMDiT with per-block modulation (img_mod, txt_mod), sharded"),
    "wan": ("WanTransformer3DModel", "video DiT with cross-attention to umT5, sharded"),
}


@pytest.fixture(scope="module")
def sharded_roots(tmp_path_factory: pytest.TempPathFactory) -> PathRoots:
    """Both pipelines saved sharded, an image folder, and each family's cache (written once for the module)."""
    root = tmp_path_factory.mktemp("sharded")
    qwen_image_pipeline(root / "models" / "qwen", attention_head_dim=HEAD_DIM, max_shard_size=SHARD)
    wan_pipeline(root / "models" / "wan", attention_head_dim=HEAD_DIM, max_shard_size=SHARD)
    image_folder(root / "data" / "images", SIZES)
    roots = PathRoots(model_roots=[root / "models"], data_roots=[root / "data"])
    for family in FAMILIES:
        outcome = run_job(spec_from(cache_job(family), roots), output_dir=root / f"cache-job-{family}")
        assert outcome.status == "succeeded", outcome
    return roots


def _job(family: str, **sections: Any) -> dict[str, Any]:
    return train_job(family, training={"steps": 3}, **sections)


def _transformer_class(family: str) -> Any:
    import diffusers

    return getattr(diffusers, FAMILIES[family][0])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_transformer_is_sharded_with_an_index(family: str, sharded_roots: PathRoots) -> None:
    folder = sharded_roots.model_roots[0] / family / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (folder / "diffusion_pytorch_model.safetensors").exists()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_offloaded_lora_equals_resident_lora(family: str, sharded_roots: PathRoots, tmp_path: Path) -> None:
    offloaded = spec_from(_job(family, offload={"enable_model_cpu_offload": True, "prefetch": 2}), sharded_roots)
    resident = spec_from(_job(family), sharded_roots)
    losses, adapter = losses_and_saved(offloaded, tmp_path / "offloaded", LORA_WEIGHTS)
    expected, expected_adapter = losses_and_saved(resident, tmp_path / "resident", LORA_WEIGHTS)
    assert losses == expected and len(losses) == 3
    assert adapter.keys() == expected_adapter.keys()
    assert all(torch.equal(value, expected_adapter[name]) for name, value in adapter.items())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_qlora_trains(family: str, sharded_roots: PathRoots, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torchao")
    model = {"quantize": "nf4", "dtype": "bfloat16", "text_encoder_dtype": "float32"}  # the cache's encoder dtype
    qlora = _job(family, model=model, offload={"enable_model_cpu_offload": True})
    with caplog.at_level(logging.INFO, logger="offload.quant.quantized"):
        losses, adapter = losses_and_saved(spec_from(qlora, sharded_roots), tmp_path, LORA_WEIGHTS)
    quantized = [r.args[0] for r in caplog.records if r.getMessage().startswith("quantized ")]
    assert quantized and quantized[0] > 0, "no weight of the base was quantized"
    assert all(torch.isfinite(torch.tensor(losses))), losses
    lora_b = [value for name, value in adapter.items() if "lora_B" in name]  # zero before training
    assert lora_b and any(bool(value.abs().sum()) for value in lora_b)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_fine_tune_saves_what_from_pretrained_loads(family: str, sharded_roots: PathRoots, tmp_path: Path) -> None:
    offload = {"enable_model_cpu_offload": True, "enable_optimizer_cpu_offload": True}
    spec = spec_from(_job(family, lora=None, offload=offload), sharded_roots)
    losses, _ = losses_and_saved(spec, tmp_path, "transformer/diffusion_pytorch_model.safetensors")
    assert all(torch.isfinite(torch.tensor(losses))), losses
    cls = _transformer_class(family)
    trained = cls.from_pretrained(str(tmp_path / "checkpoints" / "step-00000003" / "transformer"))
    original = cls.from_pretrained(str(sharded_roots.model_roots[0] / family / "transformer"))
    base = original.state_dict()
    assert trained.state_dict().keys() == base.keys()
    changed = [name for name, value in trained.state_dict().items() if not torch.equal(value, base[name])]
    assert changed, "the fine-tuned transformer equals the base"


def test_every_family_in_the_matrix_is_documented() -> None:
    text = (Path(__file__).resolve().parents[4] / "docs" / "model-families.md").read_text()
    for cls, what in FAMILIES.values():
        assert f"| {cls} | {what} |" in text, f"docs/model-families.md lacks the row of {cls}"
