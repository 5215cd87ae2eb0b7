"""A ``data: {kind: text}`` section end to end: records, examples, then packed rows or padded batches.

How sequences are laid out (``data.packing``):
- ``packed`` (``auto`` on models that keep packed documents apart: Hugging Face causal LMs): whole
  examples share rows, each document's position ids restart; plain text runs on across rows.
- ``padded`` (``auto`` elsewhere for instruction and chat data): length-grouped padded batches.
- plain text on a model without the packed path (``auto``): documents back to back as before, with EOS
  between them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from jobs.data.formats.examples import Example, RecordError
from jobs.data.formats.preference import PreferenceBatches, PreferencePair, preference_pair, truncate
from jobs.data.formats.record import record_examples
from jobs.data.mixing import mix
from jobs.data.packing import PackingCounts, concatenate, fit_examples, pack
from jobs.data.padded import PaddedBatches
from jobs.data.records import Record, iter_records
from jobs.data.text import PackedText
from jobs.data.tokenizers import HFTokenizer, Tokenizer, build_tokenizer

log = logging.getLogger(__name__)


@dataclass
class TextData:
    """What a text job trains and evaluates on."""

    train: PackedText | PaddedBatches | PreferenceBatches
    eval: PackedText | PaddedBatches | PreferenceBatches | None
    tokenizer: Tokenizer
    layout: str  # "packed", "padded", "concatenated" or "pairs" (preference data)
    counts: PackingCounts
    summary: str  # one line for the job's log: records, examples, truncated, skipped, sequences


def model_keeps_documents_apart() -> bool:
    """Whether this transformers derives a block-diagonal mask from packed position ids (>= 4.47)."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


def layout_for(spec: Any, *, packed_path: bool) -> str:
    """``packed``, ``padded`` or ``concatenated`` for a data section on a model with or without the packed path."""
    if spec.packing != "auto":
        return spec.packing
    if packed_path:
        return "packed"
    return "concatenated" if spec.format == "text" else "padded"


def prepare_text_data(spec: Any, *, batch_size: int, seed: int, packed_path: bool, eval_spec: Any = None) -> TextData:
    """Read, tokenize and lay out ``spec`` (a text data section), holding out ``eval_spec``'s records.

    Raises:
        ValueError: a record does not fit the format (naming its file, row and field), or too little data.
    """
    tokenizer = build_tokenizer(spec.tokenizer, spec.chat_template)
    split = eval_spec.split if eval_spec is not None else None
    records, held_out, mixed = _train_records(spec, split, seed)
    if eval_spec is not None and eval_spec.path is not None:
        held_out = list(iter_records(eval_spec.path, spec.file_type))
    if spec.format == "preference":
        return _preference_data(records, held_out, spec, tokenizer, batch_size, seed)
    layout = layout_for(spec, packed_path=packed_path)
    train, counts = _lay_out(_examples(records, spec, tokenizer), spec, tokenizer, layout, batch_size, seed)
    evaluation = None
    if held_out:
        examples = _examples(held_out, spec, tokenizer)
        evaluation, _ = _lay_out(examples, spec, tokenizer, layout, batch_size, seed, at_least_one_batch=True)
    summary = (
        f"data: {len(records)} record(s) -> {counts.examples} example(s) in {counts.sequences} {layout} "
        f"sequence(s) of <= {spec.seq_len} tokens; {counts.truncated} truncated to data.seq_len, "
        f"{counts.skipped} skipped (no response token left), {counts.padding_tokens} padding token(s)"
        + (f"; {len(held_out)} record(s) held out for eval" if held_out else "")
        + mixed
    )
    log.info(summary)
    return TextData(train, evaluation, tokenizer, layout, counts, summary)


def _train_records(spec: Any, split: float | None, seed: int) -> tuple[list[Record], list[Record], str]:
    """The training records, those ``eval.split`` holds out, and a note on the mix (empty without one).

    With ``data.mix`` each source is split before the mix, so a held-out record is never trained on, even
    from a source the mix repeats.
    """
    groups: list[list[Record]] = []
    held_out: list[Record] = []
    for setting, path, _ in spec.sources():
        records = list(iter_records(path, spec.file_type))
        if split is not None:
            records, held = _split(records, split, seed)
            held_out += held
        if not records:
            raise ValueError(f"{setting}: '{path}' holds no records; remove it or point it at data")
        groups.append(records)
    if spec.mix is None:
        return groups[0], held_out, ""
    weights = [weight for _, _, weight in spec.sources()]
    records, counts = mix(groups, weights, seed)
    shares = ", ".join(
        f"{source.path.name} {len(group)} -> {count}"
        for source, group, count in zip(spec.mix, groups, counts, strict=True)
    )
    return records, held_out, f"; data.mix (records -> in the mix): {shares}"


