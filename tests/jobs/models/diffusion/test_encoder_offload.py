"""The frozen text encoder under model offload runs forward only: each encoding ends its engine step, so
prefetching starts after the first prompt and ``offload.gpu_memory_budget`` keeps units resident."""

from __future__ import annotations

import pytest
import torch

from jobs.models.diffusion.encode import Encoders
from tests.jobs.models.diffusion.helpers import cache_job, spec_from

pytestmark = pytest.mark.filterwarnings("ignore")


def test_the_offloaded_text_encoder_prefetches_and_keeps_its_budget(roots) -> None:
    spec = spec_from(cache_job(offload={"enable_model_cpu_offload": True, "gpu_memory_budget": "64KiB"}), roots)
    encoders = Encoders.load(spec, torch.device("cpu"), with_text=True, with_vae=False)
    plain = Encoders.load(spec_from(cache_job(), roots), torch.device("cpu"), with_text=True, with_vae=False)
    manager = encoders.manager
    assert manager is not None
    for prompt in ("a red square", "a blue circle"):
        got = encoders.encode_prompts([prompt])
        assert all(torch.equal(a, b) for a, b in zip(got, plain.encode_prompts([prompt]), strict=True))
    assert not manager._schedule.recording  # the first encoding fixed the order: prefetching is on
    assert 0 < manager.stats().device_bytes <= 64 * 1024  # the budget holds units between encodings
    encoders.close()
    plain.close()
