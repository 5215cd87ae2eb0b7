"""The encoder cache of split training: latents and prompt embeddings as safetensors shards + a manifest.

Layout of a cache directory::

    manifest.json           format, fingerprint, complete, and per shard: file, bytes, sha256 and its rows
    shard-00000.safetensors "<n>.latents" [C, F, h, w] float32, "<n>.prompt_embeds" [tokens, dim]
                            (Flux.1: and "<n>.pooled_prompt_embeds" [dim], CLIP-L's pooled output)
    empty-prompt.safetensors the empty caption's "prompt_embeds" (and "pooled_prompt_embeds"), which caption
                            dropout trains with

The fingerprint records what the tensors depend on: the encoders (their configs, weight files and
dtypes) and the data settings. A cache job finds a complete cache with its own fingerprint and reuses it;
finds a partial one (a crash, a restart) and continues after its last whole shard; and refuses one with
another fingerprint. A training job refuses a cache whose encoders differ from its model's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jobs.checkpoints.directory import file_sha256, files_identity
from jobs.models.diffusion.variants import family_of

MANIFEST = "manifest.json"
FORMAT = 1
# Fingerprint keys a training job compares with its own model (the rest describe the data).
MODEL_KEYS = ("family", "text_encoder", "pooled_text_encoder", "vae", "text_encoder_dtype", "vae_dtype", "init")
EMPTY_PROMPT = "empty-prompt.safetensors"


def model_fingerprint(model: Any) -> dict[str, Any]:
    """What the encoders' outputs depend on: family, their config and weight files, dtypes, init."""
    path = Path(model.path)
    family = family_of(path)
    fingerprint = {
        "family": family.name,
        "text_encoder": files_identity(path / family.text_encoder_folder),
        "vae": files_identity(path / "vae"),
        "text_encoder_dtype": model.text_encoder_dtype or model.dtype,
        "vae_dtype": model.vae_dtype,
        "init": model.init,
    }
    if family.pooled_encoder is not None:  # only where there is one: older caches' fingerprints stay equal
        fingerprint["pooled_text_encoder"] = files_identity(path / family.pooled_encoder.folder)
    return fingerprint


def data_fingerprint(data: Any) -> dict[str, Any]:
    """What the samples depend on: the metadata file's content (or, for caption folders, every image's path and
    caption), the resize and prompt settings, and the trigger word where one is set."""
    from jobs.models.diffusion.data.captions import captions_sha256
    from jobs.models.diffusion.data.images import metadata_file, uses_caption_files

    fingerprint = {
        "metadata_sha256": captions_sha256(data) if uses_caption_files(data) else file_sha256(metadata_file(data)),
        "max_pixels": data.max_pixels,
        "num_frames": data.num_frames,
        "max_sequence_length": data.max_sequence_length,
    }
    if data.trigger_word:  # only where set: older caches' fingerprints stay equal
        fingerprint["trigger_word"] = data.trigger_word
    return fingerprint


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The cache's manifest, or None where there is none (or it is unreadable)."""
    try:
        return json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def differences(have: dict[str, Any], want: dict[str, Any], keys: tuple[str, ...] | None = None) -> list[str]:
    """The fingerprint keys whose values differ, as ``key: cache has X, this job Y``."""
    names = keys or tuple(sorted(set(have) | set(want)))
    return [f"{k}: cache has {have.get(k)!r}, this job {want.get(k)!r}" for k in names if have.get(k) != want.get(k)]


def cache_problems_for_training(directory: Path, model: Any, caption_dropout: float = 0.0) -> list[str]:
    """Why a training job cannot use the cache at ``directory`` (empty when it can)."""
    manifest = read_manifest(directory)
    if manifest is None:
        return [f"{directory} holds no {MANIFEST}; run a task: cache job with cache.path: {directory} first"]
    if not manifest.get("complete"):
        return [
            f"the cache at {directory} is incomplete ({manifest.get('samples', 0)} samples so far); let its task: cache job finish"
        ]
    diff = differences(manifest["fingerprint"], model_fingerprint(model), MODEL_KEYS)
    if diff:
        return [
            f"the cache at {directory} was made with other encoders than model.path's ({'; '.join(diff)}); re-run the cache job with this model"
        ]
    if caption_dropout and not manifest.get("empty_prompt"):
        return [
            f"data.caption_dropout needs the empty caption's embedding, which the cache at {directory} lacks "
            "(written by an older cache job); re-run the cache job into a new cache.path"
        ]
    return []


