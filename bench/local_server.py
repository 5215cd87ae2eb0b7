"""Start ``python -m service`` on a free loopback port for a bench script, and wait until it is ready."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def start_server(
    workdir: Path,
    settings: dict[str, str],
    *,
    unset: tuple[str, ...] = (),
    ready_timeout: float = 300,
    python_args: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """The service with ``settings`` (FERRY_* variables) on top of this environment, logging to
    ``workdir/server.log``; ``python_args`` go before ``-m service`` (e.g. ``-m cProfile -o FILE``).
    Returns the process and its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "FERRY_HOST": "127.0.0.1",
        "FERRY_PORT": str(port),
        **settings,
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p),
    }
    for name in unset:
        env.pop(name, None)
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - open for the server's lifetime
    process = subprocess.Popen(
        [sys.executable, *python_args, "-m", "service"], env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit(f"the server did not become ready; see {workdir / 'server.log'}")
