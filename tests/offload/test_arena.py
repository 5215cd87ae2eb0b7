"""PinnedArenaPool: tight packing of many odd-sized tensors against per-tensor power-of-two rounding."""

from __future__ import annotations

import itertools

import torch

from offload import PinnedArenaPool
from offload.arena import ALIGNMENT, MAX_CHUNK_BYTES, _next_pow2


def odd_sizes(count: int = 300) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    return [int(n) for n in torch.randint(1_000, 3_000_000, (count,), generator=generator)]


def test_reserve_stays_within_one_chunk_of_the_request_and_beats_per_tensor_rounding(capsys) -> None:
    numels = sorted(odd_sizes(), reverse=True)
    tensors = [torch.empty(n, dtype=torch.float16) for n in numels]
    pool = PinnedArenaPool.for_tensors(tensors, pin=False)
    views = [pool.allocate(t.shape, t.dtype) for t in tensors]
    requested = pool.requested_bytes
    per_tensor = sum(_next_pow2(n * 2) for n in numels)
    largest_chunk = max(c.capacity for c in pool._chunks)
    with capsys.disabled():
        print(
            f"\narena: requested {requested / 2**20:.1f} MiB, reserved {pool.reserved_bytes / 2**20:.1f} MiB "
            f"in {len(pool._chunks)} chunks; per-tensor power-of-two pinning {per_tensor / 2**20:.1f} MiB"
        )
    assert requested == sum(n * 2 for n in numels)
    assert pool.reserved_bytes - requested <= largest_chunk
    assert pool.reserved_bytes - requested < (per_tensor - requested) / 4
    assert all(c.capacity & (c.capacity - 1) == 0 and c.capacity <= MAX_CHUNK_BYTES for c in pool._chunks)
    # Views are 64-byte aligned, never overlap, and keep their values.
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * 2) for v in views)
    assert all(start % ALIGNMENT == 0 for start, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    for i, view in enumerate(views):
        view.fill_(i % 100)
    assert all(float(v[0]) == i % 100 and float(v[-1]) == i % 100 for i, v in enumerate(views))


def test_pool_grows_beyond_its_plan() -> None:
    pool = PinnedArenaPool(expected_bytes=1024, pin=False)
    small = pool.allocate((16,), torch.float32)
    big = pool.allocate((1 << 18,), torch.float32)  # 1 MiB: more than planned
    assert small.shape == (16,) and big.shape == (1 << 18,)
    assert len(pool._chunks) == 2 and pool.fallback_bytes == 0


def test_pool_falls_back_to_per_tensor_memory_when_a_chunk_cannot_be_had(monkeypatch) -> None:
    from offload import arena

    def refuse(*args, **kwargs):
        raise RuntimeError("cudaErrorMemoryAllocation")

    monkeypatch.setattr(arena, "ArenaChunk", refuse)
    pool = PinnedArenaPool(expected_bytes=4096, pin=False)
    tensor = pool.allocate((4, 4), torch.bfloat16)
    assert tensor.shape == (4, 4) and tensor.dtype == torch.bfloat16
    assert pool.fallback_bytes == 32 and pool.reserved_bytes == 32


def test_odd_dtypes_and_scalars() -> None:
    pool = PinnedArenaPool(expected_bytes=256, pin=False)
    for dtype in (torch.bool, torch.int64, torch.bfloat16, torch.float64):
        t = pool.allocate((), dtype)
        assert t.shape == () and t.dtype == dtype and t.data_ptr() % ALIGNMENT == 0
