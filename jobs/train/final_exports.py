"""The spec's ``export:`` section, run once a job has trained to the end: its best checkpoint (lowest eval loss)
or else its last, written as the files other programs load, each reported as an ``export`` event.

The files go where the checkpoint routes look for them (``<output_dir>/exports/<checkpoint>-merged.tar``,
``<checkpoint>-<quant>.gguf`` with its ``.Modelfile``), each with a ``.sha256`` beside it, so
``GET /v1/jobs/{id}/checkpoints`` lists them and their download routes serve them without a second export.
"""

from __future__ import annotations

import logging
from pathlib import Path

from jobs.checkpoints.directory import EXPORTS_DIR, CheckpointInfo, best_checkpoint, file_sha256, list_checkpoints
from jobs.checkpoints.export import merge_note
from jobs.events import ExportEvent, FileDigest, LogEvent, Report
from jobs.spec.job import JobSpec

log = logging.getLogger(__name__)


def export_checkpoint_to_use(output_dir: Path) -> CheckpointInfo | None:
    """The best checkpoint when the job evaluated, else the newest; None when there is none."""
    checkpoints = list_checkpoints(output_dir)
    return best_checkpoint(checkpoints) or (checkpoints[-1] if checkpoints else None)


def write_final_exports(spec: JobSpec, output_dir: Path, report: Report) -> list[ExportEvent]:
    """Write every export ``spec.export`` asks for and report each; returns the events reported.

    An export an exporter refuses (a diverged checkpoint, a base model gone) is reported as an ``error`` log
    event naming ``export.<format>`` and the fix, and the job still succeeds: its checkpoints are kept, and
    the export can be made later from another one (``python -m jobs export``, the checkpoint routes).
    Nothing partial is left: each exporter writes atomically.

    Raises:
        ValueError: the job left no checkpoint to export (the rules at submit make that rare).
    """
    formats = spec.export.formats()
    if not formats:
        return []
    chosen = export_checkpoint_to_use(output_dir)
    if chosen is None:
        raise ValueError("export: the job saved no checkpoint to export; set checkpoint.save_final: true")
    checkpoint = Path(chosen.path)
    events = []
    for name in formats:
        try:
            written = _write(name, spec, checkpoint)
        except ValueError as error:  # refused (e.g. a diverged checkpoint): the training itself succeeded
            report(LogEvent(level="error", message=f"export.{name} not written: {error}"))
            continue
        files = [_digest(path, output_dir) for path in written]
        quant = spec.export.gguf.quant if name == "gguf" and spec.export.gguf is not None else None
        note = merge_note(spec.model_dump()) if name == "merged" else None
        event = ExportEvent(checkpoint=chosen.name, format=name, quant=quant, files=files, note=note)
        log.info("exported %s as %s: %s", chosen.name, name, ", ".join(f.name for f in files))
        report(event)
        events.append(event)
    return events


def _write(name: str, spec: JobSpec, checkpoint: Path) -> list[Path]:
    exports = checkpoint.parent.parent / EXPORTS_DIR
    if name == "merged":
        from jobs.checkpoints.export import merge_lora_checkpoint  # peft, transformers: only this export needs them

        merged = merge_lora_checkpoint(checkpoint, exports / f"{checkpoint.name}-merged", archive=True)
        return [merged.with_name(merged.name + ".tar")]
    from jobs.checkpoints.gguf_file import export_gguf  # gguf, transformers: only this export needs them

    assert spec.export.gguf is not None
    written = export_gguf(checkpoint, None, spec.export.gguf.quant, modelfile=True)
    return [written.path, written.path.with_suffix(".Modelfile")]


def _digest(path: Path, output_dir: Path) -> FileDigest:
    """The file's digest, also written to ``<file>.sha256`` where the download routes read it."""
    digest = file_sha256(path)
    sidecar = path.with_name(path.name + ".sha256")
    tmp = sidecar.with_name(f".tmp-{sidecar.name}")
    tmp.write_text(digest)
    tmp.replace(sidecar)  # a reader sees no checksum or a whole one
    return FileDigest(name=str(path.relative_to(output_dir)), bytes=path.stat().st_size, sha256=digest)
