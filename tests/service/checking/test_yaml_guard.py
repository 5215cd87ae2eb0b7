"""Spec shape limits, checked before any YAML is expanded."""

from __future__ import annotations

import time

import pytest

from service.checking.yaml_guard import YamlShapeError, check_yaml_shape

BOMB = "\n".join(
    [f"a0: &a0 [{', '.join(['x'] * 9)}]"] + [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]" for n in range(1, 9)]
)  # 9**9 strings once expanded, in 400 bytes


def test_alias_bomb_is_refused_quickly() -> None:
    start = time.perf_counter()
    with pytest.raises(YamlShapeError, match="expands to more than 20000 YAML nodes"):
        check_yaml_shape(BOMB, max_depth=32, max_nodes=20_000)
    assert time.perf_counter() - start < 1.0


def test_modest_anchor_reuse_is_fine() -> None:
    check_yaml_shape("base: &b {lr: 1, steps: 2}\none: *b\ntwo: *b\n", max_depth=32, max_nodes=100)


def test_deep_nesting_is_refused_with_its_line() -> None:
    with pytest.raises(YamlShapeError) as error:
        check_yaml_shape(
            "a:\n" + "".join("  " * n + f"k{n}:\n" for n in range(1, 40)) + "  " * 40 + "v: 1\n",
            max_depth=32,
            max_nodes=1000,
        )
    assert str(error.value) == "the spec nests deeper than 32 levels; flatten it"
    assert error.value.line == 33  # where the 33rd mapping opens


def test_malformed_yaml_names_the_line() -> None:
    with pytest.raises(YamlShapeError) as error:
        check_yaml_shape("name: t\nmodel: {kind: toy_mlp\n", max_depth=32, max_nodes=1000)
    assert str(error.value) == (
        "the spec is not valid YAML: expected ',' or '}', but got '<stream end>' at line 3, column 1"
    )
