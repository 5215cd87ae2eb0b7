"""``data.kind: image_chat`` end to end: rows → token ids and labels with images expanded → padded batches.

Labels follow the text chat format's pieces (jobs/data/formats/chat.py ``chat_pieces``): an assistant turn's
content and end-of-turn train, everything else (system, user turns with their image tokens, headers) is -100,
unless ``data.train_on_prompt``. A piece holding image placeholders is tokenized by the processor with its
images, so each image takes the tokens its size gives it. Images are opened again when their batch is built
(only references are kept between steps) and batched by the model's image processor, which flattens
(Qwen2.5-VL) or pads (Idefics3) images of different sizes as the model expects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from jobs.data.formats.chat import chat_pieces
from jobs.data.formats.examples import IGNORE, RecordError
from jobs.data.formats.tools import check_tools
from jobs.data.records import iter_records
from jobs.models.vlm.images import LOW_DETAIL_SIDE, ImageRef, OpenedImage, open_image
from jobs.models.vlm.processor import ProcessorText
from jobs.models.vlm.records import image_conversation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageRow:
    """One tokenized row: ids and labels (same length), its images in order, and where it came from."""

    input_ids: list[int]
    labels: list[int]
    images: list[ImageRef]
    where: str  # "<file> row <n>"
    prompt: str  # the last user turn's text, for samples


def read_rows(spec: Any, text: ProcessorText, *, limit: int | None = None) -> tuple[list[ImageRow], ImageNotes]:
    """Every row of ``spec.path`` (the first ``limit`` of each file) tokenized, and the notes on images changed
    before the processor saw them (`ImageNotes`).

    Raises:
        ValueError: ``<file> row <n>: field '<field>': <problem> (data.kind=image_chat)``, for the first bad row.
    """
    path = Path(spec.path)
    folder = path if path.is_dir() else path.parent
    rows, notes = [], ImageNotes()
    for record in iter_records(path, spec.file_type, limit_per_file=limit):
        where = f"{Path(record.file).name} row {record.row}"  # the file as the user names it, not the server's path
        try:
            row, opened = image_row(record.fields, spec, text, folder, where)
        except RecordError as error:
            raise ValueError(f"{where}: {error} (data.kind=image_chat)") from None
        rows.append(row)
        notes.add(where, opened)
    if not rows:
        raise ValueError(f"data.path: {path} holds no rows; point it at a JSONL file of chat rows with images")
    return rows, notes


@dataclass
class ImageNotes:
    """What was done to the data's images before the processor saw them, each note naming its row."""

    resized: list[str] = field(default_factory=list)  # above data.max_image_pixels
    low_detail: list[str] = field(default_factory=list)  # image_url.detail=low: within 512x512

    def add(self, where: str, opened: list[OpenedImage]) -> None:
        self.resized += [f"{where}: {o.resized}" for o in opened if o.resized]
        self.low_detail += [f"{where}: {o.low_detail}" for o in opened if o.low_detail]

    def extend(self, other: ImageNotes) -> None:
        self.resized += other.resized
        self.low_detail += other.low_detail

    def notices(self) -> list[str]:
        """One line for the job's events per kind of change, the first few rows named."""
        found = []
        if self.resized:
            found.append(
                f"data: {len(self.resized)} image(s) above data.max_image_pixels resized: {_few(self.resized)}"
            )
        if self.low_detail:
            found.append(
                f"data: {len(self.low_detail)} image(s) with image_url.detail=low shown to the model at most "
                f"{LOW_DETAIL_SIDE}x{LOW_DETAIL_SIDE} (OpenAI's low detail): {_few(self.low_detail)}"
            )
        return found


def _few(notes: list[str]) -> str:
    return "; ".join(notes[:3]) + (f"; and {len(notes) - 3} more" if len(notes) > 3 else "")


def image_row(
    fields: dict[str, Any], spec: Any, text: ProcessorText, folder: Path, where: str
) -> tuple[ImageRow, list[OpenedImage]]:
    """One row's ids and labels, its images checked (opened, shrunk when huge or of low detail), as opened.

    Raises:
        RecordError: naming the field (the message, the image part, ``images``).
    """
    conversation, refs = image_conversation(fields, spec, folder)
    opened = [
        open_image(ref, max_pixels=spec.max_image_pixels, refuse_huge=spec.huge_images == "refuse") for ref in refs
    ]
    images = [o.image for o in opened]
    pieces = chat_pieces(
        conversation.messages,
        text,
        train_on_prompt=spec.train_on_prompt,
        tools=check_tools(fields.get("tools")),
        places=conversation.places,
    )
    ids: list[int] = []
    labels: list[int] = []
    taken = 0
    for piece, trains in pieces:
        count = piece.count(text.placeholder)
        encoded = text.encode(piece, images[taken : taken + count]) if piece else []
        taken += count
        ids += encoded
        labels += encoded if trains else [IGNORE] * len(encoded)
    if taken != len(images):
        raise RecordError(
            spec.messages_field,
            f"the chat template wrote {taken} image placeholder(s) ({text.placeholder}) for the row's {len(images)} "
            "image(s); use the model's own processor and chat template",
        )
    ids, labels = _fit(ids, labels, spec, text.image_token_id)
    return ImageRow(ids, labels, refs, where, _last_user_text(conversation.messages)), opened


