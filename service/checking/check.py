"""What the spec checker does with one submission: parse, rules, preflight, device and fit; torch lives here.

This module runs in the spec checker's process (``service/checking/checker.py`` starts it) or, for tests, in the
caller's (``InlineSpecChecker``). It is the only service module that imports the model families, the
preflight and the estimate, all of which import torch; the API process never imports it.
"""

from __future__ import annotations

import gc
import logging
import resource
import signal
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path

import yaml

from jobs import JobSpec, JobSpecError, PathRoots, load_job_spec
from jobs.data.auto_size import choose_auto
from jobs.fit.disk_tier import with_host_memory_limit
from jobs.paths import without_roots
from jobs.spec.graders import each_grader
from jobs.spec.preflight import preflight_problems
from jobs.spec.text import ParsedSpec, parse_spec_text
from service.checking.fit import (
    estimate_fit,
    refuse_compile_over_offload_on_a_gpu,
    refuse_if_it_cannot_fit,
    refuse_if_no_worker_has_the_device,
)
from service.checking.messages import CheckedSpec, CheckRequest, Refusal
from service.checking.yaml_guard import ShapeGuard, YamlShapeError, shape_error
from service.errors import ApiError, spec_error

log = logging.getLogger("ferry.spec_check")
PYTHON_GRADERS_OFF = (
    "this server runs no python graders (FERRY_ALLOW_PYTHON_GRADERS=false); grade with string_check, "
    "text_similarity, math_answer, score_model or a multi of them, or ask its operator to allow python graders"
)


class InlineSpecChecker:
    """Checks in the caller's process (tests, and tools that already hold torch): the same code, no limits."""

    ready = True
    problem = None

    def start(self) -> None:
        pass

    def check(self, request: CheckRequest) -> CheckedSpec:
        return check_spec(request)

    def close(self) -> None:
        pass


def check_spec(request: CheckRequest) -> CheckedSpec:
    """Every check a submission gets before it is stored; raises ``ApiError`` 422 for a spec with problems.

    A refusal that only ``?queue_anyway`` or ``?fit_check=false`` lifts (no GPU worker, does not fit) is
    returned, not raised: the route answers it after its own checks (the disk), in the order they had.
    """
    spec, parsed = load_checked_spec(request)
    refuse_compile_over_offload_on_a_gpu(spec, list(request.slots), parsed)
    try:
        if request.check_device:
            refuse_if_no_worker_has_the_device(spec, list(request.slots), parsed)
    except ApiError as error:
        return _checked(spec, refusal=Refusal.of(error))
    if request.fit == "skip":
        return _checked(spec)
    try:
        # As the worker will run it: with the server's share of its host budget where the spec sets no limit.
        limited = with_host_memory_limit(spec, request.host_memory_limit)
        fit = estimate_fit(limited, list(request.slots), list(request.gpus))
    except Exception as error:
        # Submit queues the job without a fit check; validate says why there is no estimate.
        log.exception("memory estimate failed")
        return _checked(spec, estimate_error=f"the memory estimate failed: {type(error).__name__}: {error}")
    if request.fit == "refuse":
        try:
            refuse_if_it_cannot_fit(limited, fit, parsed)
        except ApiError as error:
            return _checked(spec, estimate=fit, refusal=Refusal.of(error))
    return _checked(spec, estimate=fit)


def load_checked_spec(request: CheckRequest) -> tuple[JobSpec, ParsedSpec]:
    """Parse the text once, its shape checked as the parser goes (before any alias is expanded), then let
    ``jobs`` check every field. Returns the spec and the parsed text, whose line map later problems use."""
    guard = ShapeGuard(max_depth=request.max_yaml_depth, max_nodes=request.max_yaml_nodes)
    roots = PathRoots(
        model_roots=[Path(p) for p in request.model_roots], data_roots=[Path(p) for p in request.data_roots]
    )
    try:
        parsed = parse_spec_text(request.text, on_event=guard.see)
    except YamlShapeError as error:
        raise spec_error([_whole_text(error)]) from None
    except yaml.YAMLError as error:
        raise spec_error([_whole_text(shape_error(error))]) from None
    except (RecursionError, ValueError):
        parsed = None  # load_job_spec names these (an unreadable number, nesting Python cannot follow)
    try:
        spec = load_job_spec(parsed if parsed is not None else request.text, roots=roots)
    except JobSpecError as error:  # messages name paths relative to their roots, as preflight's do
        raise spec_error([{**asdict(p), "message": without_roots(p.message, roots)} for p in error.problems]) from None
    assert parsed is not None  # the text that failed to parse above failed in load_job_spec too
    if not request.allow_python_graders:
        refused = python_grader_problems(spec)
        if refused:
            raise spec_error([{**p, "line": parsed.line_of(str(p["path"]))} for p in refused])
    # The files the spec names: the data's first rows (format, fields, chat template), LoRA targets.
    problems = preflight_problems(spec, roots)
    if problems:
        raise spec_error([{**asdict(p), "line": p.line or parsed.line_of(p.path)} for p in problems])
    if spec.training.auto:  # batch_size/epochs: auto, chosen from the data: the stored spec and the estimate
        spec, _ = choose_auto(spec)  # the worker chooses the same from the same data and logs why
    return spec, parsed


def python_grader_problems(spec: JobSpec) -> list[dict[str, object]]:
    """A problem for each python grader of the spec (a multi's too): this server runs none of them."""
    if spec.training.grpo.grader is None:
        return []
    return [
        {"path": path, "message": PYTHON_GRADERS_OFF, "suggestion": None}
        for path, grader in each_grader(spec.training.grpo.grader)
        if grader.type == "python"
    ]


def _checked(spec: JobSpec, **answer: object) -> CheckedSpec:
    return CheckedSpec(name=spec.name, spec=spec.model_dump(mode="json"), **answer)  # type: ignore[arg-type]


def _whole_text(error: YamlShapeError) -> dict[str, object]:
    return {"path": "", "message": error.message, "line": error.line, "suggestion": None}


def serve(connection: Connection, memory_bytes: int | None, *, ready_message: str) -> None:
    """The checker process's loop: one request in, one answer out, until the server closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server stops us
    if memory_bytes is not None:  # a spec that would take more makes a MemoryError here, not a swapping host
        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    _answer(_WARM_UP)  # the first real check pays no first-use costs (imports, pydantic's validators)
    gc.collect()
    gc.freeze()  # what start-up built lives as long as the checker: out of the collector's sight
    connection.send(ready_message)
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        connection.send(_answer(request))


def _answer(request: CheckRequest) -> CheckedSpec | Refusal | BaseException:
    try:
        return check_spec(request)
    except ApiError as error:
        return Refusal.of(error)
    except MemoryError:
        return Refusal(
            422,
            "spec_check_out_of_memory",
            "Checking the spec needed more memory than the checker has (FERRY_SPEC_CHECK_MEMORY_BYTES); "
            "make the model or data smaller.",
        )
    except Exception as error:  # a bug in a check; the exception's own class may not unpickle in the server
        log.exception("the spec check failed")
        return RuntimeError(f"{type(error).__name__}: {error}")


_WARM_UP = CheckRequest(
    text="name: warm-up\nmodel: {kind: toy_mlp, hidden_size: 8, num_layers: 2}\n"
    "data: {kind: synthetic_regression}\ntraining: {steps: 1}\ndevice: cpu\n",
    model_roots=(),
    data_roots=(),
    max_yaml_depth=32,
    max_yaml_nodes=1000,
    fit="report",
)
