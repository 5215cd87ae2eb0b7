"""What ``training.batch_size: auto`` and ``training.epochs: auto`` choose, and how many rows the data makes.

Both are chosen from the data as the job will see it: its records read and tokenized, the eval split held out,
then packed or padded into the rows a batch is drawn from (`prepare_text_data`, the worker's own path). The
rules are OpenAI's ``auto`` hyperparameters, as its fine-tuning cookbook states them:

- batch: about 0.2 % of the training examples, 1 to 256, and never more than the rows the data makes (a
  batch larger than the data cannot be filled: packing 12 short chats into 512-token rows makes one row);
- epochs: 3, or enough to show the model at least 100 examples (at most 25 epochs), or few enough to stay near
  25,000 examples (at least 1).

The spec checker chooses them at submit (the stored spec holds the numbers); the worker chooses again from the
same data and logs what it chose, with why, in the job's events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobs.spec.job import JobSpec

BATCH_FRACTION, MAX_AUTO_BATCH = 0.002, 256
TARGET_EPOCHS, MIN_TARGET_EXAMPLES, MAX_TARGET_EXAMPLES = 3, 100, 25_000
MIN_AUTO_EPOCHS, MAX_AUTO_EPOCHS = 1, 25
AUTO_DATA_KINDS = ("text", "image_chat")  # the data whose rows are counted
AUTO_ONLY_ON = "auto is chosen from text or image chat data (data.kind: text or image_chat)"


@dataclass(frozen=True)
class DataRows:
    """How much a text data section makes: ``rows`` a batch is drawn from, from ``examples`` examples."""

    rows: int
    examples: int
    layout: str  # "packed", "padded", "concatenated", "pairs" or "prompts"

    def described(self, seq_len: int) -> str:
        """The rows in the user's words, e.g. "1 packed row(s) of data.seq_len=512 tokens from 12 example(s)"."""
        if self.layout == "pairs":
            return f"{self.rows} preference pair(s)"
        if self.layout == "prompts":
            return f"{self.rows} prompt(s) with room for training.grpo.max_new_tokens in data.seq_len={seq_len}"
        if self.layout == "padded":
            return f"{self.rows} example(s) of at most data.seq_len={seq_len} tokens"
        return f"{self.rows} {self.layout} row(s) of data.seq_len={seq_len} tokens from {self.examples} example(s)"


def count_rows(spec: JobSpec) -> DataRows:
    """The training rows ``spec``'s text data makes, read and laid out as the worker does.

    Raises:
        ValueError: the data cannot be read or yields nothing (the message names the file and the fix).
    """
    from jobs.data.prepare import model_keeps_documents_apart, prepare_text_data
    from jobs.models.registry import family_of

    data: Any = spec.data  # text or image_chat (callers check)
    assert data.kind in AUTO_DATA_KINDS
    if data.kind == "image_chat":
        return _image_chat_rows(spec)
    if data.format == "prompt":
        return _prompt_rows(spec)
    family = family_of(spec.model)
    packed_path = family.keeps_packed_documents_apart and model_keeps_documents_apart()
    text = prepare_text_data(data, batch_size=1, seed=spec.training.seed, packed_path=packed_path, eval_spec=spec.eval)
    return DataRows(rows=len(text.train), examples=text.counts.examples, layout=text.layout)


def _image_chat_rows(spec: JobSpec) -> DataRows:
    """An image chat's rows: one padded row each, as its batches take them (jobs/models/vlm/batches.py); counted
    without opening an image (the data check opens them)."""
    from pathlib import Path

    from jobs.data.records import iter_records

    data: Any = spec.data  # image_chat (count_rows checked)
    count = sum(1 for _ in iter_records(Path(data.path), data.file_type))
    return DataRows(rows=count, examples=count, layout="padded")


