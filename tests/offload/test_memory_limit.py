"""offload.gpu_memory_limit: validated as an option, enforced through the caching allocator's fraction.

CI has no GPU: the CUDA edge (device size, the fraction setter) is patched; the arithmetic and the refusals
are the real code. The enforcement itself is checked on the GPU by ``test_gpu_memory.py``.
"""

from __future__ import annotations

import pytest
import torch

from offload import OffloadOptions, set_gpu_memory_limit
from offload import devices as devices_module

GIB = 2**30


def test_limit_option_is_validated() -> None:
    assert OffloadOptions(gpu_memory_limit="24GiB").gpu_memory_limit == 24 * GIB
    with pytest.raises(ValueError, match="gpu_memory_limit must be a byte count"):
        OffloadOptions(gpu_memory_limit="small")
    with pytest.raises(ValueError, match="gpu_memory_limit must be a positive size"):
        OffloadOptions(gpu_memory_limit=0)
    with pytest.raises(ValueError, match="gpu_memory_budget .* must be below gpu_memory_limit"):
        OffloadOptions(gpu_memory_budget="8GiB", gpu_memory_limit="8GiB")


def test_limit_means_nothing_on_the_cpu() -> None:
    assert set_gpu_memory_limit(torch.device("cpu"), 24 * GIB) is None


@pytest.fixture
def fake_card(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A 140 GiB "GPU": its size is reported, the fractions the code sets are recorded."""
    fractions: list[float] = []

    def set_fraction(fraction: float, device: torch.device | int) -> None:
        # torch refuses a device without an index ("Expected a torch.device with a specified index")
        assert isinstance(device, int) or device.index is not None
        fractions.append(fraction)

    monkeypatch.setattr(devices_module, "device_memory_bytes", lambda device: 140 * GIB)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    return fractions


def test_limit_sets_the_fraction_of_the_card(fake_card: list[float]) -> None:
    assert set_gpu_memory_limit(torch.device("cuda"), 24 * GIB) == 24 * GIB  # accelerate's device: no index
    assert fake_card == [pytest.approx(24 / 140)]
    set_gpu_memory_limit(torch.device("cuda", 0), None)
    assert fake_card[-1] == 1.0


def test_limit_beyond_the_card_is_refused(fake_card: list[float]) -> None:
    with pytest.raises(ValueError, match=r"offload.gpu_memory_limit \(200.00 GiB\) exceeds cuda:0's memory"):
        set_gpu_memory_limit(torch.device("cuda", 0), 200 * GIB, name="offload.gpu_memory_limit")
    assert fake_card == []


def test_a_device_without_an_index_means_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.set_per_process_memory_fraction refuses torch.device("cuda") (the H200 run of
    # bench/diffusion_bench.py failed so); resolve_device and accelerate hand out that name.
    calls: list[tuple[float, object]] = []
    monkeypatch.setattr(devices_module, "device_memory_bytes", lambda device: 140 * GIB)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: calls.append((f, device)))
    set_gpu_memory_limit(torch.device("cuda"), 28 * GIB)
    set_gpu_memory_limit(torch.device("cuda"), None)
    assert calls == [(pytest.approx(0.2), 3), (1.0, 3)]
