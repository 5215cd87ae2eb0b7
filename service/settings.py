"""Service settings: the one place that reads the environment (prefix ``FERRY_``) and ``.env``."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from jobs.paths import DEFAULT_STORAGE_DIR, default_data_roots, default_model_roots  # stdlib only: no torch

MIN_TOKEN_LENGTH = 16  # for a token that serves other machines (service/api/access.py enforces it per request)


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
    data_dir: Path = DEFAULT_STORAGE_DIR
    api_token: SecretStr | None = None  # kept out of reprs and logs

    # "auto": one worker per visible GPU, or `cpu_workers` CPU workers when there is none.
    # "cpu": CPU workers only. "0,1": exactly those GPU indices.
    devices: str = "auto"
    cpu_workers: int = Field(1, ge=1, le=64)
    # "local": spawned processes on this machine. "ray": Ray tasks on a cluster (`pip install -e '.[ray]'`).
    executor: Literal["local", "ray"] = "local"
    # Where the Ray cluster is: "auto" joins the one `ray start` runs on this machine; "10.0.0.1:6379" a remote
    # head. None starts a private single-machine Ray instance (a trial without `ray start`).
    ray_address: str | None = None
    # How many jobs Ferry hands to Ray at once; None = the cluster's GPU count at start-up, or `cpu_workers`
    # on a cluster without GPUs. A job beyond the free GPUs waits in Ray's queue, shown as running.
    ray_max_jobs: int | None = Field(None, ge=1, le=1024)
    # CPUs every job asks Ray for; Ray sets OMP_NUM_THREADS to it, so they are the job's torch threads (a
    # CPU-offloaded optimizer step runs on them). Each node needs at least this many CPUs.
    ray_cpus_per_job: int = Field(4, ge=1, le=256)
    # Job outputs (checkpoints, logs) and the default model/data roots. With the Ray executor this must be
    # storage every node mounts at the same path (NFS, a cluster filesystem); None = data_dir. The SQLite
    # queue stays in data_dir, on the service's own disk: events reach it through Ray, never over NFS.
    shared_dir: Path | None = None
    # Keep one spawned process per worker with torch and `jobs` already imported (service/workers/executor/spares.py),
    # so a job reaches its first step in tens of milliseconds instead of seconds of imports
    # (bench/service_bench.py); costs one idle process's host memory per worker (no GPU memory).
    warm_start: bool = True

    # Paths inside a spec (model weights, datasets) must resolve under one of these roots.
    # From the environment as a comma-separated list: FERRY_DATA_ROOTS=/srv/data,/mnt/datasets
    model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    data_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)

    max_body_bytes: int = Field(1_048_576, ge=1024)
    # POST /v1/files streams an upload to disk (<storage_dir>/uploads) up to this many bytes, past max_body_bytes.
    max_upload_bytes: int = Field(512 << 20, ge=1024)
    # A fine-tuning upload's rows are checked one line at a time, each read up to this many bytes: the check's
    # memory follows this limit, not the file's size. A longer line (a .json array on one line) gets a 422.
    max_upload_line_bytes: int = Field(4 << 20, ge=1024)
    max_yaml_depth: int = Field(32, ge=2)
    max_yaml_nodes: int = Field(20_000, ge=10)  # after alias expansion
    max_queued_jobs: int = Field(100, ge=1)
    max_retries: int = Field(3, ge=0)  # automatic requeues of an interrupted job
    cancel_grace_s: float = Field(3.0, ge=0)  # a cancelled job gets this long to stop before SIGKILL
    shutdown_grace_s: float = Field(15.0, ge=0)  # running jobs get this long to checkpoint on shutdown
    poll_interval_s: float = Field(0.2, gt=0)  # scheduler tick
    # Each submitted spec is checked in a process of its own (service/checking/checker.py); a check past this many
    # seconds is stopped (422 spec_check_timeout), and the checker's heap is held to this many bytes.
    spec_check_timeout_s: float = Field(30.0, gt=0)
    spec_check_memory_bytes: int | None = Field(4 << 30, ge=256 << 20)
    # One line per request costs CPU on every poll of every dashboard; errors are logged either way.
    access_log: bool = False
    # Per-step events: every one of a job's first N steps, then per window of steps its last, lowest-loss and
    # highest-loss step (service/queue/retention.py), so a long job's database stays small.
    events_keep_first_steps: int = Field(1000, ge=0)
    events_step_window: int = Field(100, ge=1)
    # Below this much free space on the data directory's disk, /ready says so and submits get 507.
    min_free_disk_bytes: int = Field(256 << 20, ge=0)
    # How long a write waits for another connection's lock on the SQLite file (a backup, a `sqlite3` shell)
    # before it is retried (service/queue/db.py); past that a request answers 503 with Retry-After. The job
    # processes inherit it through the environment (FERRY_DB_BUSY_TIMEOUT_S).
    db_busy_timeout_s: float = Field(30.0, gt=0, le=3600)
    # Host memory the jobs on this machine share for the offload engine's pinned host copies, e.g. "96GiB"
    # (FERRY_HOST_MEMORY_BUDGET). Each worker slot runs at most one job, so a job that sets no
    # offload.host_memory_limit gets budget / slots as its limit: the submit-time fit check plans and refuses
    # with it, and the worker hands it to the job, whose frozen weights beyond it stream from their checkpoint
    # files. None: no limit but the machine's memory.
    host_memory_budget: int | str | None = None
    # A grpo job's python grader runs the submitter's code on this machine, in a subprocess held to a time and
    # memory limit and guarded by an audit hook (jobs/objectives/graders/sandbox.py): a guard against mistakes,
    # not a security boundary. A server shared by people who do not trust each other's code sets this false: a
    # spec with a python grader (a multi's too) is then refused at submit (422, or 400 on the OpenAI route).
    allow_python_graders: bool = True

    @field_validator("host_memory_budget")
    @classmethod
    def _check_host_budget(cls, value: int | str | None) -> int | str | None:
        from offload.options import parse_bytes  # plain Python: the API process does not import torch

        if value is not None and not parse_bytes(value, name="FERRY_HOST_MEMORY_BUDGET"):
            raise ValueError(f"FERRY_HOST_MEMORY_BUDGET must be a positive size such as '96GiB'; got {value!r}")
        return value

    def host_memory_share(self, slots: int) -> int | None:
        """The ``offload.host_memory_limit`` a job that sets none gets: the budget over the worker slots."""
        from offload.options import parse_bytes

        budget = parse_bytes(self.host_memory_budget, name="FERRY_HOST_MEMORY_BUDGET")
        return budget // max(slots, 1) if budget else None

    @field_validator("model_roots", "data_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _check_token_for_public_host(self) -> Settings:
        if not is_loopback(self.host) and not self.api_token:
            raise ValueError(
                f"FERRY_HOST={self.host} is not a loopback address and no FERRY_API_TOKEN is set; "
                "set FERRY_API_TOKEN to a long random string, or bind FERRY_HOST=127.0.0.1"
            )
        if not is_loopback(self.host) and len(self.api_token.get_secret_value()) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"FERRY_HOST={self.host} is not a loopback address and FERRY_API_TOKEN is shorter than "
                f"{MIN_TOKEN_LENGTH} characters; set a long random one (openssl rand -hex 32)"
            )
        return self

    @field_validator("executor", mode="before")
    @classmethod
    def _check_executor(cls, value: Any) -> Any:
        if value not in ("local", "ray"):
            raise ValueError(f"FERRY_EXECUTOR={value!r} is not known; use 'local' or 'ray'")
        return value

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str) -> str:
        if not re.fullmatch(r"\s*(auto|cpu|\d+(\s*,\s*\d+)*)\s*", value, flags=re.IGNORECASE):
            raise ValueError(f"FERRY_DEVICES={value!r} is not understood; use 'auto', 'cpu' or GPU indices like '0,1'")
        return value

    @property
    def db_path(self) -> Path:
        return self.data_dir / "ferry.sqlite3"

    @property
    def storage_dir(self) -> Path:
        """Where job outputs and the default roots live: ``shared_dir``, or ``data_dir`` when none is set."""
        return self.shared_dir or self.data_dir

    @property
    def jobs_dir(self) -> Path:
        return self.storage_dir / "jobs"

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    @property
    def uploads_dir(self) -> Path:
        """Where ``POST /v1/files`` keeps uploads (``file-<id>/<name>``); always a data root, so that a spec names
        an upload by its id (``data: {path: file-<id>}``)."""
        return self.storage_dir / "uploads"

    @property
    def incoming_uploads_dir(self) -> Path:
        """Where uploads are written until they are complete: beside ``uploads_dir``, on its disk (a complete one
        is renamed into place), but outside every data root, so that no spec can name a partial upload.
        Emptied at start-up (a server killed mid-upload leaves its file here)."""
        return self.storage_dir / "uploads-incoming"

    @property
    def effective_model_roots(self) -> list[Path]:
        """The configured model roots, or ``<storage_dir>/models`` when none is."""
        return self.model_roots or default_model_roots(self.storage_dir)  # python -m jobs defaults to them too

    @property
    def effective_data_roots(self) -> list[Path]:
        """The configured data roots, or ``<storage_dir>/datasets`` and the example data shipped in a source
        checkout (``configs/data``, so the example configs submit as shipped) when none is; and the uploads
        directory either way."""
        configured = self.data_roots or default_data_roots(self.storage_dir)
        return [*configured, self.uploads_dir]
