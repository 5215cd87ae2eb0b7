"""``task: cache``: run the frozen encoders over a dataset once and write the cache (split training, stage 1).

DiffSynth-Studio's ``data_process`` task: the text encoder and the VAE encode every row under no_grad,
through the offload engine when model offload is on, and training then never loads them. Progress is
reported as ``cache_progress`` events (one step = one sample) with the samples per second.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Literal

import torch

from jobs.errors import Problem
from jobs.events import CacheProgressEvent, LogEvent, Report, StartedEvent, StopPoll
from jobs.models.diffusion.data.batches import encode_prompt
from jobs.models.diffusion.data.cache import (
    CacheWriter,
    data_fingerprint,
    differences,
    model_fingerprint,
    read_manifest,
)
from jobs.models.diffusion.data.images import image_size, load_pixels, read_rows, target_size
from jobs.models.diffusion.encode import Encoders
from jobs.reporting.telemetry import device_identity, memory_snapshot

log = logging.getLogger(__name__)
Status = Literal["succeeded", "paused", "cancelled"]


def cache_fingerprint(spec: Any) -> dict[str, Any]:
    """The fingerprint a cache job writes and expects: its encoders and its data settings."""
    return {**model_fingerprint(spec.model), **data_fingerprint(spec.data)}


def cache_target_problems(spec: Any) -> list[Problem]:
    """Submit-time check: ``cache.path`` holds nothing, or a cache of this job's own fingerprint."""
    found = read_manifest(spec.cache.path)
    if found is None:
        return []
    diff = differences(found.get("fingerprint", {}), cache_fingerprint(spec))
    if diff:
        return [
            (
                "cache.path",
                f"{spec.cache.path} holds a cache made with other settings ({'; '.join(diff)}); "
                "choose another cache.path, or delete that directory to rebuild it",
            )
        ]
    return []


def run_cache_job(
    spec: Any, *, device: torch.device, report: Report, should_stop: StopPoll | None
) -> tuple[Status, int]:
    """Write (or finish, or reuse) the cache of ``spec``; returns (status, samples in the cache).

    Each progress event carries the throughput so far and the seconds spent in each encoder
    (``text_encoder_s``, ``vae_s``; the device is synchronized around each, so they are honest).
    """
    writer = CacheWriter(Path(spec.cache.path), cache_fingerprint(spec), spec.cache.shard_samples)
    rows = read_rows(spec.data)
    report(
        StartedEvent(
            total_steps=len(rows),
            spec=spec.model_dump(mode="json"),
            resumed_from_step=writer.samples_done or None,
            device=device_identity(device),
        )
    )
    if writer.complete:
        message = f"cache {spec.cache.path} is complete with these settings ({writer.samples_done} samples); reused"
        log.info(message)
        report(LogEvent(level="info", message=message))
        return "succeeded", writer.samples_done
    encoders = Encoders.load(spec, device, with_text=True, with_vae=True)
    try:
        first = writer.samples_done
        seconds = {"text_encoder_s": 0.0, "vae_s": 0.0}
        started = time.perf_counter()
        for done, row in enumerate(rows[first:], start=first + 1):
            request = should_stop() if should_stop is not None else None
            if request is not None:
                writer.flush()  # whole shards survive; the next run continues after them
                return ("paused" if request == "pause" else "cancelled"), writer.samples_done
            size = target_size(*image_size(row), spec.data.max_pixels)
            pixels = load_pixels(row, size, spec.data.num_frames).unsqueeze(0)
            latents = _timed(seconds, "vae_s", encoders.encode_pixels, pixels)[0]
            embeds = _timed(seconds, "text_encoder_s", encode_prompt, row.prompt, spec.data, encoders)
            described = {"source_row": row.index, "media": row.media.name, "prompt": row.prompt}
            if row.repeats > 1:
                described["repeats"] = row.repeats
            writer.add(latents, embeds[0], described, pooled=embeds[1] if len(embeds) > 1 else None)
            elapsed = time.perf_counter() - started
            rate = (done - first) / max(elapsed, 1e-9)
            report(
                CacheProgressEvent(
                    step=done,
                    total_steps=len(rows),
                    samples_per_s=rate,
                    elapsed_s=elapsed,
                    eta_s=(len(rows) - done) / rate,
                    **seconds,
                    **memory_snapshot(device),
                )
            )
        empty = encode_prompt("", spec.data, encoders)  # what caption dropout trains with
        writer.finish(dict(zip(("prompt_embeds", "pooled_prompt_embeds"), empty, strict=False)))
    finally:
        encoders.close()
    return "succeeded", writer.samples_done


def _timed(seconds: dict[str, float], key: str, work: Any, *args: Any) -> Any:
    start = time.perf_counter()
    result = work(*args)  # the result is on the CPU: its copy back synchronized the device
    seconds[key] += time.perf_counter() - start
    return result
