"""axolotl's LoRA keys as Ferry's ``lora`` section, including a regex string of target modules.

peft reads a string ``target_modules`` as a regular expression that must match a module's whole dotted name
(``model.layers.[\\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj``); Ferry's ``lora.target_modules`` is a list
of names, each matching the modules whose dotted name ends with it, in every layer. A regex converts to the last
names it spells out (``up_proj``, ``down_proj``, ...) when that picks the same kind of module in every layer; a
regex that names particular layers, or whose last name is a wildcard, is refused with the fix.
"""

from __future__ import annotations

import itertools
import re
import re._parser as sre_parse  # type: ignore[import-not-found]  # the standard library's own regex parser: the tree peft's regex compiles from
from typing import Any

from jobs.convert.axolotl.reader import AxolotlConfig, shown

# What lora_target_linear (and peft's "all-linear") expands to: every linear layer of a Llama-style decoder.
LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_TARGETS = ["q_proj", "v_proj"]  # peft's default for Llama-style models
_WILD, _INDEX = "\0", "\1"  # stand-ins for "any text" and "any number" in an expanded regex
_MAX_EXPANSIONS = 4096
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.]+")


def lora_section(config: AxolotlConfig, notes: list[str]) -> dict[str, Any] | None:
    """The ``lora`` section, or ``None`` without ``adapter: lora | qlora``.

    Raises:
        ValueError: an adapter Ferry does not train, or target modules that do not convert (with the fix).
    """
    adapter = config.text("adapter", example="lora")
    if adapter is None:
        return None
    if adapter not in ("lora", "qlora"):
        raise ValueError(
            f"adapter: {shown(adapter)} is not an adapter Ferry trains (lora, qlora); remove it to train the whole model"
        )
    lora: dict[str, Any] = {"target_modules": _targets(config, notes)}
    rank, alpha = config.integer("lora_r"), config.number("lora_alpha", example="32")
    if rank is not None:
        lora["rank"] = rank
    if alpha is not None:
        lora["alpha"] = int(alpha) if alpha.is_integer() else alpha
    dropout = config.number("lora_dropout", example="0.05")
    if dropout is not None:
        lora["dropout"] = dropout
    modules_to_save = config.names("lora_modules_to_save", example="[embed_tokens, lm_head]")
    if modules_to_save:
        lora["modules_to_save"] = modules_to_save
    if config.flag("peft_use_dora"):
        lora["use_dora"] = True
    if config.flag("peft_use_rslora"):
        lora["use_rslora"] = True
    return lora


def _targets(config: AxolotlConfig, notes: list[str]) -> list[str]:
    raw = config.raw("lora_target_modules")
    linear = config.flag("lora_target_linear") or raw == "all-linear"
    if raw is None or raw == "all-linear":
        names: list[str] = []
    elif isinstance(raw, str):
        names = regex_targets(raw)
        if not _PLAIN_NAME.fullmatch(raw):
            notes.append(
                f"lora_target_modules: the regex {_quoted(raw)} is converted to the modules it names, "
                f"{', '.join(names)}, matched by name in every layer"
            )
    else:
        names = config.names("lora_target_modules") or []
    if linear:
        notes.append(
            "lora_target_linear: expanded to the Llama-style linear layers "
            f"({', '.join(LINEAR_MODULES)}); set lora.target_modules for other architectures"
        )
        names += [m for m in LINEAR_MODULES if m not in names]
    return names or list(DEFAULT_TARGETS)


def regex_targets(pattern: str) -> list[str]:
    """The module names a peft target regex selects in every layer, in the order it spells them.

    Example:
        >>> regex_targets(r"model.layers.[\\d]+.(mlp|self_attn).(up|down|q)_proj")
        ['up_proj', 'down_proj', 'q_proj']

    Raises:
        ValueError: the pattern is not a regex, names particular layers, or leaves its last name open.
    """
    if _PLAIN_NAME.fullmatch(pattern):
        return [pattern.rsplit(".", 1)[-1]] if pattern.replace(".", "") else []
    fix = "write lora_target_modules as a list of module names, e.g. [q_proj, k_proj, v_proj, o_proj]"
    try:
        paths = _expand(sre_parse.parse(pattern))
    except re.error as error:
        raise ValueError(
            f"lora_target_modules: {_quoted(pattern)} is not a regular expression ({error}); {fix}"
        ) from None
    except _TooWide:
        raise ValueError(
            f"lora_target_modules: the regex {_quoted(pattern)} is too open to list its modules; {fix}"
        ) from None
    names: list[str] = []
    layers: set[str] = set()
    for path in paths:
        parts = path.split(".")
        leaf = parts[-1]
        if not leaf or _WILD in leaf or _INDEX in leaf:
            raise ValueError(
                f"lora_target_modules: the regex {_quoted(pattern)} does not spell out the last name of the "
                f"modules it picks, so Ferry cannot list them; {fix}"
            )
        layers |= {p for p in parts[:-1] if p.isdigit()}
        if leaf not in names:
            names.append(leaf)
    if layers:
        raise ValueError(
            f"lora_target_modules: the regex {_quoted(pattern)} picks particular layers "
            f"({', '.join(sorted(layers, key=int))}); Ferry's lora.target_modules names modules for every layer; "
            f"{fix}, to train them in every layer"
        )
    return names


def _quoted(pattern: str) -> str:
    """The pattern as the user wrote it (backslashes single), unless it holds a line break or control."""
    return f"'{pattern}'" if pattern.isprintable() and len(pattern) <= 120 else shown(pattern, 120)


class _TooWide(Exception):
    """The regex expands to more paths than are worth listing."""


def _expand(tree: Any) -> list[str]:
    """Every string the parsed regex ``tree`` can match, with wildcards as `_WILD` / `_INDEX`."""
    results = [""]
    for op, argument in tree:
        choices = _expand_one(op, argument)
        results = [a + b for a, b in itertools.product(results, choices)]
        if len(results) > _MAX_EXPANSIONS:
            raise _TooWide
    return list(dict.fromkeys(results))


def _expand_one(op: Any, argument: Any) -> list[str]:
    name = str(op)
    if name == "LITERAL":
        return [chr(argument)]
    if name == "ANY":
        return ["."]  # an unescaped dot between names means the dot (``model.layers``), as peft's authors write it
    if name == "IN":
        return _expand_class(argument)
    if name == "SUBPATTERN":
        return _expand(argument[-1])
    if name == "BRANCH":
        return [s for branch in argument[1] for s in _expand(branch)]
    if name == "AT":
        return [""]
    if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        low, high, sub = argument
        inner = _expand(sub)
        if len(sub) == 1 and str(sub[0][0]) == "ANY":
            return [_WILD]  # ``.*``, ``.+``
        if all(s == _INDEX for s in inner):
            return [_INDEX]  # ``\d+``, ``[\d]+``: any layer
        if low == 0 and high == 1:
            return ["", *inner]  # ``(shared_experts.)?``
        raise _TooWide
    raise _TooWide


def _expand_class(items: Any) -> list[str]:
    if all(str(op) == "LITERAL" for op, _ in items) and len(items) <= 16:
        return [chr(code) for _, code in items]  # ``fc[12]``
    if len(items) == 1 and str(items[0][0]) == "CATEGORY" and str(items[0][1]) == "CATEGORY_DIGIT":
        return [_INDEX]
    if all(str(op) == "RANGE" and "0" <= chr(bounds[0]) <= chr(bounds[1]) <= "9" for op, bounds in items):
        return [_INDEX]
    return [_WILD]
