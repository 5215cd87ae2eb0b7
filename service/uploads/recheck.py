"""A fine-tuning file checked by older upload rules is checked again by today's before anything trusts it.

Each fine-tuning upload stores the version of the upload rules its rows passed (``rows.RULES_VERSION``). A file
stored by an older server, before a rule existed (or before versions were stored: none), is read again the first
time a job names it (``POST /v1/jobs``, ``/v1/jobs/validate``, ``POST /v1/fine_tuning/jobs``, and when a job
queued before an upgrade starts) or ``GET /v1/files/{id}`` reads it: streamed row by row as at upload, so memory
stays near the line limit whatever the file's size. The verdict is stored with the file (the new version, and how it fails where it does), so each
file is read once per rules version; a job naming a file that fails is refused naming the file, row and field.

Example:
    record = require_current_rules(files, files.get("file-ab12"), uploads_dir=..., max_line_bytes=...)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.queue.files import FileNotFound, FileRecord, FileStore
from service.uploads.named import uploads_named_at
from service.uploads.rows import RULES_VERSION, RowProblem, check_fine_tuning_rows

log = logging.getLogger("ferry.uploads")
CHECKED_PURPOSE = "fine-tune"  # the purpose whose rows the upload rules check; other files are kept as sent


@dataclass(frozen=True)
class RulesProblem:
    """How a stored file fails the rules that last checked it: the row (its line), the field and why."""

    row: int
    field: str
    message: str

    def __str__(self) -> str:
        return str(RowProblem(self.row, self.field, self.message))  # "row 3: field 'messages[0]...': why"


class FileFailsRules(ValueError):
    """A file a job names fails today's upload rules (``problem`` is where), or its bytes are gone (``None``)."""

    def __init__(self, record: FileRecord, problem: RulesProblem | None) -> None:
        self.record, self.problem = record, problem
        if problem is None:
            text = (
                f"file {record.id} ({record.filename}) is listed but its bytes are no longer on disk, so today's "
                "upload rules cannot check it; upload it again (POST /v1/files) and name the new file's id"
            )
        else:
            text = (
                f"file {record.id} ({record.filename}) was accepted at upload by older upload rules and fails "
                f"today's (version {RULES_VERSION}): {problem}. Fix that row and upload the file again "
                "(POST /v1/files), then name the new file's id"
            )
        super().__init__(text)


def is_current(record: FileRecord) -> bool:
    """True when today's upload rules have checked the file (passed or not), or none apply (not fine-tune)."""
    return record.purpose != CHECKED_PURPOSE or record.rules_version == RULES_VERSION


def rules_problem(record: FileRecord) -> RulesProblem | None:
    """Where the file fails the rules that last checked it; None where it passed (or was never checked)."""
    if record.rules_problem is None:
        return None
    stored = json.loads(record.rules_problem)
    return RulesProblem(row=int(stored["row"]), field=str(stored["field"]), message=str(stored["message"]))


def recheck(files: FileStore, record: FileRecord, *, uploads_dir: Path, max_line_bytes: int) -> FileRecord:
    """The file's record after today's upload rules have checked it: read again and the verdict stored where
    older rules (or none) checked it, else as it is. A file whose bytes are gone is returned unchanged (not
    current). Raises ``FileNotFound`` when it is deleted meanwhile."""
    if is_current(record):
        return record
    try:
        checked = check_fine_tuning_rows(uploads_dir / record.path, max_line_bytes=max_line_bytes)
    except RowProblem as problem:
        found = json.dumps({"row": problem.row, "field": problem.field, "message": problem.message})
        log.warning("file %s fails the upload rules of version %d: %s", record.id, RULES_VERSION, problem)
        return files.record_check(record.id, rules_version=RULES_VERSION, format=None, rows=None, problem=found)
    except OSError as error:  # removed from the disk by hand: nothing to check, nothing to store
        log.warning("file %s could not be read to check it again: %s", record.id, error)
        return record
    log.info("file %s passes the upload rules of version %d (was %s)", record.id, RULES_VERSION, record.rules_version)
    return files.record_check(
        record.id, rules_version=RULES_VERSION, format=checked.format, rows=checked.rows, problem=None
    )


def require_current_rules(
    files: FileStore, record: FileRecord, *, uploads_dir: Path, max_line_bytes: int
) -> FileRecord:
    """``recheck``, then ``FileFailsRules`` unless the file passes today's upload rules: for a job that names it.

    Raises:
        FileFailsRules: naming the file, and the row and field that fail (or that its bytes are gone).
        FileNotFound: the file was deleted meanwhile.
    """
    record = recheck(files, record, uploads_dir=uploads_dir, max_line_bytes=max_line_bytes)
    problem = rules_problem(record) if record.purpose == CHECKED_PURPOSE else None
    if problem is not None or not is_current(record):
        raise FileFailsRules(record, problem)
    return record


def stale_uploads(
    spec: dict[str, Any], files: FileStore, *, uploads_dir: Path, max_line_bytes: int
) -> list[tuple[str, FileFailsRules]]:
    """Each fine-tuning upload a resolved spec names that fails today's upload rules (checked again where older
    rules checked it), with the spec path that names it (``data.path``). Uploads deleted meanwhile are left out:
    the job store refuses those itself (``UploadsGone``)."""
    failing = []
    for file_id, spec_path in uploads_named_at(spec, uploads_dir).items():
        try:
            require_current_rules(files, files.get(file_id), uploads_dir=uploads_dir, max_line_bytes=max_line_bytes)
        except FileNotFound:
            continue
        except FileFailsRules as fails:
            failing.append((spec_path, fails))
    return failing
