"""Weights straight into the engine's pinned arena: a model built on the meta device, filled where it will live.

With model offload the frozen weights' only home is the offload engine's pinned arena. Building the model in
ordinary memory first and then copying it there needs twice the host memory and a pass over every byte; for a
32B model that is 65 GB more than the machine has to spare. Instead the model is built on the meta device
(shapes only; buffers stay real, they are small), and the engine calls a `WeightSource` for each host copy it
allocates (``OffloadTrainingManager(..., initialize=source.fill)``):

* `SafetensorsSource`: tensors read from (sharded) safetensors files with ``os.preadv`` straight into the
  pinned copy, in parallel threads; no intermediate tensor when the dtype matches.
* `SeededInitSource`: the built-in model's init, tensor by tensor, bitwise the same as the ordinary build.
* `RandomSource` (``model.init: random``): N(0, std) matrices, unit norm weights, zero biases, drawn on the
  GPU when the job has one (at link speed; 65 GB in seconds) and copied into the pinned copy. Deterministic
  per seed and device: each tensor's chunk of 2^24 elements has its own generator seeded from (seed, tensor
  index, chunk); the values depend on the generating device (CUDA's and the CPU's generators differ).

``finish()`` waits for the reads and copies and returns how many bytes were loaded how fast.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from offload.disk import FileRange

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CHUNK_ELEMENTS = 1 << 24
MAX_HEADER_BYTES = 100 * 2**20  # safetensors caps its JSON header at 100 MB


@dataclass(frozen=True)
class LoadReport:
    """What filling the pinned arena took: bytes written into it, wall seconds, where from."""

    source: str
    bytes: int
    seconds: float
    quantized: str | None = None  # quantized as it loaded (quant/on_load.py): the method
    stored_bytes: int | None = None  # and the quantized bytes written into the arena
    quantize_seconds: float | None = None  # time inside the quantization kernels

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightSource:
    """Fills host copies of meta tensors; ``names`` maps ``id(tensor)`` to the name(s) it has in the model."""

    kind = "weights"

    def __init__(self, model: nn.Module) -> None:
        self.names: dict[int, list[str]] = {}
        for name, tensor in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]:
            self.names.setdefault(id(tensor), []).append(name)
        self.index = {key: i for i, key in enumerate(self.names)}  # registration order, for seeding
        self.bytes = 0
        self._started = time.perf_counter()

    def fill(self, name: str, tensor: torch.Tensor, host: torch.Tensor) -> None:
        """Write ``tensor``'s values into ``host`` (may return before the data is there; see ``finish``)."""
        raise NotImplementedError

    def finish(self) -> LoadReport:
        """Wait until every fill has landed."""
        return LoadReport(self.kind, self.bytes, time.perf_counter() - self._started)

    def dense(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values as a new tensor, there when this returns (a weight quantized as it loads,
        quant/on_load.py): by default the fill's, into ordinary memory."""
        values = torch.empty(tensor.shape, dtype=tensor.dtype)
        self.fill(name, tensor, values)
        return values

    def submit(self, work: Callable[[], None]) -> None:
        """Run one tensor's load (``work``) now, or in the source's loader threads (``finish`` waits for it)."""
        work()

    def file_range(self, name: str, tensor: torch.Tensor) -> FileRange | None:
        """Where ``tensor``'s exact bytes lie in a checkpoint file, for the engine's disk tier (offload/disk.py);
        None when it has none (drawn at random, converted on load, stored in another dtype). ``tensor`` is
        looked up as itself, else by ``name`` (a model built apart for an estimate)."""
        return None

    def _names_of(self, name: str, tensor: torch.Tensor) -> list[str]:
        return self.names.get(id(tensor), [name])


class SafetensorsSource(WeightSource):
    """Tensors from safetensors files (one file, or the shards named by ``model.safetensors.index.json``)."""

    kind = "safetensors"

    def __init__(self, model: nn.Module, entries: dict[str, StoredTensor], threads: int = 8) -> None:
        super().__init__(model)
        self.entries = entries
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ferry-load")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    @classmethod
    def from_files(cls, model: nn.Module, files: list[Path]) -> SafetensorsSource:
        """The tensors of these files, by their stored names."""
        entries: dict[str, StoredTensor] = {}
        for path in files:
            entries.update(read_safetensors_header(path))
        return cls(model, entries)

    @classmethod
    def from_directory(cls, model: nn.Module, directory: Path) -> SafetensorsSource:
        """The checkpoint of a Hugging Face model directory: sharded (with an index) or a single file."""
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return cls.from_files(model, [directory / shard for shard in shards])
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model.path {directory} has no *.safetensors weights; set model.init: random to train")
        return cls.from_files(model, files)

    def fill(self, name: str, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self.read_into(self._entry_of(name, tensor), host)

    def file_range(self, name: str, tensor: torch.Tensor) -> FileRange | None:
        key = next((n for n in self._names_of(name, tensor) if n in self.entries), None)
        return stored_range(self.entries[key], tensor) if key is not None else None

    def dense(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        entry = self._entry_of(name, tensor)
        with self._lock:
            self.bytes += entry.end - entry.start
        return read_stored(entry).to(tensor.dtype)  # in the calling (loader) thread

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append(self._pool.submit(work))

    def _entry_of(self, name: str, tensor: torch.Tensor) -> StoredTensor:
        key = next((n for n in self.names.get(id(tensor), [name]) if n in self.entries), None)
        if key is None:
            if not isinstance(tensor, nn.Parameter):  # a buffer the checkpoint does not store
                raise ValueError(f"{name!r} is a meta buffer absent from the checkpoint")
            raise ValueError(f"the checkpoint has no tensor {self.names.get(id(tensor), [name])[0]!r}")
        entry = self.entries[key]
        if list(entry.shape) != list(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {key!r} has shape {list(entry.shape)}; the model expects {list(tensor.shape)}"
            )
        if entry.dtype_name not in SAFETENSORS_DTYPES:
            raise ValueError(f"{entry.file}: tensor {key!r} has dtype {entry.dtype_name}, which Ferry cannot load")
        return entry

    def read_into(self, entry: StoredTensor, host: torch.Tensor) -> None:
        """Read ``entry`` into ``host`` in a loader thread (``finish`` waits for it)."""
        self.bytes += host.numel() * host.element_size()
        self.submit(lambda: _read_into(entry.file, entry.start, entry.end, entry.dtype, host))

    def finish(self) -> LoadReport:
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        self._pool.shutdown()
        return super().finish()


class SeededInitSource(WeightSource):
    """The built-in model's own init (``init(index, name, tensor)``), applied to each host copy in place."""

    kind = "seeded_init"

    def __init__(self, model: nn.Module, init: object) -> None:
        super().__init__(model)
        self.init = init

    def fill(self, name: str, tensor: torch.Tensor, host: torch.Tensor) -> None:
        key = id(tensor)
        with torch.no_grad():
            self.init(self.index[key], self.names[key][0], host)  # type: ignore[operator]
        self.bytes += host.numel() * host.element_size()


class RandomSource(WeightSource):
    """``model.init: random``: N(0, ``std``) matrices, ones for norm weights, zeros for biases (see module).

    A norm weight is one named ``*norm*.weight`` or one of a module whose class is a norm (Qwen2.5-VL's vision
    merger keeps its RMSNorm as ``ln_q``): zero there, it would zero everything after it."""

    kind = "random"

    def __init__(self, model: nn.Module, seed: int, std: float, device: torch.device) -> None:
        super().__init__(model)
        self.seed, self.std = seed, std
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.norm_weights = {
            id(module.weight)
            for module in model.modules()
            if "norm" in type(module).__name__.lower() and isinstance(getattr(module, "weight", None), torch.Tensor)
        }

    def fill(self, name: str, tensor: torch.Tensor, host: torch.Tensor) -> None:
        self.bytes += host.numel() * host.element_size()
        first = self.names.get(id(tensor), [name])[0]
        if host.dim() < 2:  # norms, biases
            norm = id(tensor) in self.norm_weights or "norm" in first
            host.fill_(1.0 if norm and first.endswith("weight") else 0.0)
            return
        flat = host.view(-1) if host.is_contiguous() else host.reshape(-1)
        for chunk, start in enumerate(range(0, flat.numel(), CHUNK_ELEMENTS)):
            n = min(CHUNK_ELEMENTS, flat.numel() - start)
            seed = (self.seed * 1_000_003 + self.index.get(id(tensor), 0)) * 100_003 + chunk
            generator = torch.Generator(self.device).manual_seed(seed)
            values = torch.randn(n, generator=generator, device=self.device, dtype=host.dtype).mul_(self.std)
            # Device -> pinned host on the current stream; finish() synchronizes once for all of them.
            flat[start : start + n].copy_(values, non_blocking=self.device.type == "cuda")

    def dense(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        values = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)  # drawn where it is quantized
        self.fill(name, tensor, values)
        return values

    def finish(self) -> LoadReport:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a sync point: every random chunk has landed in pinned memory
        return super().finish()


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, from its header: where its bytes lie and what they hold."""

    file: Path
    key: str
    dtype_name: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.dtype_name]


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """safetensors' header: 8 bytes of little-endian length, then JSON of dtype, shape and byte offsets."""
    with path.open("rb") as handle:
        head = handle.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 0 < length <= MAX_HEADER_BYTES:
            raise ValueError(f"{path.name} is not a safetensors file (no valid header length)")
        try:
            header = json.loads(handle.read(length))
        except ValueError as error:
            raise ValueError(f"{path.name} is not a safetensors file (its header is not JSON: {error})") from None
    base = 8 + length
    entries = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        entries[key] = StoredTensor(path, key, entry["dtype"], tuple(entry["shape"]), base + start, base + end)
    return entries


def stored_range(entry: StoredTensor, tensor: torch.Tensor) -> FileRange | None:
    """``entry``'s bytes as ``tensor``'s, when they are exactly its bytes (same dtype and shape)."""
    if entry.dtype_name not in SAFETENSORS_DTYPES or entry.dtype != tensor.dtype:
        return None
    if tuple(entry.shape) != tuple(tensor.shape):
        return None
    return FileRange(entry.file, entry.start, entry.end)


def read_stored(entry: StoredTensor) -> torch.Tensor:
    """One stored tensor as a CPU tensor of its stored dtype (for conversions; plain tensors are read in place)."""
    target = torch.empty(entry.shape, dtype=entry.dtype)
    _read_into(entry.file, entry.start, entry.end, entry.dtype, target)
    return target


def _read_into(path: Path, start: int, end: int, dtype: torch.dtype, host: torch.Tensor) -> None:
    """Read bytes [start, end) of ``path`` into ``host`` (pinned): directly when the dtype matches, else
    through one temporary of the stored dtype. os.preadv releases the GIL, so threads read in parallel."""
    if not host.is_contiguous():
        raise ValueError("a host copy to load into must be contiguous")
    direct = dtype == host.dtype
    target = host if direct else torch.empty(host.shape, dtype=dtype)
    buffer = memoryview(target.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a Buffer
    if len(buffer) != end - start:
        raise ValueError(f"{path}: a tensor stores {end - start} bytes where {len(buffer)} were expected")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(buffer):
            read = os.preadv(fd, [buffer[done:]], start + done)
            if read <= 0:
                raise ValueError(f"{path} ends early: truncated checkpoint")
            done += read
    finally:
        os.close(fd)
    if not direct:
        host.copy_(target)
