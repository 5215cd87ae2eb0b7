"""The browser tests' screenshots: never into the repository unless asked (tests never rewrite tracked files)."""

from __future__ import annotations

import pytest

from tests.service.dashboard.test_dashboard_browser import REPO, screenshot_dir


def test_screenshots_stay_out_of_the_repository_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FERRY_SCREENSHOTS", raising=False)
    assert not screenshot_dir().is_relative_to(REPO)
    monkeypatch.setenv("FERRY_SCREENSHOTS", "docs")  # the separate command that refreshes the README's
    assert screenshot_dir() == REPO / "docs"
