"""A GPU job estimated to exceed every GPU's memory is refused at submit, naming the setting that helps.

The server runs with a stand-in ``nvidia-smi`` on its PATH that reports one 2 GiB GPU, so the check is
exercised end to end on a machine without one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from jobs import load_job_spec
from jobs.fit.sizes import human_bytes
from jobs.models.registry import family_of
from service.api.errors import ApiError
from service.checking.fit import estimate_fit, refuse_if_it_cannot_fit
from service.workers.devices import GpuInfo, Slot
from tests.service.conftest import Server

# The seed's toy model: 10 x 4096² fp32 weights (0.67 GB), plus gradients and AdamW's two states on the GPU.
TOY_ON_GPU = """name: seed-toy
device: cuda
model: {kind: toy_mlp}
data: {kind: synthetic_regression}
training: {steps: 5, batch_size: 512}
"""
WITH_OFFLOAD = TOY_ON_GPU + "offload: {enable_model_cpu_offload: true, enable_optimizer_cpu_offload: true}\n"
GIB = 2**30


def fake_nvidia_smi(directory: Path, total_mib: int) -> Path:
    """An ``nvidia-smi`` that answers the service's one query with a single GPU of ``total_mib``."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho '0, Stand-in GPU, {total_mib}, 0'\n")
    script.chmod(0o755)
    return directory


def one_gpu(total_bytes: int) -> tuple[list[Slot], list[GpuInfo]]:
    return [Slot(id="gpu0", device="0")], [GpuInfo("0", "Stand-in GPU", total_bytes, 0)]


def test_refusal_lists_the_settings_that_lower_the_peak() -> None:
    spec = load_job_spec(TOY_ON_GPU)
    with pytest.raises(ApiError) as refused:
        refuse_if_it_cannot_fit(spec, estimate_fit(spec, *one_gpu(2 * GIB)), TOY_ON_GPU)
    assert refused.value.status_code == 422 and refused.value.code == "does_not_fit"
    where = [(p["path"], p["line"]) for p in refused.value.problems]
    assert where == [
        ("offload.enable_model_cpu_offload", None),
        ("training.gradient_checkpointing", 5),
        ("training.batch_size", 5),
    ]
    assert "?fit_check=false" in refused.value.message


