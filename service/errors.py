"""The service's own errors, below the web layer: the queue and the checker raise them, routes answer them.

``ApiError`` carries the HTTP status, a code and a message naming the field and the fix; service/api/errors.py
turns it into the one error envelope. Nothing here imports FastAPI.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An answer other than success, with a message that names the field and the fix."""

    def __init__(
        self,
        status_code: int,
        code: str,
        message: str,
        *,
        problems: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code, self.code, self.message = status_code, code, message
        self.problems, self.headers = problems, headers


def spec_error(problems: list[dict[str, Any]]) -> ApiError:
    listed = "; ".join(_describe(p) for p in problems)
    noun = "problem" if len(problems) == 1 else "problems"
    return ApiError(422, "invalid_spec", f"The job spec has {len(problems)} {noun}: {listed}", problems=problems)


def _describe(problem: dict[str, Any]) -> str:
    where = problem["path"] or "spec"
    if problem.get("line") is not None:
        where += f" (line {problem['line']})"
    hint = f"; did you mean '{problem['suggestion']}'?" if problem.get("suggestion") else ""
    return f"{where}: {problem['message']}{hint}"
