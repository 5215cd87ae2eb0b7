"""Sizes as people read them; plain Python, so the service's API process can format them without torch."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """A size in the unit that shows it: ``512 B``, ``3.4 KiB``, ``12.0 MiB``, ``1.50 GiB`` (never "0.00 GiB")."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if scale >= 2**30 else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
