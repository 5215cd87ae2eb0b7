"""Settings, the refusal to serve a public address without a token, and worker slots per GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from service.devices import GpuInfo, Slot, plan_slots
from service.settings import Settings

from .conftest import REPO

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
    result = subprocess.run([sys.executable, "-m", "service", "--host", "0.0.0.0"], cwd=REPO,
                            capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "ferry: FERRY_HOST=0.0.0.0 is not a loopback address and no FERRY_API_TOKEN is set; set "
        "FERRY_API_TOKEN to a long random string, or bind FERRY_HOST=127.0.0.1")


@pytest.mark.parametrize(("devices", "gpus", "expected"), [
    ("auto", GPUS, [Slot("gpu0", "0"), Slot("gpu1", "1")]),
    ("auto", [], [Slot("cpu0", None)]),
    ("1", GPUS, [Slot("gpu1", "1")]),
    ("cpu", GPUS, [Slot("cpu0", None)]),
])
def test_one_slot_per_gpu_or_a_cpu_slot(devices: str, gpus: list[GpuInfo], expected: list[Slot]) -> None:
    assert plan_slots(Settings(devices=devices, _env_file=None), gpus) == expected


def test_unknown_devices_setting_is_refused() -> None:
    with pytest.raises(ValidationError, match="FERRY_DEVICES='gpu' is not understood"):
        Settings(devices="gpu", _env_file=None)
