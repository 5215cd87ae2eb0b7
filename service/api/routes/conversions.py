"""/v1/conversions/axolotl: an axolotl config as a Ferry spec, with the keys it cannot honour and why.

Nothing is checked or queued; ``POST /v1/jobs`` with ``Content-Type: application/x-axolotl+yaml`` converts the
same way and submits.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from service.api.deps import SettingsDep, SpecBody
from service.api.errors import ApiError
from service.api.intake import AXOLOTL_TYPE, axolotl_conversion
from service.api.schemas import ErrorBody

router = APIRouter(prefix="/conversions", tags=["conversions"])
_BODY = {"requestBody": {"required": True, "content": {AXOLOTL_TYPE: {"schema": {"type": "string"}}}}}


class ConversionPublic(BaseModel):
    """The converted spec (as text, warnings as comments, and as data) and the warnings (notes, then ``not converted: KEY because WHY``)."""

    spec_text: str
    spec: dict[str, Any]
    warnings: list[str]


@router.post("/axolotl", openapi_extra=_BODY, responses={422: {"model": ErrorBody}})
def convert_axolotl_config(body: SpecBody, settings: SettingsDep) -> ConversionPublic:
    """Convert an axolotl YAML config (any YAML content type) to a Ferry spec; submit the ``spec_text``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, "invalid_encoding", f"The body is not UTF-8 (byte {error.start}).") from None
    converted = axolotl_conversion(text, max_depth=settings.max_yaml_depth, max_nodes=settings.max_yaml_nodes)
    return ConversionPublic(spec_text=converted.to_yaml(), spec=converted.spec, warnings=converted.warnings)
