"""DPO's reference log-probs on a full fine-tune: one pass of the initial model before training, cached.

Without LoRA there is no frozen base to switch the policy back to, and a second copy of the model would double
what the job holds and streams. So before the first step the initial model computes, without gradient and batch
by batch (through the offload engine when the model is offloaded), each pair's summed log-probs of its chosen and
its rejected completion tokens, as TRL's ``precompute_ref_log_probs`` does. Training reads them from the batch
(``reference_logps``): the data carries them by each pair's place, through the shuffle and into a rank's rows.

The tables go to ``<output>/cache/reference-logps-<key>.safetensors``, ``<key>`` a digest of their fingerprint:
the model (its spec section: path, dtype, quantize; and its files: config bytes, weight files' names, sizes and
modification times), the mixed precision the forward runs in, the tokenizer, chat template and ``seq_len``, and
the pairs' tokens in order, which the data files' content, the template, the truncation, the mix and the split
decide. A job whose fingerprint finds its file intact reuses it; a changed input has another key and is computed
afresh. A file is written under a temporary name and renamed (a reader finds all of it or nothing) and holds the
SHA-256 of its tensors: a truncated or damaged file is computed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from jobs.checkpoints.directory import files_identity
from jobs.data.formats.preference import PreferenceBatches, PreferencePair, collate_pairs
from jobs.distributed.group import RankGroup, current_group, leads
from jobs.events import LogEvent, Report
from jobs.objectives.preference import sequence_logps
from jobs.spec.job import JobSpec, TextDataSpec

if TYPE_CHECKING:
    from jobs.train.session import TrainingSession

log = logging.getLogger(__name__)

FORMAT = 1
CACHE_DIR = "cache"  # under the job's output directory, when the job is given no shared cache directory
Tables = dict[str, torch.Tensor]  # "train" (and "eval"): [pairs, 2], chosen then rejected, float32


def needs_reference_pass(spec: JobSpec) -> bool:
    """DPO on a full fine-tune: the reference is the initial model, computed before training."""
    return spec.training.objective == "dpo" and spec.lora is None


def prepare_reference_logps(
    session: TrainingSession, spec: JobSpec, output_dir: Path, report: Report, *, cache_dir: Path | str | None = None
) -> None:
    """Give the session's preference data (train, and eval if any) the initial model's log-probs: from the cache
    when this job's file is intact, else from a pass over the pairs, then written to the cache.

    Call it after `open_session`, before the first step. A resumed job reads the file its first attempt wrote
    before its first step: its model already holds a checkpoint's weights, which are no longer the reference.

    Raises:
        ValueError: a resumed job whose cache file is missing or damaged, naming the way out.

    Example:
        >>> session = open_session(spec, output_dir, resume=True)
        >>> prepare_reference_logps(session, spec, output_dir, report)  # then train
    """
    text = session.text
    assert text is not None and isinstance(text.train, PreferenceBatches)  # rules: dpo trains on preference data
    sources: dict[str, PreferenceBatches] = {"train": text.train}
    if text.eval is not None:
        assert isinstance(text.eval, PreferenceBatches)  # the eval split of preference data is pairs too
        sources["eval"] = text.eval
    sizes = {name: len(source.pairs) for name, source in sources.items()}
    fingerprint = reference_fingerprint(spec, {name: source.pairs for name, source in sources.items()})
    # A directory shared by jobs (the service's) lets a later job with the same inputs reuse the file: its name
    # is the key of everything the values depend on.
    file = cache_file(Path(cache_dir) if cache_dir is not None else Path(output_dir) / CACHE_DIR, fingerprint)
    where, pairs = (file.relative_to(output_dir) if file.is_relative_to(output_dir) else file), sum(sizes.values())
    group = current_group()  # data parallelism: rank 0 reads and writes; the ranks share the pass and the tables
    tables, problem = read_tables(file, fingerprint, sizes) if leads() else (None, None)
    found = group.agree(tables is not None) if group is not None else tables is not None
    started = time.perf_counter()
    if found:
        report(LogEvent(message=f"reference log-probs: reused {where} ({pairs} pairs; same model, data and settings)"))
    else:
        if session.resumed_from is not None:
            raise ValueError(_resume_problem(where, problem, session.resumed_from.step))
        if problem is not None:
            report(LogEvent(level="warning", message=f"reference log-probs: {where} {problem}; computing them again"))
        report(LogEvent(message=f"reference log-probs: computing {pairs} pairs with the initial model"))
        share = (group.rank, group.world_size) if group is not None else (0, 1)
        tables = {
            name: _pass_over(session, source, spec.training.batch_size, share) for name, source in sources.items()
        }
    if group is not None:
        tables = _gathered(tables, sizes, group)
    assert tables is not None
    if not found:
        if leads():
            write_tables(file, tables, fingerprint)
        seconds = time.perf_counter() - started
        report(LogEvent(message=f"reference log-probs: {pairs} pairs computed in {seconds:.1f} s, cached at {where}"))
    for name, source in sources.items():
        source.use_reference(tables[name])


def _pass_over(
    session: TrainingSession, source: PreferenceBatches, batch_size: int, share: tuple[int, int]
) -> torch.Tensor:
    return reference_pass(
        session.forward_model,
        source.pairs,
        batch_size=batch_size,
        pad_id=source.pad_id,
        accelerator=session.accelerator,
        device=session.device,
        share=share,
    )


def reference_pass(
    model: nn.Module,
    pairs: list[PreferencePair],
    *,
    batch_size: int,
    pad_id: int,
    accelerator: Any,
    device: torch.device,
    share: tuple[int, int] = (0, 1),
) -> torch.Tensor:
    """``[len(pairs), 2]``: each pair's summed log-probs of its chosen and its rejected completion tokens under
    ``model``, in batches of ``batch_size`` pairs in stored order, without gradient, in eval mode (the reference
    is frozen: no dropout), under the accelerator's autocast as the training forward runs.

    ``share`` (rank, ranks) computes every ``ranks``-th batch from ``rank`` and leaves the other rows zero.
    """
    rank, ranks = share
    table = torch.zeros(len(pairs), 2, device=device)  # filled on the device: no sync point per batch
    starts = range(0, len(pairs), batch_size)[rank::ranks]
    every = max(1, len(starts) // 10)
    model.eval()
    try:
        with torch.no_grad():
            for done, start in enumerate(starts, 1):
                batch = collate_pairs(pairs[start : start + batch_size], pad_id)
                batch = {name: tensor.to(device) for name, tensor in batch.items()}
                with accelerator.autocast():
                    logps, _ = sequence_logps(model, batch, batch["labels"])
                chosen, rejected = logps.float().chunk(2)
                table[start : start + chosen.shape[0]] = torch.stack([chosen, rejected], dim=1)
                if done % every == 0:
                    log.info("reference log-probs: %d of %d batches", done, len(starts))
    finally:
        model.train()
    return table.cpu()  # CPU-GPU sync point: once per pass


def reference_fingerprint(spec: JobSpec, pairs: dict[str, list[PreferencePair]]) -> dict[str, Any]:
    """What the reference log-probs depend on (see the module docstring), as plain JSON values."""
    model, data = spec.model, spec.data
    assert isinstance(data, TextDataSpec)  # rules: dpo trains on preference text data
    path = getattr(model, "path", None)
    from_files = path is not None and getattr(model, "init", "checkpoint") == "checkpoint"
    return {
        "format": FORMAT,
        "model": model.model_dump(mode="json"),
        # Weights drawn from the seed (init: random, or a model without files) depend on it instead.
        "weights": files_identity(Path(path), modification_times=True)
        if path is not None and from_files
        else f"seed {spec.training.seed}",
        "mixed_precision": spec.training.mixed_precision,
        "tokenizer": data.tokenizer.model_dump(mode="json"),
        "chat_template": data.chat_template,
        "seq_len": data.seq_len,
        **{f"{name}_pairs": _pairs_sha256(found) for name, found in pairs.items()},
    }


def cache_file(directory: Path, fingerprint: dict[str, Any]) -> Path:
    """The cache file of ``fingerprint`` in ``directory``."""
    key = hashlib.sha256(_canonical(fingerprint).encode()).hexdigest()[:16]
    return Path(directory) / f"reference-logps-{key}.safetensors"


def read_tables(file: Path, fingerprint: dict[str, Any], sizes: dict[str, int]) -> tuple[Tables | None, str | None]:
    """The tables in ``file`` if it is intact and made for ``fingerprint``; else None and why (None: no file)."""
    if not file.is_file():
        return None, None
    try:
        with safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata() or {}
            names = handle.keys()  # safetensors' handle is not a mapping: no iteration over it
            tables = {name: handle.get_tensor(name) for name in names}
    except (OSError, SafetensorError, ValueError) as error:  # truncated, or not safetensors at all
        return None, f"is unreadable ({type(error).__name__}: {error})"
    if metadata.get("fingerprint") != _canonical(fingerprint):
        return None, "was made from other inputs"
    if metadata.get("sha256") != _tables_sha256(tables):
        return None, "is damaged (its tensors do not match their SHA-256)"
    if {name: tuple(t.shape) for name, t in tables.items()} != {name: (size, 2) for name, size in sizes.items()}:
        return None, "holds tables of other sizes than this job's pairs"
    return tables, None


def write_tables(file: Path, tables: Tables, fingerprint: dict[str, Any]) -> None:
    """Write ``tables`` to ``file`` atomically: under a temporary name, then renamed over it."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: table.float().contiguous() for name, table in tables.items()}
    metadata = {"fingerprint": _canonical(fingerprint), "sha256": _tables_sha256(tensors)}
    temporary = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    save_file(tensors, str(temporary), metadata=metadata)
    os.replace(temporary, file)  # atomic: a reader (a later job) finds the old file, the new one or none


