"""Spec builders for the diffusion tests."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from jobs import JobSpec, PathRoots, load_job_spec

QWEN_TARGETS = [
    "to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj",
    "to_out.0", "to_add_out", "img_mlp.net.2", "img_mod.1", "txt_mlp.net.2", "txt_mod.1",
]  # fmt: skip
WAN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2"]


def cache_job(family: str = "qwen", **sections: Any) -> dict[str, Any]:
    data = {
        "name": f"{family}-cache",
        "device": "cpu",
        "task": "cache",
        "model": {"kind": "diffusers_transformer", "path": family, "dtype": "float32"},
        "data": {"kind": "image_caption", "path": "images", "max_pixels": 64 * 48},
        "cache": {"path": f"cache-{family}", "shard_samples": 3},
    }
    return _merged(data, sections)


def train_job(family: str = "qwen", **sections: Any) -> dict[str, Any]:
    data = {
        "name": f"{family}-lora",
        "device": "cpu",
        "model": {"kind": "diffusers_transformer", "path": family, "dtype": "float32"},
        "data": {"kind": "diffusion_cache", "path": f"cache-{family}"},
        "lora": {"target_modules": QWEN_TARGETS if family == "qwen" else WAN_TARGETS, "rank": 4},
        "training": {"steps": 4, "learning_rate": 1e-3, "gradient_checkpointing": True},
        "checkpoint": {"keep_last": 10},
    }
    return _merged(data, sections)


def _merged(data: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for key, value in sections.items():
        if value is None:
            data.pop(key, None)
        elif isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return data


def spec_from(data: dict[str, Any], roots: PathRoots) -> JobSpec:
    return load_job_spec(yaml.safe_dump(data), roots=roots)