def _preference_data(
    records: list[Record], held_out: list[Record], spec: Any, tokenizer: Tokenizer, batch_size: int, seed: int
) -> TextData:
    """Preference pairs, each truncated to ``data.seq_len`` (the prompt keeps its end), in pair batches."""
    assert isinstance(tokenizer, HFTokenizer)  # a rule refuses preference data without an HF tokenizer

    def pairs(chosen: list[Record]) -> list[PreferencePair]:
        found = []
        for record in chosen:
            try:
                found.append(truncate(preference_pair(record.fields, tokenizer), spec.seq_len))
            except RecordError as error:
                raise ValueError(f"{record.file} row {record.row}: {error} (data.format=preference)") from None
        return found

    train_pairs = pairs(records)
    train = PreferenceBatches(train_pairs, batch_size, seed, tokenizer.pad_id)
    evaluation = None
    if held_out:
        size = min(batch_size, len(held_out))
        evaluation = PreferenceBatches(pairs(held_out), size, seed, tokenizer.pad_id)
    truncated = sum(1 for p in train_pairs if p.cut)
    counts = PackingCounts(examples=len(train_pairs), truncated=truncated, sequences=2 * len(train_pairs))
    summary = (
        f"data: {len(records)} record(s) -> {len(train_pairs)} preference pair(s) of <= {spec.seq_len} tokens a row; "
        f"{truncated} truncated to data.seq_len ({sum(p.cut for p in train_pairs)} token(s) cut, prompts keep their end)"
        + (f"; {len(held_out)} record(s) held out for eval" if held_out else "")
        + _raw_pairs_note(train_pairs)
    )
    log.info(summary)
    return TextData(train, evaluation, tokenizer, "pairs", counts, summary)


def _raw_pairs_note(pairs: list[PreferencePair]) -> str:
    """Said in the job's log: string pairs skip the chat template (TRL's standard layout), so a chat model
    trained on them sees no turn markers; message lists give it the template."""
    raw = sum(1 for p in pairs if p.raw)
    if not raw:
        return ""
    return (
        f"; {raw} pair(s) of plain strings (TRL's standard layout) read as raw text without the chat template, "
        "as TRL does: give prompt, chosen and rejected as message lists to render them with it"
    )


def _split(records: list[Record], fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    if len(records) < 2:
        raise ValueError(f"eval.split needs at least 2 records; data.path has {len(records)}")
    count = min(len(records) - 1, max(1, round(fraction * len(records))))
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:count])
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


def _examples(records: list[Record], spec: Any, tokenizer: Tokenizer) -> list[Example]:
    examples = []
    for record in records:
        try:
            examples += record_examples(record.fields, spec, tokenizer)
        except RecordError as error:
            raise ValueError(f"{record.file} row {record.row}: {error} (data.format={spec.format})") from None
    return examples


def _lay_out(
    examples: list[Example],
    spec: Any,
    tokenizer: Tokenizer,
    layout: str,
    batch_size: int,
    seed: int,
    *,
    at_least_one_batch: bool = False,
) -> tuple[PackedText | PaddedBatches, PackingCounts]:
    """Training needs a full batch; an eval set smaller than one batch is one smaller batch."""
    if layout == "padded":
        fitted, counts = fit_examples(examples, spec.seq_len)
        _check_some_left(counts, len(examples), spec.seq_len)
        size = min(batch_size, max(1, len(fitted))) if at_least_one_batch else batch_size
        return PaddedBatches(fitted, size, seed, tokenizer.pad_id), counts
    if layout == "packed" and spec.format != "text":
        tensors, counts = pack(examples, spec.seq_len, tokenizer.pad_id)
        _check_some_left(counts, len(examples), spec.seq_len)
    else:
        tensors, counts = concatenate(examples, spec.seq_len, tokenizer.pad_id, restart_positions=layout == "packed")
    size = min(batch_size, max(1, counts.sequences)) if at_least_one_batch else batch_size
    return PackedText(tensors, size, seed), counts


def _check_some_left(counts: PackingCounts, total: int, seq_len: int) -> None:
    if total and counts.examples == 0:
        raise ValueError(
            f"all {total} example(s) were skipped: none has a response token within the first {seq_len} "
            f"tokens ({counts.truncated} truncated); raise data.seq_len (now {seq_len}) or shorten the prompts"
        )
