"""Settings, the refusal to serve a public address without a token, worker slots per GPU, the executor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.settings import Settings
from service.workers.devices import GpuInfo, Slot, plan_slots, threads_for, unlisted_devices_problem
from tests.service.conftest import REPO

GPUS = [GpuInfo("0", "H200", 140 << 30, 0), GpuInfo("1", "H200", 140 << 30, 0)]


def test_defaults_bind_loopback_with_a_local_data_dir() -> None:
    settings = Settings(_env_file=None)
    assert (settings.host, settings.port, str(settings.data_dir)) == ("127.0.0.1", 8000, "ferry-data")


def test_public_host_without_token_is_refused() -> None:
    with pytest.raises(ValidationError, match="FERRY_HOST=0.0.0.0 is not a loopback address"):
        Settings(host="0.0.0.0", _env_file=None)
    assert Settings(host="0.0.0.0", api_token="t" * 32, _env_file=None).host == "0.0.0.0"


def test_roots_come_from_a_comma_separated_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_DATA_ROOTS", "/srv/data,/mnt/sets")
    assert [str(p) for p in Settings(_env_file=None).data_roots] == ["/srv/data", "/mnt/sets"]


def test_serve_command_refuses_public_host_without_token() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "service", "--host", "0.0.0.0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "ferry: FERRY_HOST=0.0.0.0 is not a loopback address and no FERRY_API_TOKEN is set; set "
        "FERRY_API_TOKEN to a long random string, or bind FERRY_HOST=127.0.0.1"
    )


@pytest.mark.parametrize(
    ("devices", "gpus", "expected"),
    [
        ("auto", GPUS, [Slot("gpu0", "0"), Slot("gpu1", "1")]),
        ("auto", [], [Slot("cpu0", None)]),
        ("1", GPUS, [Slot("gpu1", "1")]),
        ("cpu", GPUS, [Slot("cpu0", None)]),
    ],
)
def test_one_slot_per_gpu_or_a_cpu_slot(devices: str, gpus: list[GpuInfo], expected: list[Slot]) -> None:
    assert plan_slots(Settings(devices=devices, _env_file=None), gpus) == expected


def test_a_gpu_index_nvidia_smi_does_not_list_is_refused() -> None:
    problem = unlisted_devices_problem(Settings(devices="0,5", _env_file=None), GPUS)
    assert problem == (
        "FERRY_DEVICES='0,5' names GPU 5, which nvidia-smi does not list (it lists 0, 1); use "
        "those indices, 'auto' for all of them, or 'cpu'"
    )
    assert unlisted_devices_problem(Settings(devices="1", _env_file=None), GPUS) is None
    assert unlisted_devices_problem(Settings(devices="0,1", _env_file=None), []) is None  # no nvidia-smi here


def test_unknown_devices_setting_is_refused() -> None:
    with pytest.raises(ValidationError, match="FERRY_DEVICES='gpu' is not understood"):
        Settings(devices="gpu", _env_file=None)


def test_executor_is_local_unless_ray_is_chosen() -> None:
    assert Settings(_env_file=None).executor == "local"
    assert Settings(executor="ray", ray_address="10.0.0.1:6379", _env_file=None).executor == "ray"
    with pytest.raises(ValidationError, match="FERRY_EXECUTOR='k8s' is not known; use 'local' or 'ray'"):
        Settings(executor="k8s", _env_file=None)


def test_shared_dir_holds_job_outputs_and_default_roots_while_the_queue_stays_local() -> None:
    settings = Settings(data_dir=Path("/var/ferry"), shared_dir=Path("/mnt/shared/ferry"), _env_file=None)
    assert settings.db_path == Path("/var/ferry/ferry.sqlite3")
    assert settings.job_dir("job-1") == Path("/mnt/shared/ferry/jobs/job-1")
    # and the example data of a source checkout, so the example configs submit as shipped
    assert settings.effective_data_roots == [
        Path("/mnt/shared/ferry/datasets"),
        REPO / "configs" / "data",
        Path("/mnt/shared/ferry/uploads"),  # uploads, named by id in a spec, on the shared storage too
    ]
    assert settings.effective_model_roots == [Path("/mnt/shared/ferry/models")]
    assert Settings(data_dir=Path("/var/ferry"), _env_file=None).job_dir("job-1") == Path("/var/ferry/jobs/job-1")


def test_the_service_imports_ray_only_when_the_ray_executor_is_chosen() -> None:
    code = "import sys, service.api.app; assert 'ray' not in sys.modules, 'ray imported'"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "FERRY_EXECUTOR": "local"},
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_gpu_slots_of_one_box_share_its_cores_and_a_lone_gpu_slot_keeps_torchs_default() -> None:
    # Two GPU slots each with torch's default (a thread per core) made their jobs wait on each other's threads.
    two = [Slot("gpu0", "cuda:0"), Slot("gpu1", "cuda:1")]
    assert [threads_for(slot, two, 16) for slot in two] == [7, 7]
    assert threads_for(two[0], two, 2) == 1
    alone = [Slot("gpu0", "cuda:0")]
    assert threads_for(alone[0], alone, 16) is None
    mixed = [Slot("gpu0", "cuda:0"), Slot("cpu0", None)]
    assert threads_for(mixed[0], mixed, 16) == 7 and threads_for(mixed[1], mixed, 16) == 15
