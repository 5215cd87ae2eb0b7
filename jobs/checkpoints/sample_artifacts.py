"""Samples as artifacts: the images a checkpoint holds, kept per step for the job's gallery.

A model family's sampler writes ``sample-*.png`` into each checkpoint as it is saved. Checkpoints are
pruned to ``checkpoint.keep_last``, but a user watching a LoRA take hold wants every step's samples, so
they are also copied to ``output_dir/samples/step-00000010/``, which nothing prunes.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from jobs.checkpoints.directory import CheckpointInfo
from jobs.events import SampleEvent

SAMPLES_DIR = "samples"
_SAMPLE_NAME = re.compile(r"^sample-(\d+)(?:-f(\d+))?\.png$")


def keep_samples(
    info: CheckpointInfo, output_dir: Path, prompts: list[str], texts: list[str] | None = None
) -> list[SampleEvent]:
    """Copy the checkpoint's sample images to the gallery; one ``sample`` event per image, with ``texts[i]``
    where the sampler wrote text beside its image (an image-text model's answer to the image)."""
    gallery = Path(output_dir) / SAMPLES_DIR / info.name
    gallery.mkdir(parents=True, exist_ok=True)
    events = []
    for entry in info.files:
        match = _SAMPLE_NAME.match(entry["name"])
        if match is None:
            continue
        shutil.copyfile(Path(info.path) / entry["name"], gallery / entry["name"])
        index = int(match.group(1))
        events.append(
            SampleEvent(
                step=info.step,
                prompt=prompts[index] if index < len(prompts) else None,
                text=texts[index] if texts and index < len(texts) else None,
                artifact_path=f"{SAMPLES_DIR}/{info.name}/{entry['name']}",
                media_type="image/png",
            )
        )
    return events
