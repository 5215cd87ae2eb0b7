"""What the VLM family's tests share: the two tiny architectures saved once (``save_pretrained``, processor beside)
and the solid-colour task's images and rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jobs.vlm_helpers import COLOURS, TINY_VLMS, colour_record, solid_png, write_jsonl


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with one model folder per entry of ``TINY_VLMS`` (``qwen``, ``idefics``); read it, never write it."""
    root = tmp_path_factory.mktemp("tiny-vlms")
    for name, save in TINY_VLMS.items():
        save(root / name)
    return root


@pytest.fixture(scope="module")
def colours(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``train.jsonl`` of the colour task: one row per colour, its image a solid PNG beside it."""
    folder = tmp_path_factory.mktemp("colours")
    for colour in COLOURS:
        solid_png(folder / f"{colour}.png", colour)
    return write_jsonl(folder / "train.jsonl", [colour_record(f"{c}.png", c) for c in COLOURS])
