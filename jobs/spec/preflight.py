"""Checks that need the job's files, made at submit time: the data's first rows, the model's module names.

`load_job_spec` checks the spec itself; these read what it points at, so a wrong field name, format or
chat template, or a LoRA target the model does not have, is refused before the job is queued (a 422
naming the file, row and field) instead of failing minutes into a worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from jobs.data.auto_size import AUTO_DATA_KINDS, AUTO_ONLY_ON
from jobs.errors import SpecProblem
from jobs.models.names import lora_target_matches
from jobs.models.registry import family_of
from jobs.paths import PathRoots, without_roots
from jobs.spec.job import HFTokenizerSpec, JobSpec, TextDataSpec

log = logging.getLogger(__name__)
ROWS_CHECKED = 20  # per data file
ROWS_COUNTED_BYTES = 64 << 20  # data up to this size is read whole at submit to count its rows


def preflight_problems(spec: JobSpec, roots: PathRoots | None = None) -> list[SpecProblem]:
    """Every problem found in the data's first rows and the model's module names (empty when fine).

    Given the ``roots`` the spec was loaded with, the messages name paths as the spec wrote them (relative to
    their root), never the server's absolute layout, also where a library's error names the file it read.

    Example:
        >>> preflight_problems(load_job_spec(text, roots), roots)
        [SpecProblem(path='data.path', message="part-0.jsonl row 3: field 'messages[1].role': ...")]
    """
    problems = _problems(spec)
    if roots is None:
        return problems
    return [replace(p, message=without_roots(p.message, roots)) for p in problems]


def _problems(spec: JobSpec) -> list[SpecProblem]:
    from jobs.reporting.tracking import missing_tracking_packages

    problems = [SpecProblem(path, message) for path, message in missing_tracking_packages(spec.tracking)]
    if spec.training.grpo.grader is not None:
        from jobs.objectives.graders.needs import grader_problems

        problems += [SpecProblem(path, message) for path, message in grader_problems(spec.training.grpo.grader)]
    if spec.data.kind == "text":
        data_problems = _data_problems(spec)
        problems += data_problems + _chat_prompt_problems(spec)
        if not data_problems:  # rows are counted from data whose first rows read
            problems += _prompt_problems(spec) if spec.data.format == "prompt" else _row_problems(spec)
    elif spec.training.auto and spec.data.kind not in AUTO_DATA_KINDS:
        field = spec.training.auto[0]
        problems.append(SpecProblem(f"training.{field}", f"{AUTO_ONLY_ON}; give a number"))
    family = family_of(spec.model)
    model_problems = []
    if family.checkpoint_problems is not None:
        model_problems = _checkpoint_problems(spec, family.checkpoint_problems)
    read_names = family.module_names_from_files
    if spec.lora is not None and read_names is not None and not model_problems:  # no model, no module names
        model_problems = _lora_problems(spec, read_names)
    problems += model_problems
    return problems


def _checkpoint_problems(spec: JobSpec, check: Callable[[Any], list[tuple[str, str, str]]]) -> list[SpecProblem]:
    """The checkpoint's tensors against the model built from its config: a missing, unexpected or misshapen
    tensor is refused now, naming the tensor and its file, instead of failing (or loading random values)
    in the worker."""
    try:
        found = check(spec.model)
    except ValueError as error:
        return [SpecProblem("model.path", str(error))]
    except Exception as error:  # a broken config.json or header: report it rather than skip the check
        return [SpecProblem("model.path", f"cannot check the checkpoint: {type(error).__name__}: {error}")]
    fix = (
        "point model.path at a directory written by save_pretrained whose config.json matches its weights "
        "(every shard present), or set model.init: random to train the shapes without weights"
    )
    shown = [SpecProblem("model.path", f"tensor {t!r} in {file}: {message}; fix: {fix}") for t, file, message in found]
    if len(shown) > 10:
        shown = [*shown[:10], SpecProblem("model.path", f"and {len(found) - 10} more tensors like these")]
    return shown


def _data_problems(spec: JobSpec) -> list[SpecProblem]:
    from jobs.data.formats.record import RecordError, record_examples
    from jobs.data.records import iter_records
    from jobs.data.tokenizers import build_tokenizer

    data = spec.data
    assert isinstance(data, TextDataSpec)  # called for data.kind: text only
    try:
        tokenizer = build_tokenizer(data.tokenizer, data.chat_template)
    except Exception as error:  # a directory that is not a tokenizer: transformers raises many kinds
        return [SpecProblem("data.tokenizer.path", _tokenizer_problem(data.tokenizer, error))]
    if data.format in ("chat", "preference") and not getattr(tokenizer, "has_chat_template", False):
        return [
            SpecProblem(
                "data.chat_template",
                f"the tokenizer at '{getattr(data.tokenizer, 'path', 'byte')}' has no chat template; set "
                "data.chat_template (a Jinja template, or 'chatml')",
            )
        ]
    sources = [(setting, path) for setting, path, _ in data.sources()]
    if spec.eval is not None and spec.eval.path is not None:
        sources.append(("eval.path", spec.eval.path))
    problems = []
    for setting, path in sources:
        try:
            for record in iter_records(Path(path), data.file_type, limit_per_file=ROWS_CHECKED):
                try:
                    record_examples(record.fields, data, tokenizer)
                except RecordError as error:
                    where = f"{Path(record.file).name} row {record.row}"
                    problems.append(SpecProblem(setting, f"{where}: {error} (data.format: {data.format})"))
                    break  # one problem per source: the rest of a wrongly declared file fails alike
        except ValueError as error:
            problems.append(SpecProblem(setting, str(error)))
        except Exception as error:  # datasets/pyarrow parse errors: name the file's problem, not a 500
            problems.append(SpecProblem(setting, f"cannot read '{path}': {type(error).__name__}: {_first_line(error)}"))
    return problems


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer_problem(spec: Any, error: Exception) -> str:
    """One line for a tokenizer that does not load: the directory holds none, or what transformers said first."""
    path = Path(spec.path)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        return (
            f"'{path}' holds no tokenizer ({', '.join(TOKENIZER_FILES)}); point data.tokenizer.path at a "
            "directory written by save_pretrained (the model's own directory usually holds its tokenizer)"
        )
    return f"cannot load the tokenizer at '{path}': {type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    """A library's error in one line: its first (some, like transformers', run to a page of advice)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _row_problems(spec: JobSpec) -> list[SpecProblem]:
    """A batch the data cannot fill, refused now with the count (the worker would fail on it in the queue);
    ``auto`` fields are chosen from the same count, so only a data set that makes no row is refused for them.

    Data larger than `ROWS_COUNTED_BYTES` is not counted here unless ``auto`` needs it: it makes far more rows
    than any batch, and reading it all would hold up the submission."""
    from jobs.data.auto_size import count_rows

    data, training = spec.data, spec.training
    assert isinstance(data, TextDataSpec)  # called for data.kind: text only
    if spec.task != "train" or data.format == "prompt":  # GRPO's batches are prompts, not packed rows
        return []
    if not training.auto and _source_bytes(spec) > ROWS_COUNTED_BYTES:
        return []
    try:
        rows = count_rows(spec)
    except ValueError as error:
        return [SpecProblem("data.path", str(error))]
    if "batch_size" in training.auto or rows.rows >= training.batch_size:
        return []
    fixes = [f"lower training.batch_size to {rows.rows} or less (or set it to auto)"] if rows.rows else []
    if rows.layout in ("packed", "concatenated"):
        fixes.append("lower data.seq_len")
    fixes.append("add data")
    return [
        SpecProblem(
            "training.batch_size",
            f"the data makes {rows.described(data.seq_len)}, fewer than training.batch_size={training.batch_size}, "
            f"so no batch can be filled; {', '.join(fixes[:-1])}{' or ' if len(fixes) > 1 else ''}{fixes[-1]}",
        )
    ]


