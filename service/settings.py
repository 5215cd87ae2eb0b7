"""Service settings: the one place that reads the environment (prefix ``FERRY_``) and ``.env``."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Everything the service can be told, each field settable as ``FERRY_<NAME>``.

    Example:
        FERRY_DATA_DIR=/srv/ferry FERRY_API_TOKEN=s3cret FERRY_HOST=0.0.0.0 python -m service
    """

    model_config = SettingsConfigDict(env_prefix="FERRY_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    data_dir: Path = Path("ferry-data")
    api_token: SecretStr | None = None  # kept out of reprs and logs

    # "auto": one worker per visible GPU, or `cpu_workers` CPU workers when there is none.
    # "cpu": CPU workers only. "0,1": exactly those GPU indices.
    devices: str = "auto"
    cpu_workers: int = Field(1, ge=1, le=64)
    executor: str = "local"
    # Keep one spawned process per worker with torch and `jobs` already imported, so a job starts in about
    # a second instead of the import time; costs one idle process's host memory per worker (no GPU memory).
    warm_start: bool = True

    # Paths inside a spec (model weights, datasets) must resolve under one of these roots.
    # From the environment as a comma-separated list: FERRY_DATA_ROOTS=/srv/data,/mnt/datasets
    model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    data_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)

    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_yaml_depth: int = Field(32, ge=2)
    max_yaml_nodes: int = Field(20_000, ge=10)  # after alias expansion
    max_queued_jobs: int = Field(100, ge=1)
    max_retries: int = Field(3, ge=0)  # automatic requeues of an interrupted job
    cancel_grace_s: float = Field(3.0, ge=0)  # a cancelled job gets this long to stop before SIGKILL
    shutdown_grace_s: float = Field(15.0, ge=0)  # running jobs get this long to checkpoint on shutdown
    poll_interval_s: float = Field(0.2, gt=0)  # scheduler tick

    @field_validator("model_roots", "data_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _check_token_for_public_host(self) -> "Settings":
        if not is_loopback(self.host) and not self.api_token:
            raise ValueError(
                f"FERRY_HOST={self.host} is not a loopback address and no FERRY_API_TOKEN is set; "
                "set FERRY_API_TOKEN to a long random string, or bind FERRY_HOST=127.0.0.1"
            )
        return self

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str) -> str:
        if not re.fullmatch(r"\s*(auto|cpu|\d+(\s*,\s*\d+)*)\s*", value, flags=re.IGNORECASE):
            raise ValueError(f"FERRY_DEVICES={value!r} is not understood; use 'auto', 'cpu' or GPU indices like '0,1'")
        return value

    @model_validator(mode="after")
    def _check_executor(self) -> "Settings":
        if self.executor != "local":
            raise ValueError(f"FERRY_EXECUTOR={self.executor!r} is not known; use 'local'")
        return self

    @property
    def db_path(self) -> Path:
        return self.data_dir / "ferry.sqlite3"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    @property
    def effective_model_roots(self) -> list[Path]:
        """The configured model roots, or ``<data_dir>/models`` when none is."""
        return self.model_roots or [self.data_dir / "models"]

    @property
    def effective_data_roots(self) -> list[Path]:
        """The configured data roots, or ``<data_dir>/datasets`` when none is."""
        return self.data_roots or [self.data_dir / "datasets"]
