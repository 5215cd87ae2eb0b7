"""The model-family registry: one entry per family, and the spec, rules and estimate all go through it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import pytest
from torch import nn

from jobs.models.family import ModelFamily
from jobs.models.registry import FAMILIES, family_of
from jobs.models.toy_mlp import build_toy_mlp, toy_activation_bytes, toy_loss
from jobs.spec.job import JobSpec
from jobs.spec.sections import Section


def test_model_section_accepts_exactly_the_registered_families() -> None:
    schema = JobSpec.model_json_schema()
    mapping = schema["properties"]["model"]["discriminator"]["mapping"]
    assert set(mapping) == set(FAMILIES)
    assert {"toy_mlp", "transformer_lm", "hf_causal_lm"} <= set(FAMILIES)


def test_every_family_is_registered_under_its_spec_kind() -> None:
    for kind, family in FAMILIES.items():
        assert family.kind == kind
        assert family.spec.model_fields["kind"].annotation.__args__ == (kind,)
        assert family.data_kinds, kind


def test_an_unknown_kind_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="model.kind 'nope' is not a registered family \\(one of: toy_mlp, "):
        family_of("nope")


def test_a_family_whose_spec_disagrees_on_its_kind_is_refused() -> None:
    class OtherSpec(Section):
        kind: Literal["other"]

    with pytest.raises(AssertionError, match="OtherSpec.kind != 'mine'"):
        ModelFamily(
            kind="mine",
            spec=OtherSpec,
            build=build_toy_mlp,
            loss=toy_loss,
            data_kinds=("synthetic_regression",),
            meta_model=lambda spec: nn.Linear(1, 1),
            activation_bytes=toy_activation_bytes,
            lora_target_names=lambda spec: [],
        )


def test_built_in_lora_names_come_from_the_meta_model() -> None:
    toy = family_of("toy_mlp")
    assert toy.lora_target_names(toy.spec(kind="toy_mlp", hidden_size=8, num_layers=2)) == ["layers.0", "layers.1"]
    assert family_of("hf_causal_lm").lora_target_names(None) is None  # known once loaded
    assert family_of("toy_mlp").module_names_from_files is None  # its names come from the spec alone


def test_no_model_kind_branch_is_left_in_jobs() -> None:
    """Per-family decisions are registry fields: nothing in jobs/ tests ``model.kind`` against a name."""
    jobs = Path(__file__).resolve().parents[3] / "jobs"
    branches = [
        f"{path.relative_to(jobs.parent)}:{number}: {line.strip()}"
        for path in sorted(jobs.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"model\??\.kind\s*[!=]=|[!=]=\s*\w*\.?model\.kind", line)
    ]
    assert branches == []