def _prompt_problems(spec: JobSpec) -> list[SpecProblem]:
    """grpo's prompts against the context: none that leaves ``max_new_tokens`` of room in ``data.seq_len``, or
    fewer than a batch, is refused now. The worker skips the longer ones and says how many in the job's events.

    Data larger than `ROWS_COUNTED_BYTES` is read only to its first `ROWS_CHECKED` rows a file."""
    from jobs.data.formats.prompt import prompt_ids
    from jobs.data.records import iter_records
    from jobs.data.tokenizers import build_tokenizer

    data, training = spec.data, spec.training
    assert isinstance(data, TextDataSpec)  # called for data.kind: text only
    room, new = data.seq_len - training.grpo.max_new_tokens, training.grpo.max_new_tokens
    if room <= 0:
        return [
            SpecProblem(
                "training.grpo.max_new_tokens",
                f"{new} new tokens leave no room for a prompt in data.seq_len={data.seq_len}; lower it or raise data.seq_len",
            )
        ]
    tokenizer = build_tokenizer(data.tokenizer, data.chat_template)
    whole = _source_bytes(spec) <= ROWS_COUNTED_BYTES
    fits = long = 0
    for setting, path, _ in data.sources():
        for record in iter_records(Path(path), data.file_type, limit_per_file=None if whole else ROWS_CHECKED):
            try:
                length = len(prompt_ids(record.fields, tokenizer))
            except ValueError as error:
                return [
                    SpecProblem(setting, f"{Path(record.file).name} row {record.row}: {error} (data.format: prompt)")
                ]
            fits, long = (fits + 1, long) if length <= room else (fits, long + 1)
    if not fits:
        return [
            SpecProblem(
                "data.seq_len",
                f"none of the {long} prompts read fits in data.seq_len={data.seq_len} with room for "
                f"training.grpo.max_new_tokens={new}; raise data.seq_len or lower max_new_tokens",
            )
        ]
    if whole and "batch_size" not in training.auto and fits < training.batch_size:
        return [
            SpecProblem(
                "training.batch_size",
                f"{fits} prompts fit data.seq_len={data.seq_len} with {new} new tokens ({long} longer), fewer than "
                f"training.batch_size={training.batch_size}; lower it to {fits} or add prompts",
            )
        ]
    return []


