"""estimate_memory: a fit check from shapes alone."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from jobs import PathRoots, estimate_memory, load_job_spec, run_job
from jobs.events import JobEvent, StepEvent, event_to_wire
from offload.arena import aligned
from tests.jobs.helpers import TOY, merged, spec_from, write_corpus

CONFIGS = Path(__file__).parents[3] / "configs"
BIG_TOY = merged(TOY, model={"hidden_size": 1024, "num_layers": 4}, training={"batch_size": 64})
MODEL_ONLY = {"enable_model_cpu_offload": True}
BOTH = {"enable_model_cpu_offload": True, "enable_optimizer_cpu_offload": True}


def test_offloading_lowers_the_device_estimate() -> None:
    plain = estimate_memory(spec_from(BIG_TOY))
    both = estimate_memory(spec_from(merged(BIG_TOY, offload=BOTH)))
    assert plain.pinned_host_bytes == 0
    assert both.peak_device_bytes < plain.peak_device_bytes / 3
    assert both.pinned_host_bytes >= 2 * 4 * 4 * 1024 * 1024  # weights and their host gradient buffers
    assert any("optimizer offload" in note for note in both.notes)


def test_an_auto_budget_is_estimated_as_the_streamed_peak_and_says_so() -> None:
    streamed = estimate_memory(spec_from(merged(BIG_TOY, offload=BOTH)))
    auto = estimate_memory(spec_from(merged(BIG_TOY, offload={**BOTH, "gpu_memory_budget": "auto"})))
    fixed = estimate_memory(spec_from(merged(BIG_TOY, offload={**BOTH, "gpu_memory_budget": "8MiB"})))
    assert auto.peak_device_bytes == streamed.peak_device_bytes < fixed.peak_device_bytes
    assert any("gpu_memory_budget auto -> 0 B resident" in note for note in auto.notes)


def test_lora_keeps_only_adapters_and_their_state_on_the_device(roots: PathRoots) -> None:
    lm = {
        "name": "lm",
        "model": {"kind": "transformer_lm", "hidden_size": 256, "num_layers": 4, "num_heads": 4, "vocab_size": 512},
        "data": {"kind": "text", "path": "corpus", "seq_len": 64},
        "training": {"steps": 1},
        "lora": {"target_modules": ["to_q", "to_v"], "rank": 8},
    }
    full = estimate_memory(spec_from({k: v for k, v in lm.items() if k != "lora"}, roots))
    lora = estimate_memory(spec_from(lm, roots))
    lora_offloaded = estimate_memory(spec_from(merged(lm, offload=MODEL_ONLY), roots))
    assert lora_offloaded.peak_device_bytes < lora.peak_device_bytes < full.peak_device_bytes
    weights = sum(p.numel() * 4 for p in _meta_lm(lm).parameters())
    assert weights <= lora_offloaded.pinned_host_bytes <= 2 * weights


def _meta_lm(data: dict[str, Any]) -> torch.nn.Module:
    from jobs.models.names import meta_model
    from jobs.models.transformer_lm import TransformerLMSpec

    return meta_model(TransformerLMSpec(**data["model"]))


def test_a_budget_with_optimizer_offload_keeps_the_first_trainables_on_the_device(tmp_path: Path) -> None:
    """The estimate plans it as the engine does: fewer host copies (the arena matches a real step's), and a
    note that says what the budget keeps with its optimizer on the device."""
    events: list[JobEvent] = []
    data = merged(BIG_TOY, offload={**BOTH, "gpu_memory_budget": "32MiB"}, training={"steps": 1})
    estimate = estimate_memory(spec_from(data))
    assert estimate.pinned_host_bytes < estimate_memory(spec_from(merged(BIG_TOY, offload=BOTH))).pinned_host_bytes
    assert any("kept on the device with their gradients and optimizer state" in note for note in estimate.notes)
    run_job(spec_from(data), output_dir=tmp_path, report=events.append)
    assert next(e for e in events if isinstance(e, StepEvent)).pinned_bytes == estimate.pinned_host_bytes


def test_pinned_estimate_matches_the_engine_arena(tmp_path: Path) -> None:
    events: list[JobEvent] = []
    data = merged(BIG_TOY, offload=BOTH, training={"steps": 1})
    run_job(spec_from(data), output_dir=tmp_path, report=events.append)
    measured = next(e for e in events if isinstance(e, StepEvent)).pinned_bytes
    assert estimate_memory(spec_from(data)).pinned_host_bytes == measured


def test_ranks_that_split_the_optimizer_are_estimated_with_half_its_state_each(tmp_path: Path) -> None:
    """Two ranks with optimizer offload: each holds half of AdamW's state (the estimate's figure is what each
    rank's own state tensors take, less AdamW's step counts), and the machine's pinned memory is rank 0's arena,
    as measured, plus rank 1's masters and half-size gradient buffers."""
    data = merged(TOY, model={"hidden_size": 96}, offload=BOTH, training={"steps": 1, "batch_size": 4})
    one = estimate_memory(spec_from(data))
    two = estimate_memory(spec_from(merged(data, distributed={"world_size": 2}, training={"batch_size": 2})))
    weights = 3 * (96 * 96 + 96)  # toy_mlp: three Linear(96, 96)
    assert one.optimizer_host_bytes == 2 * 4 * weights and (one.ranks, two.ranks) == (1, 2)
    assert two.optimizer_host_bytes == one.optimizer_host_bytes // 2
    assert two.host_bytes == two.pinned_host_bytes + 2 * two.optimizer_host_bytes
    assert any("its 1/2 part on each of 2 ranks" in note for note in two.notes)

    events: list[dict[str, Any]] = []
    spec = spec_from(merged(data, distributed={"world_size": 2}, training={"batch_size": 2}))
    run_job(spec, output_dir=tmp_path, report=lambda e: events.append(event_to_wire(e)))
    step = next(e for e in events if e["type"] == "step")
    counts = 4 * 2 * 3  # a float32 step count per weight and bias
    assert [r["optimizer_host_bytes"] - counts for r in step["ranks"]] == [two.optimizer_host_bytes] * 2
    own = 3 * sum(aligned(4 * n) + aligned(4 * n // 2) for n in (96 * 96, 96))  # rank 1: masters, half gradients
    assert two.pinned_host_bytes == step["pinned_bytes"] + own


def test_hf_model_is_estimated_from_its_config_alone(roots: PathRoots) -> None:
    from transformers import LlamaConfig

    directory = roots.model_roots[0] / "config-only"
    LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    ).save_pretrained(directory)
    assert {p.name for p in directory.iterdir()} == {"config.json"}  # no weights to load
    spec = spec_from(
        {
            "name": "hf",
            "model": {"kind": "hf_causal_lm", "path": "config-only"},
            "data": {"kind": "text", "path": "corpus", "seq_len": 32},
            "training": {"steps": 1},
        },
        roots,
    )
    assert estimate_memory(spec).peak_device_bytes > 300 * 64 * 2


def test_a_multi_billion_model_is_estimated_without_memory(tmp_path: Path) -> None:
    write_corpus(tmp_path / "example_dataset")
    text = (CONFIGS / "transformer_lm-7b_lora_model-offload.yaml").read_text()
    spec = load_job_spec(text, roots=PathRoots(model_roots=[tmp_path], data_roots=[tmp_path]))
    before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    estimate = estimate_memory(spec)
    assert time.perf_counter() - started < 20
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500 * 1024  # KiB: far below 12 GiB
    assert 12 * 2**30 < estimate.pinned_host_bytes < 20 * 2**30  # 12.5 GiB of weights + arena rounding
    assert estimate.peak_device_bytes < 12 * 2**30


def gpu_configs() -> list[Path]:
    return [
        p
        for p in sorted(CONFIGS.glob("*.yaml"))
        if yaml.safe_load(p.read_text()).get("device") == "cuda"
        # These read a model (or pipeline) directory that only a user has; the test builds none.
        and yaml.safe_load(p.read_text())["model"]["kind"] not in ("hf_causal_lm", "diffusers_transformer")
    ]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("config", gpu_configs(), ids=lambda p: p.stem)
def test_estimate_is_within_25_percent_of_the_measured_peak(config: Path, tmp_path: Path) -> None:
    write_corpus(tmp_path / "example_dataset", documents=4000)
    data = yaml.safe_load(config.read_text())
    if data["data"]["kind"] == "text":  # a dependency of Ferry's, which a GPU box with torch alone may lack
        pytest.importorskip("datasets", reason="text data is read with Hugging Face datasets")
    data["training"].pop("epochs", None)
    data["training"].update(steps=3)
    data["training"]["scheduler"] = {"kind": "constant", "warmup_steps": 0}
    data["checkpoint"] = {"save_final": False}
    if data.get("offload", {}).get("enable_model_cpu_offload"):  # the streamed peak: auto fills what it leaves
        data["offload"].setdefault("gpu_memory_budget", None)
    spec = load_job_spec(yaml.safe_dump(data), roots=PathRoots(model_roots=[tmp_path], data_roots=[tmp_path]))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run_job(spec, output_dir=tmp_path / "out")
    measured = torch.cuda.max_memory_allocated()
    estimate = estimate_memory(spec)
    record = {
        "config": config.name,
        "measured": measured,
        "estimated": estimate.peak_device_bytes,
        "ratio": estimate.peak_device_bytes / measured,
        "notes": estimate.notes,
    }
    print(json.dumps(record))
    assert abs(estimate.peak_device_bytes - measured) <= 0.25 * measured, record


def tiny_lm(hidden_size: int) -> dict:
    """A one-step job of a two-layer transformer_lm on the ``corpus`` text files."""
    model = {"kind": "transformer_lm", "hidden_size": hidden_size, "num_layers": 2, "num_heads": 4, "vocab_size": 300}
    return {
        "name": "lm",
        "device": "cpu",
        "data": {"kind": "text", "path": "corpus", "seq_len": 16},
        "model": model,
        "training": {"steps": 1, "batch_size": 2},
    }


@pytest.mark.parametrize(
    "offload",
    [
        {**BOTH, "granularity": "block"},
        {**BOTH, "cpu_offload_split_threshold": 2},
        {**MODEL_ONLY, "granularity": "block"},
    ],
    ids=["block", "threshold", "lm-block"],
)
def test_pinned_estimate_matches_the_engine_arena_for_other_cuts(
    tmp_path: Path, roots: PathRoots, offload: dict
) -> None:
    lm = tiny_lm(hidden_size=64)
    if offload.get("enable_optimizer_cpu_offload") is None:
        lm["lora"] = {"target_modules": ["to_q"], "rank": 2}
    events: list[JobEvent] = []
    run_job(spec_from(merged(lm, offload=offload), roots), output_dir=tmp_path, report=events.append)
    measured = next(e for e in events if isinstance(e, StepEvent)).pinned_bytes
    assert estimate_memory(spec_from(merged(lm, offload=offload), roots)).pinned_host_bytes == measured


@pytest.mark.parametrize(
    ("quantize", "arrival"), [("nf4", True), ("nf4", False), ("int8", True)], ids=["nf4", "nf4-in-layer", "int8"]
)
def test_estimate_plans_a_quantized_base_as_the_engine_does(
    tmp_path: Path, roots: PathRoots, quantize: str, arrival: bool
) -> None:
    # NF4 weights are dequantized on arrival into rooms beside their ring slots, which the ring counts
    # (offload.dequantize_on_arrival: false: no rooms); both methods store (and stream) fewer bytes than the
    # meta model's bf16 weights have.
    pytest.importorskip("torchao")
    offload = {**MODEL_ONLY, "dequantize_on_arrival": arrival}
    lm = {**tiny_lm(hidden_size=128), "lora": {"target_modules": ["to_q"], "rank": 2}, "offload": offload}
    data = merged(lm, model={"quantize": quantize})
    events: list[JobEvent] = []
    run_job(spec_from(data, roots), output_dir=tmp_path, report=events.append)
    step = next(e for e in events if isinstance(e, StepEvent))
    estimate = estimate_memory(spec_from(data, roots))
    assert estimate.device_ring_bytes == step.offload.planned_device_bytes
    assert estimate.pinned_host_bytes == step.pinned_bytes
    unquantized = estimate_memory(spec_from(lm, roots))
    assert estimate.pinned_host_bytes < unquantized.pinned_host_bytes
    if quantize == "nf4":
        other = estimate_memory(spec_from(merged(data, offload={"dequantize_on_arrival": not arrival}), roots))
        rooms = other.device_ring_bytes - estimate.device_ring_bytes
        assert (rooms > 0) == (not arrival)  # the rooms are planned only when dequantizing on arrival


@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_estimate_uses_the_engines_device_plan(tmp_path: Path, granularity: str) -> None:
    events: list[JobEvent] = []
    data = merged(BIG_TOY, offload={**BOTH, "granularity": granularity}, training={"steps": 1})
    run_job(spec_from(data), output_dir=tmp_path, report=events.append)
    planned = next(e for e in events if isinstance(e, StepEvent)).offload.planned_device_bytes
    assert planned > 0 and estimate_memory(spec_from(data)).device_ring_bytes == planned
