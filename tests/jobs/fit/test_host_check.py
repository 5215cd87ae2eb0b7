"""host_memory_problem: the host check counts each rank process's own memory, not only its tensors."""

from __future__ import annotations

from jobs import estimate_memory
from jobs.fit.checks import host_memory_problem
from jobs.fit.host_memory import RANK_PROCESS_HOST_BYTES
from jobs.fit.sizes import human_bytes
from tests.jobs.helpers import TOY, merged, spec_from

MIB = 1 << 20


def problem_on_a_host_of(total: int, ranks: int) -> tuple[str, str] | None:
    spec = spec_from(merged(TOY, distributed={"world_size": ranks}, training={"batch_size": 4}))
    estimate = estimate_memory(spec)
    return host_memory_problem(
        peak_device_bytes=estimate.peak_device_bytes,
        pinned_host_bytes=estimate.pinned_host_bytes,
        host_total_bytes=total,
        on_host=True,
        optimizer_host_bytes=estimate.optimizer_host_bytes,
        ranks=estimate.ranks,
    )


def test_cpu_ranks_are_refused_where_their_processes_do_not_fit() -> None:
    """Four CPU ranks of a toy job: their tensors are a fraction of a MiB, their processes about 240 MiB each
    (measured 229-235 MiB unique to each rank), so 512 MiB of host memory is too little; one process fits."""
    assert problem_on_a_host_of(512 * MIB, ranks=1) is None
    problem = problem_on_a_host_of(512 * MIB, ranks=4)
    assert problem is not None
    path, message = problem
    assert path == "model"
    assert f"+ 4 rank processes {human_bytes(4 * RANK_PROCESS_HOST_BYTES)}) but this machine has 512.0 MiB" in message
    assert problem_on_a_host_of(4 * RANK_PROCESS_HOST_BYTES + 8 * MIB, ranks=4) is None


def test_the_estimate_notes_the_rank_processes() -> None:
    estimate = estimate_memory(spec_from(merged(TOY, distributed={"world_size": 2}, training={"batch_size": 4})))
    assert any(note.startswith("2 rank processes, each holding about ") for note in estimate.notes)
