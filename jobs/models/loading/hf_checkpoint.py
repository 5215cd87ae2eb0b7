"""What a Hugging Face checkpoint means, taken from transformers' own loading machinery.

``from_pretrained`` does more than match names: transformers 5 renames keys (``block_sparse_moe`` →
``mlp``, ``embed_out`` → ``lm_head``), fuses or splits tensors (per-expert MoE weights into one
``experts.gate_up_proj``), adds or strips the base model's prefix, ties the output head to the input
embedding, and ignores keys a class declares optional. The offload path does not call ``from_pretrained``
(it would build the whole model in ordinary memory first), so it asks transformers for the same mapping:
``get_model_conversion_mapping`` gives the model's renamings and converters, ``rename_source_key`` applies
them to each stored key exactly as loading does, and a converter's own ``convert`` produces the fused
tensors. Nothing here is a table of architectures: a new one in a new transformers release loads as
transformers loads it.

`CheckpointPlan` is computed from the safetensors headers alone (no tensor is read), so the same plan
checks a job at submit time (missing, unexpected and misshapen tensors, named with their file) and fills
the engine's pinned copies at run time (`PlannedSource`): a plain rename is read straight into the pinned
copy; a converted tensor is read, converted and copied.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from jobs.models.loading.weight_sources import (
    SAFETENSORS_DTYPES,
    LoadReport,
    SafetensorsSource,
    StoredTensor,
    WeightSource,
    read_safetensors_header,
    read_stored,
    stored_range,
)
from offload.disk import FileRange

INDEX_NAME = "model.safetensors.index.json"
logger = logging.getLogger(__name__)


class CheckpointCannotStream(Exception):
    """The checkpoint is valid for ``from_pretrained`` but cannot be read tensor by tensor into pinned memory
    (not safetensors, or this transformers has no public conversion machinery): load it whole instead."""


@dataclass(frozen=True)
class CheckpointProblem:
    """Something ``from_pretrained`` would load wrongly or not at all, with the tensor and file it concerns.

    ``kind``: ``unexpected`` (a stored tensor the renamings place nowhere in the model), ``missing`` (a model
    tensor no stored one fills), or ``file`` (a shard, shape or dtype that cannot load).
    """

    tensor: str
    file: str
    message: str
    kind: Literal["unexpected", "missing", "file"] = "file"

    def __str__(self) -> str:
        return f"{self.tensor} ({self.file}): {self.message}"


def stored_tensors(directory: Path) -> tuple[dict[str, StoredTensor], list[CheckpointProblem]]:
    """Every tensor of a model directory's safetensors: the shards its index names, or its ``*.safetensors``.

    Raises:
        CheckpointCannotStream: the directory holds weights, but not as safetensors.
        ValueError: the directory holds no weights at all.
    """
    index = directory / INDEX_NAME
    problems: list[CheckpointProblem] = []
    tensors: dict[str, StoredTensor] = {}
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{INDEX_NAME} in {directory} is not a safetensors index ({error!r})") from None
        headers: dict[str, dict[str, StoredTensor]] = {}
        for shard in sorted(set(weight_map.values())):
            path = directory / shard
            if not path.is_file():
                problems.append(CheckpointProblem("*", shard, f"{INDEX_NAME} names this shard; it is not there"))
                continue
            headers[shard] = read_safetensors_header(path)
        for key, shard in weight_map.items():
            if shard not in headers:
                continue
            if key not in headers[shard]:
                problems.append(
                    CheckpointProblem(key, shard, f"{INDEX_NAME} lists this tensor in {shard}, which does not hold it")
                )
                continue
            tensors[key] = headers[shard][key]
        return tensors, problems
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
            raise CheckpointCannotStream(f"{directory} holds PyTorch pickles, not safetensors")
        raise ValueError(f"model.path {directory} has no *.safetensors weights; set model.init: random to train")
    for path in files:
        tensors.update(read_safetensors_header(path))
    return tensors, problems


def _conversion_machinery() -> Any:
    try:
        from transformers import conversion_mapping, core_model_loading
    except ImportError:  # transformers < 5: no key conversions exist, but neither does this API
        return None
    return conversion_mapping, core_model_loading


@dataclass
class _Converted:
    """The stored tensors one converter turns into one or more of the model's tensors (e.g. 8 experts'
    gate and up projections into one ``experts.gate_up_proj``)."""

    converter: Any
    first_target: str
    sources: list[StoredTensor] = field(default_factory=list)

    def targets(self) -> list[str]:
        first = self.converter.target_patterns[0]
        return [self.first_target.replace(first, t) for t in self.converter.target_patterns]


class CheckpointPlan:
    """For every tensor of ``model`` (built on the meta device), where ``from_pretrained`` would take it from.

    Args:
        model: a transformers ``PreTrainedModel`` on the meta device, its weights tied (``tie_weights()``).
        stored: the checkpoint's tensors (`stored_tensors`).

    Attributes:
        direct: model tensor name → the stored tensor it is (after renames only).
        converted: model tensor name → the converter group that produces it.
        problems: missing, unexpected and misshapen tensors, each with its file.
    """

    def __init__(self, model: nn.Module, stored: dict[str, StoredTensor]) -> None:
        machinery = _conversion_machinery()
        if machinery is None:
            raise CheckpointCannotStream("this transformers has no weight conversion API (transformers < 5)")
        conversion_mapping, core = machinery
        self.model = model
        self.direct: dict[str, StoredTensor] = {}
        self.converted: dict[str, _Converted] = {}
        self.problems: list[CheckpointProblem] = []
        transforms = conversion_mapping.get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, core.WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, core.WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        meta = model.state_dict()
        prefix = getattr(model, "base_model_prefix", None) or None
        ignored_unexpected = _patterns(getattr(model, "_keys_to_ignore_on_load_unexpected", None))
        groups: dict[str, _Converted] = {}
        # transformers sorts keys naturally before collecting them: a converter stacks experts in that order.
        for key in sorted(stored, key=core.dot_natural_key):
            entry = stored[key]
            target, pattern = core.rename_source_key(key, renamings, converters, prefix, meta)
            if target not in meta and key in meta:  # as loading does: keep the key, adjusting only the prefix
                target, pattern = core.rename_source_key(key, [], [], prefix, meta)
            if target not in meta:
                if not any(p.search(key) for p in ignored_unexpected):
                    self.problems.append(
                        CheckpointProblem(
                            key, entry.file.name, "the model has no such tensor (unexpected)", "unexpected"
                        )
                    )
                continue
            if entry.dtype_name not in SAFETENSORS_DTYPES:
                self.problems.append(
                    CheckpointProblem(
                        key,
                        entry.file.name,
                        f"dtype {entry.dtype_name} cannot be loaded into "
                        f"{meta[target].dtype}; convert the checkpoint to bf16/fp16/fp32 safetensors",
                    )
                )
                continue
            if pattern is None:
                if tuple(meta[target].shape) != entry.shape:
                    self.problems.append(
                        CheckpointProblem(
                            key,
                            entry.file.name,
                            f"shape {list(entry.shape)} where the model's "
                            f"{target} has {list(meta[target].shape)} (config.json and the weights "
                            "disagree)",
                        )
                    )
                    continue
                self.direct.setdefault(target, entry)
                continue
            group = groups.get(target)
            if group is None:
                group = groups[target] = _Converted(deepcopy(by_pattern[pattern]), target)
            group.converter.add_tensor(target, key, pattern, _reader(entry, meta[target].dtype))
            group.sources.append(entry)
        for group in groups.values():
            for target in group.targets():
                self.converted[target] = group
        self._tied = _tied_names(model)
        self.missing = [
            name
            for name in meta
            if name not in self.direct
            and name not in self.converted
            and self._tied.get(name) not in self.direct
            and self._tied.get(name) not in self.converted
        ]
        for name in self.missing:
            self.problems.append(
                CheckpointProblem(
                    name,
                    _weights_file_of(stored),
                    "the model needs this tensor; the checkpoint does "
                    "not have it (a missing or truncated shard, or a config.json of another model)",
                    "missing",
                )
            )
        self._realized: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def source_of(self, names: Iterable[str]) -> tuple[str, StoredTensor | _Converted] | None:
        """The first of a tensor's names (it has several when tied) that the checkpoint provides."""
        for name in names:
            for candidate in (name, self._tied.get(name)):
                if candidate in self.direct:
                    return candidate, self.direct[candidate]
                if candidate in self.converted:
                    return candidate, self.converted[candidate]
        return None

    def realize(self, name: str, group: _Converted) -> torch.Tensor:
        """``name``'s value, converted by its group (once: the group's other targets are kept until asked for)."""
        with self._lock:
            if name not in self._realized:
                values = group.converter.convert(group.first_target, model=self.model, config=self.model.config)
                for target, value in values.items():
                    self._realized[target] = value[0] if isinstance(value, list) else value
            return self._realized.pop(name)

    @property
    def converted_count(self) -> int:
        return len(self.converted)


