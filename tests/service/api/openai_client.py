"""The official ``openai`` client on an in-process Ferry whose jobs never start: what the OpenAI-compatible routes
check and store, without a worker."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.checking.check import InlineSpecChecker
from service.settings import Settings
from tests.service.checking.test_one_parse import IdleExecutor


@contextmanager
def idle_ferry_client(data_dir: Path, **settings: Any) -> Iterator[openai.OpenAI]:
    """A client of a CPU Ferry storing under ``data_dir``; ``settings`` add to its Settings (e.g. model_roots)."""
    app = create_app(
        Settings(data_dir=data_dir, devices="cpu", _env_file=None, **settings),
        executor=IdleExecutor(),
        spec_checker=InlineSpecChecker(),
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
