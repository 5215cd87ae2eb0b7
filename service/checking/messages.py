"""What crosses the pipe between the API process and the spec checker: the request, the checked spec, a refusal.

Plain, picklable dataclasses with no torch behind them, so the API (which builds requests and reads answers)
and the checker's own code (``check.py``, which answers them) both import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from service.checking.fit_shapes import FitEstimate
from service.errors import ApiError
from service.settings import Settings
from service.workers.devices import GpuInfo, Slot


@dataclass(frozen=True)
class CheckRequest:
    """One submission to check: its text, this service's roots and limits, and what to decide.

    ``fit``: ``refuse`` a job estimated not to fit (submit), ``report`` the estimate (validate), or ``skip``
    it (submit with ``?fit_check=false``). ``check_device``: refuse ``device: cuda`` without a GPU worker.
    """

    text: str
    model_roots: tuple[str, ...]
    data_roots: tuple[str, ...]
    max_yaml_depth: int
    max_yaml_nodes: int
    slots: tuple[Slot, ...] = ()
    gpus: tuple[GpuInfo, ...] = ()
    check_device: bool = True
    fit: Literal["refuse", "report", "skip"] = "refuse"
    host_memory_limit: int | None = None  # the server's share of host_memory_budget (Settings.host_memory_share)
    allow_python_graders: bool = True  # false: a spec with a python grader is refused (Settings.allow_python_graders)

    @classmethod
    def for_service(
        cls,
        text: str,
        settings: Settings,
        slots: list[Slot],
        gpus: list[GpuInfo],
        *,
        queue_anyway: bool,
        fit: Literal["refuse", "report", "skip"],
    ) -> CheckRequest:
        """The request for ``text`` on this service: its roots, YAML limits, workers and GPUs."""
        return cls(
            text=text,
            model_roots=tuple(str(p) for p in settings.effective_model_roots),
            data_roots=tuple(str(p) for p in settings.effective_data_roots),
            max_yaml_depth=settings.max_yaml_depth,
            max_yaml_nodes=settings.max_yaml_nodes,
            slots=tuple(slots),
            gpus=tuple(gpus),
            # A Ray cluster's GPUs are not this machine's, so only a local service refuses for want of one.
            check_device=not queue_anyway and settings.executor == "local",
            fit=fit,
            host_memory_limit=settings.host_memory_share(len(slots)),
            allow_python_graders=settings.allow_python_graders,
        )


@dataclass(frozen=True)
class Refusal:
    """An ``ApiError`` as plain data, so it crosses the pipe from the checker."""

    status_code: int
    code: str
    message: str
    problems: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, error: ApiError) -> Refusal:
        return cls(error.status_code, error.code, error.message, error.problems)

    def error(self) -> ApiError:
        return ApiError(self.status_code, self.code, self.message, problems=self.problems)


@dataclass(frozen=True)
class CheckedSpec:
    """A spec that passed: its name, its resolved form (what is stored), and the fit estimate if one was made.

    ``refusal``: the device or fit check's answer, which the route raises after its own checks.
    """

    name: str
    spec: dict[str, Any]
    estimate: FitEstimate | None = None
    estimate_error: str | None = None
    refusal: Refusal | None = None
