"""SharedArenaPool: one host copy of the frozen weights for all the processes of one machine.

Data-parallel ranks each hold the whole model. Their frozen weights are identical and never change, so the
ranks of one machine can stream them from the same host memory: the leader (local rank 0) allocates the
arena's chunks as files in ``/dev/shm`` mapped shared and fills them; every other local rank maps the same
files, in the same order and sizes (the engine's allocations are deterministic), and skips the filling.
Host memory then stays at one copy whatever the number of ranks, and each rank copies whole units over its
own link. On CUDA every process registers its mapping with ``cudaHostRegister`` (page-locked), so its
copies stay asynchronous. Once every rank has mapped the chunks, `unlink` removes the files: the memory
lives as long as a mapping does and nothing is left behind when the processes end, however they end.

Only tensors whose host copy never changes belong here (frozen weights); trainable masters, gradients and
buffers a forward updates stay in each process's own arena.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from offload.arena import ArenaChunk, PinnedArenaPool

log = logging.getLogger(__name__)

SHM_DIRECTORY = Path("/dev/shm")


class _SharedChunk(ArenaChunk):
    """A chunk over a shared file mapping, page-locked by ``cudaHostRegister`` when ``pin``."""

    def __init__(self, path: Path, nbytes: int, *, create: bool, pin: bool) -> None:
        if not create and not path.exists():
            raise FileNotFoundError(f"{path}: the leader has not made this chunk (the ranks' arenas differ)")
        self.memory = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        self.storage = self.memory
        self.capacity, self.used, self.path = nbytes, 0, path
        self.registered = False
        if pin:
            code = torch.cuda.cudart().cudaHostRegister(self.memory.data_ptr(), nbytes, 0)
            self.registered = int(code) == 0
            if not self.registered:
                log.warning("cudaHostRegister of %s failed (%s); its copies will not be asynchronous", path, code)

    def unregister(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.memory.data_ptr())
            self.registered = False


class SharedArenaPool(PinnedArenaPool):
    """A `PinnedArenaPool` whose chunks are files under ``directory`` named ``{name}-{index}``, shared by the
    processes of one machine.

    Args:
        expected_bytes: as for `PinnedArenaPool`; every process must pass the same value.
        name: the same in every process of one job, different between jobs (e.g. the rendezvous id).
        leader: this process creates and fills the chunks; the others map them and fill nothing.
        pin: page-lock each process's mapping (``cudaHostRegister``).
        directory: where the chunk files live (``/dev/shm``: memory, not disk).

    Example:
        >>> pool = SharedArenaPool(4096, name="job-1", leader=True, pin=False)
        >>> pool.allocate((16, 16), torch.float32)  # in /dev/shm/job-1-0
    """

    def __init__(
        self,
        expected_bytes: int = 0,
        *,
        name: str,
        leader: bool,
        pin: bool = True,
        directory: Path = SHM_DIRECTORY,
    ) -> None:
        super().__init__(expected_bytes, pin=pin)
        self.name, self.leader, self.directory = name, leader, Path(directory)
        self._shared: list[_SharedChunk] = []

    @property
    def paths(self) -> list[Path]:
        """The chunk files, in allocation order (until `unlink`)."""
        return [chunk.path for chunk in self._shared]

    def _new_chunk(self, nbytes: int) -> ArenaChunk:
        path = self.directory / f"{self.name}-{len(self._shared)}"
        if self.leader and path.exists():
            path.unlink()  # left by an earlier attempt of the same name: start from zeros
        chunk = _SharedChunk(path, nbytes, create=self.leader, pin=self.pin)
        self._shared.append(chunk)
        return chunk

    def _allocate_fallback(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        # A private tensor would break the ranks' common layout (and the follower would read it unfilled).
        raise RuntimeError(f"could not map a shared chunk for {nbytes} bytes under {self.directory}")

    def filled_elsewhere(self, host: torch.Tensor) -> bool:
        """A follower's host copies are the leader's bytes: it fills nothing."""
        if self.leader:
            return False
        address = host.data_ptr()
        return any(c.memory.data_ptr() <= address < c.memory.data_ptr() + c.capacity for c in self._shared)

    def unlink(self) -> None:
        """Remove the chunk files (the leader, once every process has mapped them): the mappings stay valid
        and the memory is freed with the last of them."""
        if self.leader:
            for chunk in self._shared:
                chunk.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unregister the page-locked mappings (the memory goes with the last reference to the storages)."""
        for chunk in self._shared:
            chunk.unregister()

    def __repr__(self) -> str:
        role = "leader" if self.leader else "follower"
        return f"SharedArenaPool({self.name!r}, {role}, chunks={len(self._shared)}, reserved={self.reserved_bytes})"
