"""The docs say what the code does: the README's status table and docs/interfaces.md's field lists are
checked against the code's tables and models (print the status table with `python -m tests.test_docs`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from jobs.events import EVENT_TYPES
from jobs.models.family import ModelFamily
from offload import OffloadStats
from service.queue.status import ALLOWED, JobStatus

REPO = Path(__file__).resolve().parents[1]
TABLE_START = "<!-- status-table: generated from service/queue/status.py ALLOWED; tests/test_docs.py checks it -->"
TABLE_END = "<!-- /status-table -->"


def status_table() -> str:
    """The README's table of transitions, from the state machine itself."""
    rows = ["| from | to |", "|---|---|"]
    for status in JobStatus:
        targets = ", ".join(f"`{t.value}`" for t in JobStatus if t in ALLOWED[status]) or "— (final)"
        rows.append(f"| `{status.value}` | {targets} |")
    return "\n".join([TABLE_START, *rows, TABLE_END])


def test_readme_status_table_is_the_state_machine() -> None:
    readme = (REPO / "README.md").read_text()
    assert TABLE_START in readme and TABLE_END in readme, "README.md lost its status table markers"
    shown = readme[readme.index(TABLE_START) : readme.index(TABLE_END) + len(TABLE_END)]
    assert shown == status_table(), f"README.md's status table is stale; it should read:\n{status_table()}"


def _listed_fields(text: str) -> dict[str, set[str]]:
    """``- `step`: `{type, step, ...}` `` lines of docs/interfaces.md: event type -> field names."""
    found = {}
    for name, fields in re.findall(r"^- `(\w+)`: `\{([^}]*)\}`", text, flags=re.MULTILINE):
        found[name] = {f.split(":")[0].strip() for f in fields.replace("\n", " ").split(",")}
    return found


def test_interfaces_lists_every_event_with_its_fields() -> None:
    listed = _listed_fields((REPO / "docs" / "interfaces.md").read_text())
    declared = {name: set(model.model_fields) for name, model in EVENT_TYPES.items()}
    assert {name: listed.get(name) for name in declared} == declared


def test_interfaces_lists_every_offload_stat() -> None:
    text = (REPO / "docs" / "interfaces.md").read_text()
    paragraph = text[text.index("`OffloadStats` fields") :].split("\n\n")[0]
    listed = set(re.findall(r"`(\w+)`", paragraph)) - {"OffloadStats"}
    assert listed == {f.name for f in dataclasses.fields(OffloadStats)}


def test_model_families_lists_every_registry_field() -> None:
    text = (REPO / "docs" / "model-families.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \|", text, flags=re.MULTILINE)
    assert listed == [f.name for f in dataclasses.fields(ModelFamily)]


if __name__ == "__main__":
    print(status_table())