def _prompt_rows(spec: JobSpec) -> DataRows:
    """grpo's rows: the prompts that leave ``max_new_tokens`` of room in ``data.seq_len`` (the longer ones are
    skipped, as jobs/objectives/prompts.py skips them)."""
    from pathlib import Path

    from jobs.data.formats.prompt import prompt_ids
    from jobs.data.records import iter_records
    from jobs.data.tokenizers import build_tokenizer

    data = spec.data
    assert data.kind == "text"  # callers check
    tokenizer = build_tokenizer(data.tokenizer, data.chat_template)
    room = data.seq_len - spec.training.grpo.max_new_tokens
    lengths = [
        len(prompt_ids(record.fields, tokenizer))
        for _, path, _ in data.sources()
        for record in iter_records(Path(path), data.file_type)
    ]
    fits = sum(1 for length in lengths if length <= room)
    if not fits:
        raise ValueError(
            f"data.seq_len: none of the {len(lengths)} prompts fits in data.seq_len={data.seq_len} with room for "
            f"training.grpo.max_new_tokens={spec.training.grpo.max_new_tokens}; raise data.seq_len or lower it"
        )
    return DataRows(rows=fits, examples=fits, layout="prompts")


def auto_batch_size(rows: DataRows) -> int:
    """OpenAI's rule (0.2 % of the examples, 1 to 256), capped at the rows the data makes."""
    wanted = min(MAX_AUTO_BATCH, max(1, math.ceil(BATCH_FRACTION * rows.examples)))
    return max(1, min(wanted, rows.rows))


def auto_epochs(examples: int) -> int:
    """OpenAI's rule: 3 epochs, raised to show at least 100 examples or lowered to about 25,000."""
    if examples * TARGET_EPOCHS < MIN_TARGET_EXAMPLES:
        return min(MAX_AUTO_EPOCHS, MIN_TARGET_EXAMPLES // max(1, examples))
    if examples * TARGET_EPOCHS > MAX_TARGET_EXAMPLES:
        return max(MIN_AUTO_EPOCHS, MAX_TARGET_EXAMPLES // examples)
    return TARGET_EPOCHS


def choose_auto(spec: JobSpec) -> tuple[JobSpec, list[str]]:
    """``spec`` with its ``auto`` fields chosen from the data, and one line per choice saying why.

    Example:
        >>> choose_auto(load_job_spec("... training: {batch_size: auto, epochs: auto} ..."))[1]
        ['batch_size auto -> 1 because the data makes 1 packed row(s) of data.seq_len=512 tokens from 12 ...', ...]

    Raises:
        ValueError: the data cannot be read, or ``auto`` on data other than ``kind: text``.
    """
    training = spec.training
    if not training.auto:
        return spec, []
    if spec.data.kind not in AUTO_DATA_KINDS:
        raise ValueError(f"training.{training.auto[0]}: {AUTO_ONLY_ON}; give a number")
    rows = count_rows(spec)
    data: Any = spec.data  # text or image_chat: both have seq_len
    where = rows.described(data.seq_len)
    chosen: dict[str, object] = {"auto": []}
    notes = []
    if "batch_size" in training.auto:
        batch = auto_batch_size(rows)
        chosen["batch_size"] = batch
        wanted = min(MAX_AUTO_BATCH, max(1, math.ceil(BATCH_FRACTION * rows.examples)))
        why = f"0.2% of {rows.examples} example(s), 1 to {MAX_AUTO_BATCH}, is {wanted}" + (
            f", and the data makes only {where}" if batch < wanted else f"; the data makes {where}"
        )
        notes.append(f"batch_size auto -> {batch} because {why}")
    if "epochs" in training.auto:
        epochs = auto_epochs(rows.examples)
        chosen["epochs"] = epochs
        notes.append(
            f"epochs auto -> {epochs} because {rows.examples} example(s) x {epochs} epoch(s) is "
            f"{rows.examples * epochs} examples seen (OpenAI's rule: {TARGET_EPOCHS} epochs, raised to show at "
            f"least {MIN_TARGET_EXAMPLES} examples, at most {MAX_AUTO_EPOCHS} epochs, lowered to stay near "
            f"{MAX_TARGET_EXAMPLES})"
        )
    return spec.model_copy(update={"training": training.model_copy(update=chosen)}), notes
