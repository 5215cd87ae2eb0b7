"""SharedArenaPool: the processes of a machine stream the frozen weights from one host copy, which the
leader fills and the others only map (here two managers in one process stand for two ranks)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offload import OffloadOptions
from offload.manager import ArenaFactory
from offload.shared_arena import SHM_DIRECTORY, SharedArenaPool
from tests.offload.models import make_stack, train


@pytest.fixture
def name() -> Iterator[str]:
    name = f"ferry-test-{uuid.uuid4().hex}"
    yield name
    for path in SHM_DIRECTORY.glob(f"{name}-*"):
        path.unlink()


def shared(name: str, *, leader: bool, made: list[SharedArenaPool]) -> ArenaFactory:
    def make(expected_bytes: int, pin: bool) -> SharedArenaPool:
        made.append(SharedArenaPool(expected_bytes, name=name, leader=leader, pin=pin))
        return made[-1]

    return make


@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_a_follower_streams_the_leaders_copy_and_fills_nothing(name: str, granularity: str) -> None:
    options = OffloadOptions(granularity=granularity)
    reference, want, _ = train(make_stack("adapter", None))
    arenas: list[SharedArenaPool] = []
    leader_losses, leader_state, _ = train(
        make_stack("adapter", None),
        offload={"options": options, "frozen_arena": shared(name, leader=True, made=arenas)},
    )
    follower_model = make_stack("adapter", None)
    with torch.no_grad():
        for param in follower_model.parameters():
            if not param.requires_grad:
                param.zero_()  # had the follower filled its host copies, it would train on zeros
    losses, state, manager = train(
        follower_model, offload={"options": options, "frozen_arena": shared(name, leader=False, made=arenas)}
    )
    leader, follower = arenas
    assert losses == leader_losses == reference
    for key in want:
        assert torch.equal(state[key], want[key]) and torch.equal(leader_state[key], want[key]), key

    frozen = sum(p.numel() * p.element_size() for p in make_stack("adapter", None).parameters() if not p.requires_grad)
    assert follower.paths == leader.paths and all(path.parent == SHM_DIRECTORY for path in leader.paths)
    assert leader.requested_bytes == follower.requested_bytes == frozen
    # One copy in memory between them: the files' pages (tmpfs allocates what is written) hold the frozen
    # bytes once, and the follower's own arena holds none of them.
    written = sum(Path(path).stat().st_blocks * 512 for path in leader.paths)
    assert frozen <= written < frozen + 2 * 4096 * len(leader.paths)
    assert manager is not None and manager.arena.requested_bytes == 0
    leader.unlink()
    assert not any(path.exists() for path in leader.paths)


def test_a_follower_needs_the_leaders_chunks(name: str) -> None:
    follower = SharedArenaPool(4096, name=name, leader=False, pin=False)
    with pytest.raises(FileNotFoundError, match="the leader has not made this chunk"):
        follower.allocate((16,), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["leaf", "block"])
def test_on_cuda_each_mapping_is_page_locked_and_a_follower_trains_as_resident(name: str, granularity: str) -> None:
    """Each process registers its mapping (``cudaHostRegister``): copies from it are asynchronous, and the
    follower, which filled nothing, trains as the resident model does."""
    torch.backends.cuda.matmul.allow_tf32 = False
    options = OffloadOptions(granularity=granularity)
    reference, want, _ = train(make_stack("adapter", None), device="cuda")
    arenas: list[SharedArenaPool] = []
    train(
        make_stack("adapter", None),
        device="cuda",
        offload={"options": options, "frozen_arena": shared(name, leader=True, made=arenas)},
    )
    follower_model = make_stack("adapter", None)
    with torch.no_grad():
        for param in follower_model.parameters():
            if not param.requires_grad:
                param.zero_()
    losses, state, manager = train(
        follower_model,
        device="cuda",
        offload={"options": options, "frozen_arena": shared(name, leader=False, made=arenas)},
    )
    leader, follower = arenas
    assert leader.pin and follower.pin
    assert all(chunk.registered and chunk.memory.is_pinned() for chunk in follower._shared + leader._shared)
    assert manager is not None and manager.stats().h2d_bytes > 0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
    for key in want:
        torch.testing.assert_close(state[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    leader.close()
    follower.close()
