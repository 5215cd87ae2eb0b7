"""The Dockerfile and docker-compose.yml stay consistent with the project (no Docker engine runs in CI)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
README = (ROOT / "README.md").read_text()


def service() -> dict:
    return COMPOSE["services"]["ferry"]


def test_compose_parses_and_asks_for_all_gpus_a_volume_and_a_restart_policy() -> None:
    devices = service()["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "ferry-data:/data" in service()["volumes"] and "ferry-data" in COMPOSE["volumes"]
    assert service()["restart"] == "unless-stopped"
    assert service()["build"] == "."


def test_compose_requires_the_api_token() -> None:
    token = service()["environment"]["FERRY_API_TOKEN"]
    assert re.fullmatch(r"\$\{FERRY_API_TOKEN:\?.+\}", token), token


def image_extras() -> set[str]:
    """The extras the image's one ``pip install -e ".[a,b]"`` installs."""
    installs = re.findall(r"pip install -e \"?\.(?:\[([\w,-]*)\])?\"?", DOCKERFILE)
    assert len(installs) == 1, installs
    return {extra for extra in installs[0].split(",") if extra}


def extras_needed(config: dict) -> set[str]:
    """The pyproject extras a job spec needs beyond Ferry's own dependencies."""
    model, data, tracking = config.get("model", {}), config.get("data", {}), config.get("tracking") or {}
    needed = set()
    if model.get("kind") == "diffusers_transformer":
        needed.add("diffusion")
    if model.get("quantize"):
        needed.add("quantize")
    if data.get("num_frames"):  # video data: .mp4 files are read with imageio
        needed.add("video")
    needed |= {tracker for tracker in ("mlflow", "wandb") if tracking.get(tracker)}
    return needed


def test_dockerfile_installs_as_the_readme_does() -> None:
    assert re.search(r"^ && pip install -e \"\.\[[\w,-]+\]\"$", DOCKERFILE, flags=re.M)
    assert "pip install -e ." in README


def test_the_image_has_every_extra_a_shipped_config_needs() -> None:
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert image_extras() <= declared
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    missing = {path.name: sorted(extras_needed(yaml.safe_load(path.read_text())) - image_extras()) for path in configs}
    assert {name: extras for name, extras in missing.items() if extras} == {}


def test_the_extras_check_sees_what_a_config_needs() -> None:
    assert extras_needed({"model": {"kind": "toy_mlp"}, "data": {"kind": "synthetic_regression"}}) == set()
    assert extras_needed(
        {
            "model": {"kind": "diffusers_transformer", "quantize": "nf4"},
            "data": {"num_frames": 33},
            "tracking": {"mlflow": {"experiment": "x"}, "wandb": None},
        }
    ) == {"diffusion", "quantize", "video", "mlflow"}


def test_dockerfile_runs_the_service_as_a_non_root_user_with_a_data_volume() -> None:
    assert 'ENTRYPOINT ["python", "-m", "service"]' in DOCKERFILE
    assert re.search(r"^USER ferry$", DOCKERFILE, flags=re.M)
    assert 'VOLUME ["/data"]' in DOCKERFILE and "FERRY_DATA_DIR=/data" in DOCKERFILE
    # Dependencies are installed before the sources are copied, so code changes reuse that layer.
    assert DOCKERFILE.index("pip install -e ") < DOCKERFILE.index("COPY service/ service/")


def test_port_and_health_path_exist_in_the_app(tmp_path: Path) -> None:
    from service.api.app import create_app
    from service.settings import Settings

    exposed = re.search(r"^EXPOSE (\d+)$", DOCKERFILE, flags=re.M).group(1)
    assert f"FERRY_PORT={exposed}" in DOCKERFILE
    assert service()["ports"] == [f"${{FERRY_PORT:-8000}}:{exposed}"]
    assert Settings().port == int(exposed)
    health = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", DOCKERFILE)
    assert health.group(1) == exposed
    assert health.group(2) in service()["healthcheck"]["test"][-1]
    paths = create_app(Settings(data_dir=tmp_path)).openapi()["paths"]
    assert "get" in paths[health.group(2)]


def test_image_carries_the_dashboard_charts_from_the_lock_file() -> None:
    assert "COPY service/dashboard/package.json service/dashboard/package-lock.json ./" in DOCKERFILE
    assert "RUN npm ci" in DOCKERFILE
    assert "COPY --from=charts /charts/node_modules service/dashboard/node_modules" in DOCKERFILE
    assert (ROOT / "service/dashboard/package-lock.json").exists()
