"""``data.mix`` items are checked as strictly as any section: ``weight: true`` is no weight, and a typo'd key
lists the keys a mix source has (``path, weight``), never an empty list."""

from __future__ import annotations

import pytest

from jobs.errors import JobSpecError
from jobs.spec.loading import load_job_spec

SPEC = """\
name: mixed
model: {{kind: toy_mlp, hidden_size: 8, num_layers: 1}}
data:
  kind: text
  seq_len: 16
  tokenizer: {{kind: byte}}
  mix:
    - {{path: a.jsonl, {source}}}
training: {{steps: 1}}
"""


def problems(source: str) -> dict[str, str]:
    with pytest.raises(JobSpecError) as refused:
        load_job_spec(SPEC.format(source=source))
    return {p.path: p.message for p in refused.value.problems}


def test_true_is_no_weight() -> None:
    assert problems("weight: true")["data.mix.0.weight"] == "must be a number, not true"  # old code: accepted as 1


def test_a_typo_lists_a_sources_keys() -> None:
    found = problems("wieght: 2")
    assert found["data.mix.0.wieght"] == "unknown key (valid keys: path, weight)"  # old code: "valid keys: )"
