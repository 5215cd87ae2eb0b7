"""A checkpoint that cannot fill its model is refused at submit: ``POST /v1/jobs/validate`` answers 422 naming
the tensor and its file, and nothing is queued. The checkpoints are written by ``save_pretrained``, sharded,
then broken the ways users' downloads break (a tensor cut from a shard, a shard missing)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load_file, save_file

from tests.jobs.llm_helpers import chat_record, llm_spec, save_bpe_tokenizer, write_jsonl
from tests.service.conftest import Server


def _sharded_llama(directory: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="20KB")
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server over four copies of a sharded Llama: whole, a tensor cut from its shard, a tensor gone from
    shard and index, and a config.json of another width."""
    root = tmp_path_factory.mktemp("checkpoint-check")
    models, data = root / "models", root / "datasets"
    save_bpe_tokenizer(models / "tok")
    write_jsonl(data / "chat.jsonl", [chat_record(i) for i in range(16)])
    whole = _sharded_llama(models / "llama")
    for name in ("cut", "gone", "wider"):
        shutil.copytree(whole, models / name)
    _cut(models / "cut", CUT)
    _cut(models / "gone", GONE, from_index=True)
    config = json.loads((models / "wider" / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights say 64
    (models / "wider" / "config.json").write_text(json.dumps(config))
    server = Server(root / "data", {"FERRY_MODEL_ROOTS": str(models), "FERRY_DATA_ROOTS": str(data)})
    server.start()
    yield server
    server.stop()


CUT, GONE = "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"


def _cut(model: Path, victim: str, *, from_index: bool = False) -> str:
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][victim]
    tensors = load_file(str(model / shard))
    del tensors[victim]
    save_file(tensors, str(model / shard), metadata={"format": "pt"})
    if from_index:
        del index["weight_map"][victim]
        index_path.write_text(json.dumps(index))
    return shard


def _validate(server: Server, model: str, **sections: Any) -> tuple[int, list[str]]:
    spec = llm_spec(model={"path": model}, **sections)
    with server.client() as client:
        answer = client.post(
            "/v1/jobs/validate", content=yaml.safe_dump(spec, sort_keys=False),
            headers={"content-type": "application/yaml"},
        )  # fmt: skip
        assert client.get("/v1/jobs").json()["data"] == []
    problems = answer.json().get("error", {}).get("problems", [])
    return answer.status_code, [p["message"] for p in problems if p["path"] == "model.path"]


def test_a_tensor_cut_from_a_shard_is_a_422_naming_the_tensor_and_the_file(server: Server) -> None:
    shard = json.loads((server_models(server) / "llama" / "model.safetensors.index.json").read_text())["weight_map"][
        CUT
    ]
    status, messages = _validate(server, "cut", offload={"enable_model_cpu_offload": True})
    assert status == 422 and len(messages) == 1, messages
    assert messages[0].startswith(
        f"tensor '{CUT}' in {shard}: model.safetensors.index.json lists this tensor in {shard}, which does not "
        "hold it; fix: point model.path at a directory written by save_pretrained"
    )


def test_a_tensor_absent_from_every_shard_is_a_422_naming_the_index(server: Server) -> None:
    status, messages = _validate(server, "gone")
    assert status == 422
    assert [m.split("; fix:")[0] for m in messages] == [
        f"tensor '{GONE}' in model.safetensors.index.json: the model needs this tensor; the checkpoint does not "
        "have it (a missing or truncated shard, or a config.json of another model)"
    ]


def test_a_checkpoint_of_another_shape_is_a_422_naming_each_tensor(server: Server) -> None:
    status, messages = _validate(server, "wider")
    assert status == 422
    assert any(
        m.startswith("tensor 'model.layers.0.mlp.gate_proj.weight' in model-")
        and "shape [64, 32] where the model's model.layers.0.mlp.gate_proj.weight has [96, 32]" in m
        for m in messages
    ), messages


def test_a_whole_checkpoint_validates(server: Server) -> None:
    status, messages = _validate(server, "llama", offload={"enable_model_cpu_offload": True})
    assert status == 200, messages


def server_models(server: Server) -> Path:
    return Path(server.env["FERRY_MODEL_ROOTS"])
