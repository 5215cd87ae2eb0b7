"""Tiny Qwen-Image, Wan, Flux.1 and Flux.2 pipelines (built once per session) and a fresh image folder per test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from jobs import PathRoots
from tests.jobs.models.diffusion.flux_pipelines import flux1_pipeline, flux2_pipeline
from tests.jobs.models.diffusion.pipelines import image_folder, qwen_image_pipeline, wan_pipeline

SIZES = [(64, 48), (64, 48), (48, 64), (48, 64)]


@pytest.fixture(scope="session")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipelines")
    qwen_image_pipeline(root / "qwen")
    wan_pipeline(root / "wan")
    return root


@pytest.fixture
def roots(tmp_path: Path, pipelines: Path) -> PathRoots:
    """Model root: a per-test copy of the pipelines (tests may break them); data root with ``images/``."""
    models = tmp_path / "models"
    shutil.copytree(pipelines, models)
    image_folder(tmp_path / "data" / "images", SIZES)
    return PathRoots(model_roots=[models], data_roots=[tmp_path / "data"])


@pytest.fixture(scope="session")
def flux_pipelines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("flux")
    flux1_pipeline(root / "flux1")
    flux2_pipeline(root / "flux2")
    return root


@pytest.fixture
def flux_roots(tmp_path: Path, flux_pipelines: Path) -> PathRoots:
    """Model root: a per-test copy of tiny Flux.1 and Flux.2 pipelines; data root with ``images/``."""
    shutil.copytree(flux_pipelines, tmp_path / "models")
    image_folder(tmp_path / "data" / "images", SIZES)
    return PathRoots(model_roots=[tmp_path / "models"], data_roots=[tmp_path / "data"])
