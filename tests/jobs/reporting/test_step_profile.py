"""``training.profile``: kernels and operators classed by name, the FLOPs formula, and the job's profile event (on
the CPU, over the CPU's operators: the same code as on a GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jobs import PathRoots, run_job
from jobs.events import event_to_wire
from jobs.reporting.step_profile import (
    CATEGORIES,
    StepProfiler,
    classify,
    peak_flops,
    seconds_by_class,
    training_flops,
)
from tests.jobs.helpers import merged, spec_from
from tests.jobs.models.test_hf_causal_lm import TINY_HF, save_tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore")

NAMES = {
    # GPU kernels (names as an H100 trace shows them)
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": "matmul",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)": "matmul",
    "triton_tem_fused_mm_0": "matmul",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(...)": "attention",
    "fmha_cutlassB_bf16_aligned_64x64_k128_sm80(...)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...AdamFunctor...>(...)": "optimizer",
    "void at::native::elementwise_kernel<128, 2, ...>(...)": "other",
    "triton_poi_fused_add_mul_rsqrt_0": "other",
    "Memcpy HtoD (Pinned -> Device)": "other",
    # CPU operators
    "aten::mm": "matmul",
    "aten::addmm": "matmul",
    "aten::bmm": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "Optimizer.step#AdamW.step": "optimizer",
    "aten::_foreach_mul_": "optimizer",
    "aten::_fused_adamw_": "optimizer",
    "aten::mul": "other",
    "aten::copy_": "other",
    "aten::mean": "other",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_kernels_and_operators_are_classed_by_name(name: str) -> None:
    assert classify(name) == NAMES[name]


def test_seconds_add_up_per_class() -> None:
    totals = seconds_by_class([("aten::mm", 2.0), ("aten::bmm", 1.0), ("flash_fwd", 0.5), ("aten::mul", 0.25)])
    assert totals == {"matmul": 3.0, "attention": 0.5, "copy_wait": 0.0, "optimizer": 0.0, "other": 0.25}


def test_the_flops_count_the_frozen_and_the_trainable_matmuls_and_causal_attention() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj"]))
    kv = 2 * 8  # two heads of 8
    frozen = 2 * (32 * 32 + 2 * 32 * kv + 32 * 32 + 3 * 32 * 64) + 32 * 100  # layers, then the LM head
    lora = 2 * (4 * 32 + 32 * 4)  # A and B of each layer's q_proj
    n, trainable = frozen + lora, lora
    tokens, seq_len = 3 * 16, 16
    assert training_flops(model, tokens, seq_len) == tokens * (4 * n + 2 * trainable) + tokens * 6 * 2 * 32 * seq_len
    full = nn.Linear(10, 10, bias=False)
    assert training_flops(full, 7, 7) == 7 * 6 * 100  # a full fine-tune: the usual 6·N·T, no attention


def test_the_cpu_has_no_peak_to_divide_by() -> None:
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None


def test_the_profiler_reports_shares_of_the_profiled_steps() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    profiler = StepProfiler.over_steps(0, 6, device=torch.device("cpu"), flops=lambda t: 6 * 32_768 * t, peak=None)
    assert (profiler.first, profiler.last) == (3, 4)
    reports = []
    for step in range(1, 7):
        profiler.before_step(step)
        x = torch.randn(128, 64)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        reports.append(profiler.after_step(step, tokens=128))
    report = next(r for r in reports if r is not None)
    assert [i for i, r in enumerate(reports, 1) if r is not None] == [4]
    assert report.steps == [3, 4] and report.flops_per_step == 6 * 32_768 * 128
    assert sorted(report.shares) == sorted(CATEGORIES)
    assert sum(report.shares.values()) == pytest.approx(1.0)
    assert report.shares["matmul"] > 0 and report.shares["optimizer"] > 0 and report.shares["attention"] == 0
    assert report.mfu is None and report.achieved_flops > 0


@pytest.mark.parametrize(
    ("done", "total", "steps"), [(0, 10, (3, 4)), (0, 3, (2, 3)), (0, 2, (1, 2)), (0, 1, (1, 1)), (5, 7, (6, 7))]
)
def test_the_profiled_steps_follow_the_first_two(done: int, total: int, steps: tuple[int, int]) -> None:
    profiler = StepProfiler.over_steps(done, total, device=torch.device("cpu"), flops=lambda t: 0, peak=None)
    assert (profiler.first, profiler.last) == steps


def test_a_profiled_job_reports_where_its_steps_went(tmp_path: Path, roots: PathRoots) -> None:
    save_tiny_llama(roots.model_roots[0] / "tiny-llama")
    events: list[dict[str, Any]] = []
    spec = spec_from(merged(TINY_HF, training={"profile": True}), roots)
    run_job(spec, output_dir=tmp_path / "out", report=lambda e: events.append(event_to_wire(e)))
    messages = [e["message"] for e in events if e["type"] == "log" and e["message"].startswith("profile")]
    assert len(messages) == 1
    message = messages[0]
    assert message.startswith("profile of step 3-4 on cpu: ")
    for label in ("matmul", "attention", "copy wait", "optimizer", "other"):
        assert f" {label} " in message
    assert "TFLOP/s" in message and "MFU" not in message  # no peak for a CPU
    assert message.endswith("(FLOPs = T·(4·N + 2·N_trainable) + 6·L·d·S·T)")
    steps = [i for i, e in enumerate(events) if e["type"] == "step"]
    profiled = next(i for i, e in enumerate(events) if e.get("message") == message)
    assert steps[3] < profiled < events.index(next(e for e in events if e["type"] == "finished"))  # after step 4
    print(message)


@pytest.mark.gpu
def test_on_the_gpu_the_kernels_are_classed_and_the_mfu_has_a_peak() -> None:
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(device, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    n = 2 * 1024 * 4096
    peak = peak_flops(device, torch.bfloat16)
    profiler = StepProfiler(device=device, first=2, last=3, flops=lambda t: 6 * n * t, peak=peak)
    report = None
    for step in range(1, 4):
        profiler.before_step(step)
        x = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        report = profiler.after_step(step, tokens=4096) or report
    assert report is not None
    assert report.shares["matmul"] > 0.05 and report.shares["optimizer"] > 0
    if any(name in torch.cuda.get_device_name() for name in ("H100", "H200", "A100")):
        assert report.mfu is not None and 0 < report.mfu < 1
