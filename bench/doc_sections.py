"""Replace one named section of a Markdown file, leaving the others as they are.

Several bench scripts write into the same document (``docs/gpu-e2e.md``: the single-GPU run, the Ray run,
the multi-GPU run); each owns the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``, so a
re-run of one replaces its own figures and keeps everyone else's.
"""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, name: str, text: str, *, title: str = "") -> None:
    """Put ``text`` between the section's markers, appending the section when the file lacks it."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text.strip()}\n{end}"
    current = path.read_text() if path.exists() else (f"# {title}\n" if title else "")
    if start in current and end in current:
        before, rest = current.split(start, 1)
        _, after = rest.split(end, 1)
        updated = before + block + after
    else:
        updated = current.rstrip() + "\n\n" + block + "\n"
    path.write_text(updated)
