"""From a request body to the spec's text (content type, encoding, JSON), and the 422 that lists a spec's problems.

The spec itself is checked in the spec checker's process (``service/checking/``)."""

from __future__ import annotations

import json

from jobs.convert.axolotl import AxolotlConversion, convert_axolotl
from service.checking.yaml_guard import MAX_DEPTH, MAX_NODES
from service.errors import ApiError, spec_error

YAML_TYPES = frozenset({"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "text/plain"})
JSON_TYPES = frozenset({"application/json"})
AXOLOTL_TYPE = "application/x-axolotl+yaml"  # an axolotl config, converted to a spec first (jobs/convert/axolotl.py)


def spec_text_from_body(
    body: bytes, content_type: str | None, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES
) -> str:
    """The spec as text; JSON is accepted as is because JSON is YAML. An axolotl config is converted first,
    read under the YAML limits given (the settings' ``max_yaml_depth`` and ``max_yaml_nodes``)."""
    media_type = (content_type or "application/yaml").split(";")[0].strip().lower()
    if media_type not in YAML_TYPES | JSON_TYPES | {AXOLOTL_TYPE}:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type {media_type!r} is not accepted; send the spec as application/yaml "
            f"(or text/yaml) or as application/json, or an axolotl config as {AXOLOTL_TYPE}.",
        )
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(
            400, "invalid_encoding", f"The body is not UTF-8 (byte {error.start}); save the spec as UTF-8."
        ) from None
    if not text.strip():
        raise spec_error(
            [{"path": "", "message": "the body is empty; send a job spec", "line": None, "suggestion": None}]
        )
    if media_type in JSON_TYPES:
        _check_json(text)
    if media_type == AXOLOTL_TYPE:
        return axolotl_conversion(text, max_depth=max_depth, max_nodes=max_nodes).to_yaml()
    return text


def axolotl_conversion(text: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> AxolotlConversion:
    """The Ferry spec of an axolotl config (what is not converted becomes comments at the end of its text), or a 422.

    The config is read here, in the API process, under the YAML shape guard with the limits given, so an alias
    bomb stops before it expands; the converted text is read back before it is returned (conversion.py)."""
    try:
        return convert_axolotl(text, max_depth=max_depth, max_nodes=max_nodes)
    except ValueError as error:
        raise spec_error([{"path": "", "message": str(error), "line": None, "suggestion": None}]) from None


def _check_json(text: str) -> None:
    try:
        json.loads(text)
    except RecursionError:
        raise spec_error(
            [{"path": "", "message": "the JSON body nests too deep; flatten it", "line": None, "suggestion": None}]
        ) from None
    except json.JSONDecodeError as error:
        raise spec_error(
            [
                {
                    "path": "",
                    "message": f"the body is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}",
                    "line": error.lineno,
                    "suggestion": None,
                }
            ]
        ) from None
    except ValueError as error:  # an integer of over 4300 digits
        raise spec_error(
            [
                {
                    "path": "",
                    "message": f"the JSON body holds a number no field can take ({error})",
                    "line": None,
                    "suggestion": None,
                }
            ]
        ) from None
