"""The fit check sizes a DiT job from its config alone: weights from the meta model, tokens from the data."""

from __future__ import annotations

import pytest

from jobs import estimate_memory
from tests.jobs.diffusion.helpers import spec_from, train_job

pytestmark = pytest.mark.filterwarnings("ignore")


def test_the_estimate_grows_with_the_pixel_budget_and_shrinks_with_checkpointing(roots) -> None:
    def peak(max_pixels: int, checkpointing: bool) -> int:
        data = {"kind": "image_caption", "path": "images", "max_pixels": max_pixels}
        job = train_job(data=data, training={"steps": 2, "gradient_checkpointing": checkpointing}, device="cuda")
        return estimate_memory(
            spec_from({**job, "offload": {"enable_model_cpu_offload": True}}, roots)
        ).peak_device_bytes

    assert peak(64 * 48, True) < peak(128 * 96, True) < peak(128 * 96, False)
