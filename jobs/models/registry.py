"""The registry of model families: ``model.kind`` → `ModelFamily` (see jobs/models/family.py).

Adding a family is one new file and one line here:

1. ``jobs/models/my_family.py`` defines the spec section (``class MyFamilySpec(Section)`` with
   ``kind: Literal["my_family"]``), the builder, loss and fit-check formula, and ``FAMILY = ModelFamily(...)``.
2. Import it below and add ``my_family.FAMILY`` to ``FAMILIES``.

Nothing else changes: ``model:`` in the job spec accepts the new kind (the union is built from this list),
the submit-time rules, the fit check, LoRA, gradient checkpointing and checkpoints all look the family up.
docs/model-families.md walks through an example.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from jobs.models import hf_causal_lm, toy_mlp, transformer_lm
from jobs.models.diffusion import family as diffusion
from jobs.models.family import ModelFamily
from jobs.models.vlm import family as vlm
from jobs.spec.sections import Section

BUILT_IN: tuple[ModelFamily[Any], ...] = (
    toy_mlp.FAMILY,
    transformer_lm.FAMILY,
    hf_causal_lm.FAMILY,
    diffusion.FAMILY,
    vlm.FAMILY,
)
FAMILIES: dict[str, ModelFamily[Any]] = {family.kind: family for family in BUILT_IN}


def family_of(model: Any) -> ModelFamily[Any]:
    """The family of a ``model:`` section (or of its ``kind`` string)."""
    kind = model if isinstance(model, str) else model.kind
    try:
        return FAMILIES[kind]
    except KeyError:
        raise ValueError(f"model.kind '{kind}' is not a registered family (one of: {', '.join(FAMILIES)})") from None


def model_spec_annotation() -> Any:
    """``model:``'s type: the union of every family's spec section, told apart by ``kind``."""
    specs = tuple(family.spec for family in FAMILIES.values())
    return Annotated[Union[specs], Field(discriminator="kind")]  # noqa: UP007 (a runtime-built union)


def data_spec_annotation(shared: tuple[type[Section], ...]) -> Any:
    """``data:``'s type: the ``shared`` data sections, then every family's own, told apart by ``kind``."""
    specs = (*shared, *(spec for family in FAMILIES.values() for spec in family.data_specs))
    return Annotated[Union[specs], Field(discriminator="kind")]  # noqa: UP007 (a runtime-built union)


def task_annotation() -> tuple[Any, str]:
    """``task:``'s type (``train`` and every family's own tasks) and the help on the families' tasks."""
    names = ("train", *(name for family in FAMILIES.values() for name in family.tasks))
    helps = [f"{name}: {text}" for family in FAMILIES.values() for name, text in family.task_help.items()]
    return Literal[names], "; ".join(helps)


def job_sections() -> dict[str, tuple[Any, Any]]:
    """The top-level job sections the families add, ``name -> (annotation, Field)``, in registry order."""
    return {name: section for family in FAMILIES.values() for name, section in family.job_sections.items()}


def training_fields() -> dict[str, tuple[Any, Any]]:
    """The ``training:`` fields the families add, ``name -> (annotation, Field)``, in registry order."""
    return {name: entry for family in FAMILIES.values() for name, entry in family.training_fields.items()}
