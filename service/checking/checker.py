"""The spec checker: a warm process of its own that checks each submitted spec, so the API never imports torch.

Checking a spec means the model families, the preflight (data rows, tokenizer, a meta model) and the memory
estimate, which all import torch. Kept out of the API process, that process stays small (no torch: far
less memory, and a garbage collector with far fewer objects to walk on every full pass), and a
hostile spec costs the checker, not the server: each check has a time limit (``FERRY_SPEC_CHECK_TIMEOUT_S``)
and a memory limit (``FERRY_SPEC_CHECK_MEMORY_BYTES``); a check over its time is killed with its process and
answered 422 ``spec_check_timeout``, and a process that died is started again.

The checker is spawned with the server and imports ``jobs`` while the server starts, so a check costs a
pipe round trip plus the check itself. Checks run one at a time, in the order they arrive.

Example:
    checker = SpecCheckerProcess(timeout_s=30, memory_bytes=4 << 30)
    checker.start()
    checked = checker.check(CheckRequest(text=yaml_text, ...))  # raises ApiError for a refused spec
    checker.close()

Tests and tools that hold torch already check in their own process: ``check.InlineSpecChecker``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, ClassVar, Protocol

from service.checking.messages import CheckedSpec, CheckRequest, Refusal
from service.errors import ApiError

log = logging.getLogger("ferry.spec_checker")
_SPAWN = mp.get_context("spawn")  # a fork would copy the server's threads and sockets into the checker
_READY = "ready"
_DIED = object()  # what _ask returns when the checker died before answering


class SpecChecker(Protocol):
    """What the routes need: a check that returns the checked spec or raises ``ApiError``."""

    @property
    def ready(self) -> bool: ...

    @property
    def problem(self) -> str | None: ...

    def start(self) -> None: ...

    def check(self, request: CheckRequest) -> CheckedSpec: ...

    def close(self) -> None: ...


def _run_checker(connection: Connection, memory_bytes: int | None) -> None:
    """The checker process's entry point: import ``jobs`` (torch) once, then answer checks until EOF."""
    from service.checking.check import serve  # this import is why the checker is its own process

    serve(connection, memory_bytes, ready_message=_READY)


@dataclass
class _Child:
    process: Any  # multiprocessing's SpawnProcess
    connection: Connection
    ready: bool = False


