"""bench/swap_io_rate.py runs its rounds in both modes and says how much of the swap files the page cache holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import swap_io_rate
from tests.offload.test_direct_io import direct_reads_work


def test_both_modes_run_their_rounds_and_direct_leaves_the_files_out_of_the_page_cache(tmp_path: Path) -> None:
    if not direct_reads_work(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    direct = swap_io_rate.measure("direct", tmp_path, params=3, numel=1 << 16, rounds=2)
    buffered = swap_io_rate.measure("buffered", tmp_path, params=3, numel=1 << 16, rounds=2)
    assert "O_DIRECT=True " in direct and "O_DIRECT=False" in buffered
    if swap_io_rate.cached_bytes([]) is not None:
        assert direct.endswith("page cache 0 MiB")
    assert not list(tmp_path.iterdir()) or all(not any(p.iterdir()) for p in tmp_path.iterdir() if p.is_dir())