class CacheWriter:
    """Appends samples to a cache directory shard by shard; the manifest is rewritten after each shard."""

    def __init__(self, directory: Path, fingerprint: dict[str, Any], shard_samples: int) -> None:
        self.directory, self.fingerprint, self.shard_samples = Path(directory), fingerprint, shard_samples
        self.directory.mkdir(parents=True, exist_ok=True)
        found = read_manifest(self.directory)
        self.shards: list[dict[str, Any]] = []
        if found is not None and found.get("fingerprint") == fingerprint:
            self.shards = [s for s in found["shards"] if _shard_intact(self.directory, s)]
        same = found is not None and found.get("fingerprint") == fingerprint
        self.complete = bool(same and found and found.get("complete") and len(self.shards) == len(found["shards"]))
        self._tensors: dict[str, torch.Tensor] = {}
        self._rows: list[dict[str, Any]] = []

    @property
    def samples_done(self) -> int:
        return sum(len(s["rows"]) for s in self.shards)

    def add(
        self,
        latents: torch.Tensor,
        prompt_embeds: torch.Tensor,
        row: dict[str, Any],
        pooled: torch.Tensor | None = None,
    ) -> None:
        """Add one sample; a full shard is written at once."""
        n = len(self._rows)
        self._tensors[f"{n}.latents"] = latents.contiguous()
        self._tensors[f"{n}.prompt_embeds"] = prompt_embeds.contiguous()
        if pooled is not None:
            self._tensors[f"{n}.pooled_prompt_embeds"] = pooled.contiguous()
        self._rows.append({**row, "latents_shape": list(latents.shape), "prompt_tokens": prompt_embeds.shape[0]})
        if len(self._rows) == self.shard_samples:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file(self._tensors, str(self.directory / name))
        file = self.directory / name
        self.shards.append(
            {"file": name, "bytes": file.stat().st_size, "sha256": file_sha256(file), "rows": self._rows}
        )
        self._tensors, self._rows = {}, []
        self._write_manifest(complete=False)

    def finish(self, empty_prompt: dict[str, torch.Tensor] | None = None) -> None:
        """Write the last shard, the empty caption's embedding (for caption dropout), and the complete manifest."""
        self.flush()
        if empty_prompt is not None:
            save_file({k: v.contiguous() for k, v in empty_prompt.items()}, str(self.directory / EMPTY_PROMPT))
        self._write_manifest(complete=True, empty_prompt=empty_prompt is not None)
        self.complete = True

    def _write_manifest(self, *, complete: bool, empty_prompt: bool = False) -> None:
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "complete": complete,
            "samples": self.samples_done,
            "shards": self.shards,
        }
        if empty_prompt:
            manifest["empty_prompt"] = EMPTY_PROMPT
        tmp = self.directory / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.directory / MANIFEST)  # atomic: a reader sees the old or the new manifest


def _shard_intact(directory: Path, shard: dict[str, Any]) -> bool:
    file = directory / shard["file"]
    return file.is_file() and file.stat().st_size == shard["bytes"] and file_sha256(file) == shard["sha256"]


class CachedSamples:
    """Random access to a complete cache's samples; shards are checked against the manifest on open."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None or not manifest.get("complete"):
            raise ValueError(f"{self.directory} holds no complete cache; run its task: cache job first")
        damaged = [s["file"] for s in manifest["shards"] if not _shard_intact(self.directory, s)]
        if damaged:
            raise ValueError(f"cache {self.directory}: {damaged} do not match manifest.json; re-run the cache job")
        self.manifest = manifest
        self._where = [(s["file"], local) for s in manifest["shards"] for local in range(len(s["rows"]))]
        self.rows = [row for s in manifest["shards"] for row in s["rows"]]
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._where)

    def latent_shape(self, index: int) -> tuple[int, ...]:
        return tuple(self.rows[index]["latents_shape"])

    def repeats(self, index: int) -> int:
        """How often sample ``index`` is served per epoch (a caption folder's ``N_name`` prefix)."""
        return int(self.rows[index].get("repeats", 1))

    def sample(self, index: int) -> tuple[torch.Tensor, ...]:
        """(latents, prompt embeddings[, pooled prompt embedding]) of sample ``index`` (CPU)."""
        file, local = self._where[index]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(self.directory / file), framework="pt")
        found = [handle.get_tensor(f"{local}.latents"), handle.get_tensor(f"{local}.prompt_embeds")]
        if f"{local}.pooled_prompt_embeds" in set(handle.keys()):
            found.append(handle.get_tensor(f"{local}.pooled_prompt_embeds"))
        return tuple(found)

    def empty_prompt(self) -> tuple[torch.Tensor, ...] | None:
        """The empty caption's (prompt embeddings[, pooled]), or None in a cache written without it."""
        if not self.manifest.get("empty_prompt"):
            return None
        with safe_open(str(self.directory / self.manifest["empty_prompt"]), framework="pt") as handle:
            embeds = [handle.get_tensor("prompt_embeds")]
            if "pooled_prompt_embeds" in set(handle.keys()):
                embeds.append(handle.get_tensor("pooled_prompt_embeds"))
        return tuple(embeds)