def _reader(entry: StoredTensor, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        return read_stored(entry).to(dtype)

    return read


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Tied tensor → the tensor it is tied to (``lm_head.weight`` → ``model.embed_tokens.weight``), from the
    model itself: names that share one parameter object."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(tensor) in first:
            tied[name] = first[id(tensor)]
            tied.setdefault(first[id(tensor)], name)
        else:
            first[id(tensor)] = name
    return tied


def _patterns(keys: Any) -> list[re.Pattern[str]]:
    return [re.compile(k) for k in (keys or [])]


def _weights_file_of(stored: dict[str, StoredTensor]) -> str:
    files = {entry.file for entry in stored.values()}
    if not files:
        return "no weights"
    directory = next(iter(files)).parent
    return INDEX_NAME if (directory / INDEX_NAME).is_file() else ", ".join(sorted(f.name for f in files))


class PlannedSource(SafetensorsSource):
    """Fills the engine's pinned copies as ``from_pretrained`` would fill the model: stored tensors that are
    only renamed are read straight into their pinned copy in loader threads; converted ones (fused experts)
    are read, converted by transformers' converter, and copied."""

    kind = "safetensors"

    def __init__(self, model: nn.Module, plan: CheckpointPlan) -> None:
        super().__init__(model, {})
        self.plan = plan

    def fill(self, name: str, tensor: torch.Tensor, host: torch.Tensor) -> None:
        found = self.plan.source_of(self.names.get(id(tensor), [name]))
        if found is None:
            raise ValueError(f"the checkpoint has no tensor for {self.names.get(id(tensor), [name])[0]!r}")
        target, source = found
        if isinstance(source, StoredTensor):
            self.read_into(source, host)
            return
        host.copy_(self._converted(target, source, host.shape))
        self.bytes += host.numel() * host.element_size()

    def file_range(self, name: str, tensor: torch.Tensor) -> FileRange | None:
        """A tensor only renamed on load has its bytes in the file; a converted one (fused experts) does not."""
        found = self.plan.source_of(self._names_of(name, tensor))
        if found is None or not isinstance(found[1], StoredTensor):
            return None
        return stored_range(found[1], tensor)

    def dense(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        found = self.plan.source_of(self.names.get(id(tensor), [name]))
        if found is None:
            raise ValueError(f"the checkpoint has no tensor for {self.names.get(id(tensor), [name])[0]!r}")
        target, source = found
        if isinstance(source, StoredTensor):
            with self._lock:
                self.bytes += source.end - source.start
            return read_stored(source).to(tensor.dtype)  # in the calling (loader) thread
        value = self._converted(target, source, tensor.shape).to(tensor.dtype)
        with self._lock:
            self.bytes += value.numel() * value.element_size()
        return value

    def _converted(self, target: str, source: _Converted, shape: torch.Size) -> torch.Tensor:
        value = self.plan.realize(target, source)
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{target}: converted to shape {list(value.shape)}; the model expects {list(shape)}")
        return value


class PretrainedSource(WeightSource):
    """The fallback for checkpoints that cannot stream (PyTorch pickles, transformers < 5): the whole model
    loaded by ``from_pretrained`` in ordinary memory, each tensor copied into its pinned copy and dropped.
    Correct for anything transformers loads, at the cost of the model's size in extra host memory."""

    kind = "from_pretrained"

    def __init__(self, model: nn.Module, load: Callable[[], nn.Module]) -> None:
        super().__init__(model)
        self._load = load
        self._values: dict[str, torch.Tensor] | None = None

    def fill(self, name: str, tensor: torch.Tensor, host: torch.Tensor) -> None:
        if self._values is None:
            loaded = self._load()
            self._values = dict(loaded.state_dict(keep_vars=False))
        for candidate in self.names.get(id(tensor), [name]):
            if candidate in self._values:
                host.copy_(self._values[candidate])
                self.bytes += host.numel() * host.element_size()
                return
        raise ValueError(f"from_pretrained gave no tensor {name!r}")

    def finish(self) -> LoadReport:
        self._values = None
        return super().finish()


def checkpoint_problems(
    model: nn.Module, directory: Path, *, unmapped_loads_whole: bool = False
) -> list[CheckpointProblem]:
    """Every way the checkpoint in ``directory`` fails to fill ``model`` (meta, weights tied), from headers
    alone. Empty when it loads, or when it can only load whole (`CheckpointCannotStream`: no fault of the
    checkpoint's). ``unmapped_loads_whole``: stored names the renamings cannot place are no fault either
    (`unmapped_names`): `checkpoint_source` loads such a checkpoint whole."""
    try:
        stored, problems = stored_tensors(directory)
        named = {p.tensor for p in problems}  # a tensor the index promises is then also missing: say it once
        problems += [p for p in CheckpointPlan(model, stored).problems if p.tensor not in named]
    except CheckpointCannotStream:
        return []
    if unmapped_loads_whole and unmapped_names(problems):
        return [p for p in problems if p.kind == "file"]
    return problems


def unmapped_names(problems: list[CheckpointProblem]) -> bool:
    """Whether the problems are only names that transformers' renamings, as Ferry applies them, do not place: some
    stored tensor lands nowhere in the model (and model tensors then go unfilled), but no shard, shape or dtype is
    at fault. ``from_pretrained`` may still place them (a VLM whose class renames keys in code Ferry does not
    reach); a checkpoint that only lacks tensors (a truncated one) is not this."""
    kinds = {p.kind for p in problems}
    return "unexpected" in kinds and kinds <= {"unexpected", "missing"}


def checkpoint_source(
    model: nn.Module, directory: Path, load: Callable[[], nn.Module], *, unmapped_loads_whole: bool = False
) -> WeightSource:
    """The source that fills ``model`` (meta, weights tied) from ``directory`` as ``from_pretrained`` would:
    planned from the headers, or ``load`` (the whole ``from_pretrained``) where the checkpoint cannot stream,
    and, with ``unmapped_loads_whole``, where its names are `unmapped_names` (with a warning: never the wrong
    tensors, at the cost of the model's size in extra host memory).

    Raises:
        ValueError: the checkpoint cannot fill the model; every problem named with its tensor and file.
    """
    try:
        stored, problems = stored_tensors(directory)
        plan = CheckpointPlan(model, stored)
    except CheckpointCannotStream as why:
        logger.warning("%s: loading it whole with from_pretrained (it cannot stream into pinned memory)", why)
        return PretrainedSource(model, load)
    problems += plan.problems
    if unmapped_loads_whole and unmapped_names(problems):
        unexpected = [p.tensor for p in problems if p.kind == "unexpected"]
        logger.warning(
            "model.path %s: %d stored tensors (%s) map to no tensor of %s by transformers' renamings: loading it "
            "whole with from_pretrained, in ordinary memory first",
            directory,
            len(unexpected),
            ", ".join(unexpected[:3]),
            type(model).__name__,
        )
        return PretrainedSource(model, load)
    if problems:
        shown = "; ".join(str(p) for p in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"model.path {directory}: the checkpoint does not fit the model: {shown}{more}")
    return PlannedSource(model, plan)
