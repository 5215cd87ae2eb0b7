"""The fit check sizes a DiT job from its config alone: weights from the meta model, tokens from the data."""

from __future__ import annotations

import pytest

from jobs import estimate_memory
from tests.jobs.models.diffusion.helpers import spec_from, train_job

pytestmark = pytest.mark.filterwarnings("ignore")


def test_the_estimate_grows_with_the_pixel_budget_and_shrinks_with_checkpointing(roots) -> None:
    def peak(max_pixels: int, checkpointing: bool) -> int:
        data = {"kind": "image_caption", "path": "images", "max_pixels": max_pixels}
        job = train_job(data=data, training={"steps": 2, "gradient_checkpointing": checkpointing}, device="cuda")
        return estimate_memory(
            spec_from({**job, "offload": {"enable_model_cpu_offload": True}}, roots)
        ).peak_device_bytes

    assert peak(64 * 48, True) < peak(128 * 96, True) < peak(128 * 96, False)


def test_the_modulation_table_takes_its_layers_off_the_device_estimate(roots) -> None:
    """A third of Qwen-Image's DiT never reaches the device with the table: the fit check sizes what streams."""
    from jobs.fit.estimate import _shapes_only_model

    data = {"kind": "image_caption", "path": "images", "max_pixels": 64 * 48}

    def estimate(precompute: bool):
        job = train_job(data=data, model={"precompute_modulation": precompute}, device="cuda")
        return estimate_memory(spec_from({**job, "offload": {"enable_model_cpu_offload": True}}, roots))

    model = _shapes_only_model(spec_from(train_job(data=data), roots))
    modulation = sum(p.nbytes for n, p in model.named_parameters() if "_mod.1." in n)
    tabled, streamed = estimate(True), estimate(False)
    assert any("precomputed once and kept on the host" in note for note in tabled.notes)
    # Every modulation byte leaves the pinned copies; the device's ring slots shrink with the blocks.
    assert streamed.pinned_host_bytes - tabled.pinned_host_bytes >= modulation
    assert tabled.peak_device_bytes < streamed.peak_device_bytes
