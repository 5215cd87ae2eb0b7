"""An axolotl mapping read through typed getters that remember every key they were asked for.

The converter never indexes the raw dictionary: each value is fetched as the type Ferry needs, so a wrongly
typed value (``lora_r: "abc"``, ``datasets: 5``) is a ``ValueError`` naming the key and the fix instead of a
``TypeError`` deep inside the conversion, and the keys nobody asked for are known at the end, so none is
dropped without being listed.
"""

from __future__ import annotations

import math
from typing import Any


def shown(value: Any, limit: int = 60) -> str:
    """``repr`` of a user's value, cut to ``limit`` characters: escapes every line break, so it is one line."""
    text = ascii(value) if not isinstance(value, str) else repr(value)
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def key_shown(key: str) -> str:
    """A key as written, or quoted when it holds anything but printable characters (a newline, U+2028)."""
    return key if key.isprintable() and key.strip() == key and key else shown(key)


class AxolotlConfig:
    """One axolotl mapping (the whole config, or one entry of ``datasets``) and the keys read from it.

    Example:
        >>> config = AxolotlConfig({"lora_r": 16, "debug": True})
        >>> config.integer("lora_r"), config.unread()
        (16, ['debug'])
    """

    def __init__(self, data: dict[str, Any], where: str = "") -> None:
        # axolotl reads an empty value as unset; so does Ferry (``lora_model_dir:`` with nothing after it).
        self._data = {str(k): v for k, v in data.items() if v is not None and v != ""}
        self.where = where  # "datasets[1]." for an entry: the prefix of every key it names
        self._read: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def keys(self) -> list[str]:
        """Every key that is set, in the config's order."""
        return list(self._data)

    def unread(self) -> list[str]:
        """The keys that are set and that no getter has asked for, in the config's order."""
        return [key for key in self._data if key not in self._read]

    def name(self, key: str) -> str:
        """``key`` as the user knows it (``datasets[1].type``)."""
        return f"{self.where}{key}"

    def raw(self, key: str) -> Any:
        """The value as parsed (``None`` when unset); the key counts as read."""
        self._read.add(key)
        return self._data.get(key)

    def integer(self, key: str, *, example: int = 16) -> int | None:
        """An integer (or a string or float that is one: axolotl's pydantic reads those too)."""
        value = self.raw(key)
        if value is None:
            return None
        number = _number(value)
        if number is None or not number.is_integer():
            raise self._wrong(key, "an integer", str(example), value)
        return int(number)

    def number(self, key: str, *, example: str = "0.0002") -> float | None:
        """A float; YAML 1.1 reads ``2e-4`` as a string, which is parsed here."""
        value = self.raw(key)
        if value is None:
            return None
        number = _number(value)
        if number is None:
            raise self._wrong(key, "a number", example, value)
        return number

    def flag(self, key: str) -> bool:
        """A boolean (``true``/``false``, as YAML or as a string); unset is false."""
        value = self.raw(key)
        if value is None:
            return False
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise self._wrong(key, "true or false", "true", value)
        return value

    def text(self, key: str, *, example: str = "name") -> str | None:
        """A string (a number is taken as its text: ``revision: 1``)."""
        value = self.raw(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise self._wrong(key, "a string", example, value)
        return str(value)

    def names(self, key: str, *, example: str = "[q_proj, v_proj]") -> list[str] | None:
        """A list of strings; one string alone is a list of one."""
        value = self.raw(key)
        if value is None:
            return None
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self._wrong(key, "a list of names", example, value)
        return list(value)

    def mapping(self, key: str, *, example: str = "{role: role, content: content}") -> dict[str, Any] | None:
        """A mapping, its keys as strings."""
        value = self.raw(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._wrong(key, "a mapping", example, value)
        return {str(k): v for k, v in value.items()}

    def _wrong(self, key: str, kind: str, example: str, value: Any) -> ValueError:
        name = key_shown(self.name(key))
        return ValueError(f"{name}: must be {kind}, e.g. {key_shown(key)}: {example}; got {shown(value)}")


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` (a bool is not a number: ``true`` is refused, not read as 1)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None
