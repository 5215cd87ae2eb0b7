"""Fixtures for the jobs tests: roots in tmp_path with a small text corpus in the data root."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobs import PathRoots
from tests.jobs.helpers import write_corpus


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread() -> None:
    """Tiny models run faster on one thread, and the suite shares a small CPU with other work."""
    torch.set_num_threads(1)


@pytest.fixture
def roots(tmp_path: Path) -> PathRoots:
    """Model root ``tmp_path/models`` and data root ``tmp_path/data`` holding ``corpus/``."""
    (tmp_path / "models").mkdir()
    write_corpus(tmp_path / "data" / "corpus")
    return PathRoots(model_roots=[tmp_path / "models"], data_roots=[tmp_path / "data"])