def _gathered(tables: Tables | None, sizes: dict[str, int], group: RankGroup) -> Tables:
    """Every rank's rows summed into whole tables on every rank (rank 0's alone when it read the file): each
    rank filled its share of the rows and left the others zero."""
    whole = {}
    for name, size in sizes.items():
        table = (tables or {}).get(name, torch.zeros(size, 2)).to(group.device)  # NCCL reduces CUDA tensors
        dist.all_reduce(table)  # every rank, the same tables in the same order
        whole[name] = table.cpu()
    return whole


def _resume_problem(where: Path, problem: str | None, step: int) -> str:
    state = "is missing" if problem is None else problem
    return (
        f"training.objective: dpo without lora resumes with the reference log-probs cached before its first step, "
        f"but {where} {state}, and the model now holds checkpoint step {step}'s weights, no longer the reference; "
        "restore the file, or submit the job again into a new output directory to compute them afresh"
    )


def _pairs_sha256(pairs: list[PreferencePair]) -> str:
    """SHA-256 over the pairs' token ids, in order, each list prefixed by its length."""
    digest = hashlib.sha256()
    for pair in pairs:
        for ids in (pair.prompt, pair.chosen, pair.rejected):
            digest.update(len(ids).to_bytes(4, "little"))
            digest.update(array("q", ids).tobytes())
    return digest.hexdigest()


def _tables_sha256(tables: Tables) -> str:
    digest = hashlib.sha256()
    for name in sorted(tables):
        digest.update(name.encode() + tables[name].float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