def _source_bytes(spec: JobSpec) -> int:
    data = spec.data
    assert isinstance(data, TextDataSpec)
    paths = [Path(path) for _, path, _ in data.sources()]
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*") if p.is_dir() else []) if f.is_file()]
    return sum(f.stat().st_size for f in files)


def _chat_prompt_problems(spec: JobSpec) -> list[SpecProblem]:
    """Chat-message sample prompts rendered now with the job's chat template: none, or one that refuses them
    (some refuse a system turn), is refused at submit rather than at the first sample."""
    from jobs.data.formats.chat import conversation_prompt
    from jobs.data.formats.examples import RecordError
    from jobs.data.tokenizers import HFTokenizer, build_tokenizer

    samples, data = spec.text_samples, spec.data
    assert isinstance(data, TextDataSpec)  # called for data.kind: text only
    if samples is None or not samples.has_chat_prompts() or not isinstance(data.tokenizer, HFTokenizerSpec):
        return []  # no chat prompts, or a rule already asks for an HF tokenizer
    try:
        tokenizer = build_tokenizer(data.tokenizer, data.chat_template)
    except Exception:  # reported by _data_problems as data.tokenizer.path
        return []
    assert isinstance(tokenizer, HFTokenizer)
    if not tokenizer.has_chat_template:
        return [
            SpecProblem(
                "text_samples.prompts",
                f"chat messages need a chat template and the tokenizer at '{data.tokenizer.path}' has none; set "
                "data.chat_template (a Jinja template, or 'chatml')",
            )
        ]
    for index, prompt in enumerate(samples.prompts):
        if isinstance(prompt, list) and not any(m.has_parts() for m in prompt):  # parts: a rule refuses them here
            try:
                conversation_prompt([{"role": m.role, "content": str(m.content)} for m in prompt], tokenizer)
            except RecordError as error:
                return [
                    SpecProblem(
                        f"text_samples.prompts.{index}", f"{error.message}; change the messages or data.chat_template"
                    )
                ]
    return []


def _lora_problems(spec: JobSpec, read_names: Callable[[Any], Mapping[str, bool]]) -> list[SpecProblem]:
    """LoRA targets against the model's module names: one that matches no module, or (target_modules) one that
    matches a module LoRA cannot wrap (``mlp``, a layer index ``1``), which peft would refuse in the worker."""
    try:
        names = read_names(spec.model)
    except Exception as error:  # a broken config.json: report it rather than skip the check silently
        return [SpecProblem("model.path", f"cannot read the model's config: {type(error).__name__}: {error}")]
    lora = spec.lora
    assert lora is not None  # called with a lora section only
    wrappable = [name for name, can_wrap in names.items() if can_wrap]
    model = spec.model.path.name
    problems = []
    for setting, targets, candidates in (
        ("lora.target_modules", lora.target_modules, wrappable),
        ("lora.modules_to_save", lora.modules_to_save, list(names)),
    ):
        missing = [t for t in targets if not any(lora_target_matches(name, t) for name in names)]
        if missing:
            problems.append(
                SpecProblem(setting, f"{missing} match no module of {model} (names end in: {_endings(candidates)})")
            )
    for target in lora.target_modules:
        unwrappable = [n for n, can_wrap in names.items() if lora_target_matches(n, target) and not can_wrap]
        if unwrappable:
            inside = [n for n in wrappable if n.startswith(unwrappable[0] + ".")]
            fix = f"name the layers inside it instead (e.g. {_endings(inside)})" if inside else "remove it"
            problems.append(
                SpecProblem(
                    "lora.target_modules",
                    f"{target!r} matches {unwrappable[0]}{_and_more(unwrappable)}, which holds other modules and "
                    f"LoRA cannot wrap (it wraps Linear, Embedding and convolution layers); {fix}",
                )
            )
    return problems


def _endings(names: list[str]) -> str:
    """The distinct last components of ``names`` that are module names, not layer indices (``q_proj``, not ``3``)."""
    endings = sorted({name.split(".")[-1] for name in names if name and not name.split(".")[-1].isdigit()})
    return ", ".join(endings[:16])


def _and_more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""
