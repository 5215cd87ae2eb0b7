"""axolotl configs over HTTP: converted with the keys not converted listed, and submitted as Ferry specs."""

from __future__ import annotations

from pathlib import Path

import httpx

EXAMPLE = (Path(__file__).parents[3] / "configs" / "axolotl" / "llama-lora.yml").read_text()
AXOLOTL = {"content-type": "application/x-axolotl+yaml"}


def test_conversion_route_lists_what_is_not_honoured(client: httpx.Client) -> None:
    answer = client.post("/v1/conversions/axolotl", content=EXAMPLE, headers=AXOLOTL)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["spec"]["lora"]["rank"] == 4 and body["spec"]["training"]["steps"] == 4
    assert "flash_attention" not in " ".join(body["warnings"])  # false: nothing to honour
    assert (
        body["warnings"][1]
        == "not converted: model_type because Ferry reads the architecture from the model's config.json"
    )
    assert body["spec_text"].splitlines()[-1].startswith("# not converted: special_tokens because")
    refused = client.post("/v1/conversions/axolotl", content="base_model: m\n", headers=AXOLOTL)
    assert refused.status_code == 422
    assert refused.json()["error"]["message"] == (
        "The job spec has 1 problem: spec: the axolotl config has no datasets; Ferry needs both"
    )


def test_submit_converts_an_axolotl_config_and_checks_the_spec(client: httpx.Client) -> None:
    # The shared server has no model named llama: the converted spec is checked, and refused for that.
    answer = client.post("/v1/jobs/validate", content=EXAMPLE, headers=AXOLOTL)
    assert answer.status_code == 422
    problems = {p["path"] for p in answer.json()["error"]["problems"]}
    assert {"model.path", "data.path", "data.tokenizer.path"} <= problems
    assert all(p["line"] for p in answer.json()["error"]["problems"])  # lines of the converted spec's text


def test_an_axolotl_body_is_read_under_the_settings_yaml_depth() -> None:
    import pytest

    from service.api.errors import ApiError
    from service.api.intake import AXOLOTL_TYPE, spec_text_from_body

    deep = b"base_model: m\ndatasets: [{path: d.jsonl}]\nspecial_tokens: {a: {b: {c: {d: 1}}}}\n"
    assert spec_text_from_body(deep, AXOLOTL_TYPE, max_depth=32)  # the default limit takes it
    with pytest.raises(ApiError) as error:
        spec_text_from_body(deep, AXOLOTL_TYPE, max_depth=4)  # FERRY_MAX_YAML_DEPTH=4
    assert "nests deeper than 4 levels" in error.value.message
