"""The merged archive of a checkpoint: one merge however many ask at once (threads of this server, and another
process holding the lock file), every waiter answered with its result, and a checksum record that is missing or
empty computed again instead of a 500 or an empty header."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import service.api.merged_archives as merged_archives
import service.api.routes.checkpoints as routes
from service.api.errors import ApiError
from service.api.merged_archives import merged_archive_sha256
from service.settings import Settings
from tests.service.api.test_checkpoint_routes import BASE, JOB, client, error, settings

__all__ = ["client", "settings"]  # the fixtures, shared with the other checkpoint routes' tests
TAR = b"a merged model's archive" * 100
REQUESTS = 12


def merged_archive(settings: Settings, step: int = 2) -> Path:
    return settings.job_dir(JOB) / "output" / "exports" / f"step-{step:08d}-merged.tar"


def write_archive(output: Path, content: bytes = TAR) -> None:
    """What ``python -m jobs merge`` leaves: ``<output>.tar``, renamed into place whole."""
    target = output.with_name(output.name + ".tar")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}")
    tmp.write_bytes(content)
    tmp.rename(target)


class CountingMerge:
    """Stands in for the merge process: counts the merges, each one held until every request has reached the
    route and passed the point where it joins a merge under way (the module's lock over them)."""

    def __init__(self, fails: bool = False) -> None:
        self.merges = 0
        self.arrived = 0
        self.joined = 0
        self.fails = fails
        self.lock = threading.Condition()
        self.flights_lock = threading.Lock()

    def __enter__(self) -> None:  # stands in for merged_archives._flights_lock, counting who got past it
        self.flights_lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.flights_lock.release()
        with self.lock:
            self.joined += 1
            self.lock.notify_all()

    def arrive(self, job_dir: Path, checkpoint: str) -> Path:
        with self.lock:
            self.arrived += 1
            self.lock.notify_all()
        return merged_archive_path(job_dir, checkpoint)

    def merge(self, checkpoint: Path, output: Path) -> None:
        with self.lock:
            self.merges += 1
            # Every request is in the route before the first merge ends (a guard, not a timing: 60 s).
            assert self.lock.wait_for(lambda: self.arrived == self.joined == REQUESTS, timeout=60)
        if self.fails:
            raise ApiError(422, "not_mergeable", "the base model is gone")
        write_archive(output)


merged_archive_path = routes._merged_archive


def post_all(client: TestClient, url: str) -> list[httpx.Response]:
    answers: list[Any] = [None] * REQUESTS

    def post(index: int) -> None:
        answers[index] = client.post(url)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(REQUESTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def test_concurrent_merges_of_one_checkpoint_run_one_merge_and_share_its_archive(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = CountingMerge()
    monkeypatch.setattr(merged_archives, "_flights_lock", fake)
    monkeypatch.setattr(routes, "_merged_archive", fake.arrive)
    monkeypatch.setattr(routes, "_merge", fake.merge)
    answers = post_all(client, f"{BASE}/step-00000002/merge")
    assert [a.status_code for a in answers] == [200] * REQUESTS
    assert fake.merges == 1
    digest = hashlib.sha256(TAR).hexdigest()
    assert {a.json()["archive"]["sha256"] for a in answers} == {digest}
    assert client.post(f"{BASE}/step-00000002/merge").json()["archive"]["sha256"] == digest
    assert fake.merges == 1  # made once, answered from then on


def test_a_failed_merge_answers_every_request_that_waited_for_it(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = CountingMerge(fails=True)
    monkeypatch.setattr(merged_archives, "_flights_lock", fake)
    monkeypatch.setattr(routes, "_merged_archive", fake.arrive)
    monkeypatch.setattr(routes, "_merge", fake.merge)
    answers = post_all(client, f"{BASE}/step-00000002/merge")
    assert {error(a) for a in answers} == {(422, "not_mergeable", "the base model is gone")}
    assert fake.merges == 1


@pytest.mark.parametrize("record", [None, "", "  \n", "not a checksum"])
def test_a_missing_or_empty_checksum_is_computed_again(
    client: TestClient, settings: Settings, monkeypatch: pytest.MonkeyPatch, record: str | None
) -> None:
    """The state a crash between the archive and its checksum leaves (or one while hashing): both routes
    answer with the archive's real SHA-256 and write it down again."""
    archive = merged_archive(settings)
    write_archive(archive.with_suffix(""))
    checksum = archive.with_name(archive.name + ".sha256")
    if record is not None:
        checksum.write_text(record)

    def no_merge(checkpoint: Path, output: Path) -> None:
        raise AssertionError("the archive exists: nothing to merge")

    monkeypatch.setattr(routes, "_merge", no_merge)
    digest = hashlib.sha256(TAR).hexdigest()
    download = client.get(f"{BASE}/step-00000002/merged")
    assert download.status_code == 200 and download.content == TAR
    assert download.headers["x-checksum-sha256"] == digest
    checksum.unlink(missing_ok=True)
    if record is not None:
        checksum.write_text(record)
    merged = client.post(f"{BASE}/step-00000002/merge")
    assert merged.status_code == 200, merged.text
    assert merged.json()["archive"]["sha256"] == digest
    assert checksum.read_text() == digest


# Another server process: holds the archive's lock while it "merges", until told to finish.
OTHER_PROCESS = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from service.api.merged_archives import merged_archive_sha256

    archive = Path(sys.argv[1])

    def merge():
        print("merging", flush=True)
        sys.stdin.readline()
        archive.write_bytes(b"made by the other process")

    print(merged_archive_sha256(archive, merge), flush=True)
    """
)


def blocked_on_lock(lock: Path) -> bool:
    """Whether a process waits for ``lock`` in flock(2) (a ``->`` line of /proc/locks names its inode)."""
    inode = f":{lock.stat().st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks")
def test_a_merge_in_another_process_is_waited_for_and_its_archive_used(tmp_path: Path) -> None:
    archive = tmp_path / "exports" / "step-00000002-merged.tar"
    root = Path(__file__).parents[3]
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_PROCESS, str(archive)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert other.stdin is not None and other.stdout is not None
    assert other.stdout.readline() == "merging\n"
    merges: list[int] = []
    answer: list[str] = []
    here = threading.Thread(target=lambda: answer.append(merged_archive_sha256(archive, lambda: merges.append(1))))
    here.start()
    lock = archive.with_name(f".{archive.name}.lock")
    deadline = time.monotonic() + 60  # a guard against a hang, not a timing
    while not blocked_on_lock(lock) and here.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert blocked_on_lock(lock), "the second merge did not wait for the first process's lock"
    other.stdin.write("done\n")
    other.stdin.close()
    here.join()
    digest = hashlib.sha256(b"made by the other process").hexdigest()
    assert other.stdout.readline().strip() == digest and other.wait() == 0
    assert answer == [digest] and merges == []
