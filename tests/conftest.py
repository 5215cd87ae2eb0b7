"""Shared pytest setup: the `gpu` marker skips its tests when CUDA is absent."""

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; run `pytest -m gpu` on a GPU box")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