def test_with_model_offload_on_the_next_setting_is_named_at_its_line() -> None:
    text = TOY_ON_GPU.replace("training: {steps: 5, batch_size: 512}", "training: {steps: 5, batch_size: 1}") + (
        "offload:\n  enable_model_cpu_offload: true\n  enable_optimizer_cpu_offload: false\n"
    )
    spec = load_job_spec(text)
    with pytest.raises(ApiError) as refused:  # a 0.1 GiB GPU: nothing this small fits even with model offload
        refuse_if_it_cannot_fit(spec, estimate_fit(spec, *one_gpu(GIB // 10)), text)
    where = [(p["path"], p["line"]) for p in refused.value.problems]
    assert where == [("offload.enable_optimizer_cpu_offload", 8), ("training.gradient_checkpointing", 5)]


@pytest.mark.parametrize(
    "text, gpu_bytes",
    [(WITH_OFFLOAD, 2 * GIB), (TOY_ON_GPU, 140 * GIB), (TOY_ON_GPU.replace("device: cuda", "device: cpu"), 2 * GIB)],
    ids=["offload-fits", "big-gpu", "cpu-job"],
)
def test_what_fits_or_runs_elsewhere_is_not_refused(text: str, gpu_bytes: int) -> None:
    spec = load_job_spec(text)
    refuse_if_it_cannot_fit(spec, estimate_fit(spec, *one_gpu(gpu_bytes)))


def test_unknown_gpu_sizes_never_refuse() -> None:
    spec = load_job_spec(TOY_ON_GPU)
    refuse_if_it_cannot_fit(spec, estimate_fit(spec, [Slot(id="gpu0", device="0")], []))


def test_submit_refuses_a_job_that_fits_no_gpu_and_queues_it_when_told(
    make_server: Callable[..., Server], tmp_path: Path
) -> None:
    fake_bin = fake_nvidia_smi(tmp_path / "bin", total_mib=2048)
    server = make_server(FERRY_DEVICES="auto", PATH=f"{fake_bin}:{os.environ['PATH']}", FERRY_WARM_START="false")
    with server.client() as client:
        assert [w["gpu_name"] for w in client.get("/v1/workers").json()["data"]] == ["Stand-in GPU"]
        refused = client.post("/v1/jobs", content=TOY_ON_GPU, headers={"Content-Type": "application/yaml"})
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["code"] == "does_not_fit" and "exceeds the largest GPU here (2.0 GiB)" in error["message"]
        # No offload section in the spec: the problems point at the lines of the sections they belong in.
        assert [(p["path"], p["line"]) for p in error["problems"]] == [
            ("offload.enable_model_cpu_offload", None),
            ("training.gradient_checkpointing", 5),
            ("training.batch_size", 5),
        ]
        assert client.get("/v1/jobs").json()["data"] == []

        forced = client.post(
            "/v1/jobs", params={"fit_check": "false"}, content=TOY_ON_GPU, headers={"Content-Type": "application/yaml"}
        )
        assert forced.status_code == 201, forced.text
        client.post(f"/v1/jobs/{forced.json()['id']}/cancel")


def test_the_limit_not_the_card_decides() -> None:
    text = TOY_ON_GPU + "offload: {gpu_memory_limit: 1GiB}\n"
    spec = load_job_spec(text)
    fit = estimate_fit(spec, *one_gpu(140 * GIB))
    assert fit.devices[0].memory_limit_bytes == GIB and fit.fits is False
    with pytest.raises(ApiError) as refused:
        refuse_if_it_cannot_fit(spec, fit, text)
    assert "exceeds offload.gpu_memory_limit (1GiB = 1.0 GiB; the largest GPU here has 140.0 GiB)" in (
        refused.value.message
    )
    assert refused.value.problems[-1]["path"] == "offload.gpu_memory_limit"
    assert refused.value.problems[-1]["line"] == 6
    # the same job on the whole card fits
    assert estimate_fit(load_job_spec(TOY_ON_GPU), *one_gpu(140 * GIB)).fits is True


def test_pinned_copies_beyond_the_host_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from jobs import PathRoots
    from service.checking import fit as fit_module

    class SmallHost:
        total = available = 2 * GIB

    monkeypatch.setattr(fit_module.psutil, "virtual_memory", lambda: SmallHost())
    (tmp_path / "data.txt").write_text("hello")
    text = """name: big
device: cuda
model: {kind: transformer_lm, hidden_size: 4096, num_layers: 8, num_heads: 32, dtype: bfloat16}
data: {kind: text, path: data.txt}
training: {steps: 1}
offload: {enable_model_cpu_offload: true, enable_optimizer_cpu_offload: true}
"""
    spec = load_job_spec(text, roots=PathRoots(model_roots=[tmp_path], data_roots=[tmp_path]))
    fit = estimate_fit(spec, *one_gpu(140 * GIB))
    assert fit.pinned_host_bytes > 2 * GIB
    with pytest.raises(ApiError) as refused:
        refuse_if_it_cannot_fit(spec, fit, text)
    assert refused.value.code == "does_not_fit"
    # The CPU optimizer's state (AdamW's two moments of the host masters) is held beside the pinned copies.
    weights = family_of(spec.model).meta_model(spec.model).to(torch.bfloat16).parameters()
    assert fit.optimizer_host_bytes == 2 * sum(p.numel() * p.element_size() for p in weights)
    needed = human_bytes(fit.pinned_host_bytes + fit.optimizer_host_bytes)
    assert (
        f"the job needs an estimated {needed} of host memory (pinned copies {human_bytes(fit.pinned_host_bytes)} + "
        f"CPU optimizer state {human_bytes(fit.optimizer_host_bytes)}) but this machine has 2.00 GiB"
    ) in refused.value.message
    assert refused.value.problems[0]["path"] == "model" and refused.value.problems[0]["line"] == 3
