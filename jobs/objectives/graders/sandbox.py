"""The ``python`` grader's subprocess: ``grade(sample, item)`` from the user's file, called for each completion.

What is enforced, and by what:

- **time**: each call runs under a timer (``timeout_s``; a late call is interrupted and scores 0), and the whole
  process under ``timeout_s`` per completion plus 30 s (a process that ignores the timer is killed);
- **memory**: the address space is capped at ``memory_mb`` (``RLIMIT_AS``: an allocation past it raises
  ``MemoryError``); files it writes at 64 MiB each (``RLIMIT_FSIZE``); no core files;
- **network**: where ``unshare`` may make one, the process runs in a network namespace of its own, which has no
  interface but a loopback that is down: the kernel refuses every connection. Elsewhere (a container without the
  privilege) only the audit hook below stands between it and the network, and the job log says so once;
- **files and processes**: an audit hook (``sys.addaudithook``, installed before the user's file is read) refuses
  sockets, starting processes (``subprocess``, ``os.system``, ``os.exec*``, ``os.fork``), ``ctypes`` and any file
  opened for writing or removed, renamed or created outside the grader's folder; reads are allowed in the folder
  and in the Python installation (its imports), nothing else. The working directory is the folder, the
  environment is empty but ``PATH``, and Python runs isolated (``-I``: no user site, no ``PYTHON*`` variables).

An audit hook guards against a grader's mistakes and casual misuse; it is not a security boundary against code
written to escape it (native code in an installed extension module is not audited). Run untrusted graders in a
container or VM of their own. The kernel's network namespace is the one guarantee of this list that is not Python's.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Runs in the grader's subprocess. The results go to a copy of stdout taken first; the user's prints go to stderr.
_WORKER = r"""
import json, math, os, resource, runpy, signal, sys
job = json.loads(sys.stdin.read())
results_out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
folder = os.path.realpath(job["folder"])
limit = job["memory_mb"] * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
readable = [folder] + sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path) if p})
devices = ("/dev/null", "/dev/urandom")
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "ctypes.", "pty.", "webbrowser.", "os.startfile")
PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
         "os.truncate", "os.utime", "shutil.", "os.chdir")
def inside(path, roots):
    if isinstance(path, int):
        return True
    path = os.path.realpath(os.fsdecode(path))
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)
def guard(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"the python grader may not use {event} (no network, no processes)")
    if event == "open":
        path, mode, flags = args
        writes = bool((flags or 0) & WRITE) or (mode is not None and any(c in mode for c in "wax+"))
        if writes and not inside(path, [folder]):
            raise PermissionError(f"the python grader may write only in its folder {folder}; not {path}")
        if not writes and not isinstance(path, int) and not inside(path, readable) and os.fsdecode(path) not in devices:
            raise PermissionError(f"the python grader may read only its folder {folder}; not {path}")
    elif event.startswith(PATHS) and args and not inside(args[0], [folder]):
        raise PermissionError(f"the python grader may change files only in its folder {folder}; not {args[0]}")
    elif event in ("os.listdir", "os.scandir") and args and args[0] is not None and not inside(args[0], readable):
        raise PermissionError(f"the python grader may list only its folder {folder}; not {args[0]}")
sys.path.insert(0, folder)
sys.addaudithook(guard)
results = []
try:
    grade = runpy.run_path(job["file"], run_name="grader")["grade"]
except BaseException as error:
    results_out.write(json.dumps([f"loading {os.path.basename(job['file'])}: {type(error).__name__}: {error}"] * len(job["items"])))
    results_out.flush()
    sys.exit(0)
class Late(Exception):
    pass
def late(signum, frame):
    raise Late(f"took longer than {job['timeout_s']} s")
signal.signal(signal.SIGALRM, late)
for sample, item in job["items"]:
    signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
    try:
        value = grade(sample, item)
        signal.setitimer(signal.ITIMER_REAL, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            results.append(f"returned {type(value).__name__}, not a number")
        elif not math.isfinite(value):
            results.append(f"returned {value}")
        else:
            results.append(float(value))
    except BaseException as error:
        signal.setitimer(signal.ITIMER_REAL, 0)
        results.append(f"{type(error).__name__}: {error}")
results_out.write(json.dumps(results))
results_out.flush()
"""


@functools.cache
def network_namespace() -> tuple[str, ...]:
    """The command prefix that runs a process with no network (``unshare``), or ``()`` where none can be made."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "--net"), (unshare, "--user", "--map-root-user", "--net")):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    log.warning(
        "python grader: no network namespace can be made here (unshare refused); an audit hook in the grader's "
        "process refuses sockets, which a grader using native code can get around"
    )
    return ()


def run_python_grader(
    spec: Any, file: Path, samples: list[dict[str, Any]], rows: list[dict[str, Any]], *, isolate_network: bool = True
) -> list[float | BaseException]:
    """``grade(sample, item)`` of ``file`` for each sample, in one subprocess (see the module docstring) whose
    working directory is the file's folder, with ``spec.memory_mb`` of address space and ``spec.timeout_s`` a call.

    Returns a float per sample, or the error that stood in for it."""
    path = file.resolve()
    items = [[sample, row] for sample, row in zip(samples, rows, strict=True)]
    job = {
        "file": str(path),
        "folder": str(path.parent),
        "memory_mb": spec.memory_mb,
        "timeout_s": spec.timeout_s,
        "items": items,
    }
    prefix = network_namespace() if isolate_network else ()
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-I", "-c", _WORKER],
            input=json.dumps(job, default=str),
            capture_output=True,
            text=True,
            cwd=path.parent,
            timeout=spec.timeout_s * len(items) + 30,  # each call has its timer; this catches a stuck process
            env={"PATH": "/usr/bin:/bin"},
        )
    except subprocess.TimeoutExpired:
        return [TimeoutError(f"took longer than {spec.timeout_s} s")] * len(items)
    try:
        results = json.loads(done.stdout) if done.stdout.strip() else None
    except json.JSONDecodeError:
        results = None
    if not isinstance(results, list) or len(results) != len(items):
        stderr = done.stderr.strip().splitlines()[-1:] if done.stderr else []
        reason = stderr[0] if stderr else f"exited with {done.returncode}"
        return [RuntimeError(f"the grader process failed: {reason}")] * len(items)
    return [value if isinstance(value, float) else RuntimeError(value) for value in results]