def _fit(ids: list[int], labels: list[int], spec: Any, image_token_id: int) -> tuple[list[int], list[int]]:
    """Cut a row to ``data.seq_len``, never through an image's tokens; refuse one left with nothing to train."""
    if len(ids) > spec.seq_len:
        if image_token_id in ids[spec.seq_len :]:
            raise RecordError(
                spec.messages_field,
                f"is {len(ids)} tokens with its images, above data.seq_len={spec.seq_len}, and an image would be cut; "
                "raise data.seq_len or lower data.max_image_pixels (fewer tokens per image)",
            )
        ids, labels = ids[: spec.seq_len], labels[: spec.seq_len]
    if all(label == IGNORE for label in labels):
        raise RecordError(spec.messages_field, f"has no response token within data.seq_len={spec.seq_len} tokens")
    return ids, labels


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message["role"] == "user":
            content = message["content"]
            return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    return ""


class ImageChatBatches:
    """Rows in padded micro-batches with their images; batch ``i`` is a pure function of (seed, i).

    Args:
        rows: The tokenized rows.
        batch_size: Rows per micro-batch (an epoch's last batch may be smaller).
        seed: Shuffles the rows per epoch.
        text: The processor (padding id, image batching).
        spec: The data section (image limits, applied again as each image is reopened).
    """

    tokens_per_sample = None  # rows differ in length: the step's token count is not batch x a length

    def __init__(self, rows: list[ImageRow], batch_size: int, seed: int, text: ProcessorText, spec: Any) -> None:
        if len(rows) < batch_size:
            raise ValueError(f"data holds {len(rows)} row(s), fewer than training.batch_size={batch_size}; add rows")
        self.rows, self.batch_size, self.seed, self.text, self.spec = rows, batch_size, seed, text, spec
        self.batches_per_epoch = -(-len(rows) // batch_size)
        self.notices: list[str] = []  # what the job's events say about the data (images resized)
        self.eval: ImageChatBatches | None = None  # the rows ``eval`` holds out (eval.split or eval.path)

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        """The ``index``-th micro-batch (CPU tensors), counting across epochs."""
        epoch, within = divmod(index, self.batches_per_epoch)
        order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        chosen = [self.rows[i] for i in order[within * self.batch_size : (within + 1) * self.batch_size].tolist()]
        return self.collate(chosen)

    def in_order(self, index: int) -> dict[str, torch.Tensor]:
        """The ``index``-th batch of the rows unshuffled: what an evaluation walks through."""
        return self.collate(self.rows[index * self.batch_size : (index + 1) * self.batch_size])

    def collate(self, rows: list[ImageRow]) -> dict[str, torch.Tensor]:
        """Right-padded ids, labels and attention mask, and the image processor's tensors for the rows' images."""
        width = max(len(row.input_ids) for row in rows)
        ids = torch.full((len(rows), width), self.text.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for n, row in enumerate(rows):
            ids[n, : len(row.input_ids)] = torch.tensor(row.input_ids)
            labels[n, : len(row.labels)] = torch.tensor(row.labels)
            mask[n, : len(row.input_ids)] = 1
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if getattr(self.text.processor, "return_mm_token_type_ids", False):  # Qwen2.5-VL's rotary positions read it
            batch["mm_token_type_ids"] = (ids == self.text.image_token_id).long()
        if any(row.images for row in rows):
            refuse = self.spec.huge_images == "refuse"
            images = [
                [open_image(r, max_pixels=self.spec.max_image_pixels, refuse_huge=refuse).image for r in row.images]
                for row in rows
            ]
            batch |= {k: v for k, v in self.text.pixels(images).items() if isinstance(v, torch.Tensor)}
        return batch


def build_image_chat_data(
    spec: Any, batch_size: int, seed: int, text: ProcessorText, eval_spec: Any = None
) -> ImageChatBatches:
    """The training batches of an ``image_chat`` data section, notes on resized images in the job's log and
    events; with ``eval_spec`` (the job's ``eval``), its held-out rows as the batches' ``eval``."""
    rows, notes = read_rows(spec, text)
    held_out: list[ImageRow] = []
    if eval_spec is not None and eval_spec.path is not None:
        held_out, eval_notes = read_rows(spec.model_copy(update={"path": eval_spec.path}), text)
        notes.extend(eval_notes)
    elif eval_spec is not None:
        rows, held_out = _split(rows, eval_spec.split, seed)
    images = sum(len(row.images) for row in rows)
    log.info("data: %d row(s) with %d image(s), %d to %d tokens a row", len(rows), images,
             min(len(r.input_ids) for r in rows), max(len(r.input_ids) for r in rows))  # fmt: skip
    batches = ImageChatBatches(rows, batch_size, seed, text, spec)
    if held_out:
        batches.eval = ImageChatBatches(held_out, min(batch_size, len(held_out)), seed, text, spec)
    batches.notices = notes.notices()  # in the job's events (session notices) as well as its log
    for notice in batches.notices:
        log.warning("%s", notice)
    return batches


def _split(rows: list[ImageRow], fraction: float, seed: int) -> tuple[list[ImageRow], list[ImageRow]]:
    """``eval.split``: the rows chosen by the seed held out (at least one), the rest trained on."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    count = max(1, round(fraction * len(rows)))
    if count >= len(rows):
        raise ValueError(
            f"eval.split={fraction} holds out all {len(rows)} row(s), leaving none to train on; lower eval.split "
            "or give eval.path"
        )
    held = set(order[:count])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]