@dataclass
class SpecCheckerProcess:
    """The checker in a spawned process, restarted when it dies or overruns a check.

    Args:
        timeout_s: the most one check may take; the process is killed and replaced after it.
        memory_bytes: the checker's address-space limit for its heap (``RLIMIT_DATA``); None for none.
        start_timeout_s: how long a check waits for a (re)starting checker to import ``jobs``.
    """

    entry_point: ClassVar[Callable[[Connection, int | None], None]] = staticmethod(_run_checker)  # a test swaps it
    timeout_s: float = 30.0
    memory_bytes: int | None = 4 << 30
    start_timeout_s: float = 180.0
    _child: _Child | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _ever_ready: bool = field(default=False, init=False, repr=False)
    _last_exit: int | None = field(default=None, init=False, repr=False)
    _start_problem: str | None = field(default=None, init=False, repr=False)

    @property
    def ready(self) -> bool:
        """True once a checker has started (a restart later does not make the server unready); never waits."""
        if not self._ever_ready and self._lock.acquire(blocking=False):
            try:
                child = self._child
                if child is not None and not child.ready and child.connection.poll():
                    self._read_ready(child)
            finally:
                self._lock.release()
        return self._ever_ready

    @property
    def problem(self) -> str | None:
        """Why the last checker did not start (for /ready), or None."""
        return self._start_problem

    def _read_ready(self, child: _Child) -> None:
        """Take the checker's first message, which is there: ready, or the end of a checker that died starting."""
        try:
            message = child.connection.recv()
        except (EOFError, OSError):
            message = None
        if message == _READY:
            child.ready = self._ever_ready = True
            self._start_problem = None
        else:
            child.process.join(1)
            self._start_problem = f"exited while starting (code {child.process.exitcode})"

    @property
    def pid(self) -> int | None:
        """The checker process's id (for logs and tests); None before ``start``."""
        return None if self._child is None else self._child.process.pid

    def start(self) -> None:
        """Spawn the checker; it imports ``jobs`` in the background, while the server starts."""
        with self._lock:
            if self._child is None:
                self._child = self._spawn()

    def check(self, request: CheckRequest) -> CheckedSpec:
        """The checked spec; raises ``ApiError``: 422 for the spec's problems or an overrun, 503 if the checker
        is down.

        A checker found dead (killed between checks, or by this very spec) is replaced and the check tried
        once more on the new one; dying twice is the spec's doing, and answered 503.
        """
        with self._lock:
            answer = self._ask(request)
            if answer is _DIED:
                answer = self._ask(request)
            if answer is _DIED:
                raise self._died()
        if isinstance(answer, Refusal):
            raise answer.error()
        if isinstance(answer, BaseException):
            raise RuntimeError("the spec checker failed") from answer  # a bug in a check: a 500, logged
        return answer  # type: ignore[return-value]

    def _ask(self, request: CheckRequest) -> object:
        """One round trip to a running checker: its answer, or ``_DIED`` (the checker is then replaced)."""
        child = self._running_child()
        try:
            child.connection.send(request)
            if child.connection.poll(self.timeout_s):
                return child.connection.recv()
        except (EOFError, OSError):
            child.process.join(5)
            self._last_exit = child.process.exitcode
            self._replace(child)
            return _DIED
        self._replace(child)  # the check is still running: it goes with its process
        raise ApiError(
            422,
            "spec_check_timeout",
            f"Checking the spec took longer than {self.timeout_s:g} s (FERRY_SPEC_CHECK_TIMEOUT_S) and was "
            "stopped; a model this large (num_layers, hidden sizes) or a data file this slow to read "
            "cannot be checked; make it smaller.",
        )

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._stop(self._child)
                self._child = None

    def _running_child(self) -> _Child:
        if self._child is None or self._child.process.exitcode is not None:
            if self._child is not None:
                log.warning("the spec checker exited (code %s); starting a new one", self._child.process.exitcode)
                self._stop(self._child)
            self._child = self._spawn()
        self._wait_ready(self._child, self.start_timeout_s)
        return self._child

    def _wait_ready(self, child: _Child, timeout_s: float) -> None:
        if not child.ready and child.connection.poll(timeout_s):
            self._read_ready(child)
        if not child.ready:
            reason = self._start_problem or f"did not start within {timeout_s:g} s"
            self._start_problem = reason
            self._replace(child)
            raise ApiError(
                503,
                "spec_checker_unavailable",
                f"The spec checker {reason}; see the server log. Try again shortly.",
                headers={"Retry-After": "10"},
            )

    def _died(self) -> ApiError:
        code = self._last_exit
        cause = f"was killed (signal {-code})" if code is not None and code < 0 else f"exited (code {code})"
        hint = "; the kernel kills a process out of memory with signal 9" if code == -9 else ""
        return ApiError(
            503,
            "spec_checker_unavailable",
            f"The spec checker {cause} twice while checking this spec{hint}. It was restarted; a spec this "
            "large cannot be checked: make the model or data smaller.",
            headers={"Retry-After": "10"},
        )

    def _replace(self, child: _Child) -> None:
        self._stop(child)
        self._child = self._spawn()  # warms up while nothing waits for it

    def _spawn(self) -> _Child:
        ours, theirs = _SPAWN.Pipe()
        process = _SPAWN.Process(
            target=type(self).entry_point, args=(theirs, self.memory_bytes), name="ferry-spec-checker", daemon=True
        )
        process.start()
        theirs.close()  # the checker holds the only other end: it sees EOF when the server goes away
        return _Child(process, ours)

    @staticmethod
    def _stop(child: _Child) -> None:
        child.connection.close()
        if child.process.exitcode is None:
            child.process.kill()
        child.process.join(5)
