"""Weight sources tell the engine's disk tier where each tensor's exact bytes lie: a sharded Hugging Face
checkpoint streams from its shards bitwise as ``from_pretrained`` loads it, and a tensor whose stored bytes are
not the model's (another dtype) has no range, so it stays in RAM."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from jobs.models.loading.weight_sources import SafetensorsSource
from offload import OffloadOptions, OffloadTrainingManager
from tests.jobs.models.test_weight_sources import assert_bitwise_equal, save_tiny_qwen


def test_a_sharded_hf_checkpoint_streams_from_its_shards_bitwise(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from jobs.models.hf_causal_lm import HFCausalLMSpec, build_hf_causal_lm_on_meta

    save_tiny_qwen(tmp_path / "qwen")
    ordinary = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen", dtype=torch.bfloat16).state_dict()
    model, source = build_hf_causal_lm_on_meta(HFCausalLMSpec(kind="hf_causal_lm", path=tmp_path / "qwen"), 0,
                                               torch.device("cpu"))  # fmt: skip
    model.requires_grad_(False)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    options = OffloadOptions(host_memory_limit=weights * 3 // 4, disk_read_ahead=1)  # leaf units: small slots
    manager = OffloadTrainingManager(model, "cpu", options=options, initialize=source.fill, disk=source.file_range)
    source.finish()
    files = {r.path.name for layout in manager.plan.layouts for r in layout.disk}
    assert manager.plan.disk_bytes > 0 and files <= {p.name for p in (tmp_path / "qwen").glob("*.safetensors")}
    with torch.no_grad():  # a forward through the disk units, then the weights as remove() reads them back
        model(input_ids=torch.tensor([[1, 2, 3]]))
    manager.after_forward()
    manager.remove()
    assert_bitwise_equal({k: v.clone() for k, v in model.state_dict().items()}, ordinary)


def test_a_tensor_stored_in_another_dtype_has_no_range(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.randn(4, 4), "bias": torch.randn(4).bfloat16()}, str(path))
    model = torch.nn.Linear(4, 4).bfloat16()
    source = SafetensorsSource.from_files(model, [path])
    assert source.file_range("weight", model.weight) is None  # float32 on disk, bf16 in the model
    found = source.file_range("bias", model.bias)
    assert found is not None and found.path == path and found.nbytes == 8
