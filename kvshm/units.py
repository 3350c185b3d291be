"""Sizes with units, one parser for every flag and option that takes a size.

``parse_size("64KiB") == 65536``; ``parse_size("0.5GiB") == 536870912``; a plain number is
in the unit the flag always had: ``parse_size("1", unit=GiB) == 1 << 30`` (``--prealloc-size
1`` is still 1 GiB, ``--block-size 64`` still 64 KiB, ``--block-bytes 4096`` still 4096
bytes).

Units are binary and case-insensitive: ``B``; ``K``, ``KB``, ``KiB`` (1024); ``M``, ``MB``,
``MiB``; ``G``, ``GB``, ``GiB``; ``T``, ``TB``, ``TiB``. Fractions are allowed
(``1.5GiB``); the result is rounded down to whole bytes.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_size", "format_size", "KiB", "MiB", "GiB", "TiB"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {"": None, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB,
          "mib": MiB, "g": GiB, "gb": GiB, "gib": GiB, "t": TiB, "tb": TiB, "tib": TiB}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")
_NAMES = {1: "bytes", KiB: "KiB", MiB: "MiB", GiB: "GiB", TiB: "TiB"}


def parse_size(text: str | int | float, unit: int = 1) -> int:
    """Bytes of ``text``: a number with an optional unit (see the module docstring).

    Parameters
    ----------
    text : str, int or float
        ``"64KiB"``, ``"0.5GiB"``, ``"4096"``; an int or float is a plain number.
    unit : int
        Bytes of a plain number (the flag's old unit: 1, KiB, MiB or GiB).

    Raises
    ------
    ValueError
        Not a size, an unknown unit, a negative or non-finite number, or more than
        2**63 - 1 bytes; the message says what was expected.
    """
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, (int, float)):
        value, mult = float(text), unit
        exact = text * unit if isinstance(text, int) else None
    else:
        m = _SIZE.match(text)
        if not m:
            raise ValueError(f"{text!r} is not a size (a number with an optional unit, "
                             f"e.g. 64KiB, 0.5GiB; a plain number is in {_NAMES.get(unit, unit)})")
        u = m.group(3).lower()
        if u not in _UNITS:
            raise ValueError(f"{text!r}: unknown unit {m.group(3)!r} (B, KiB, MiB, GiB, TiB; "
                             "K, M, G, T are binary too)")
        mult = _UNITS[u] or unit
        digits = m.group(1)
        exp = int(m.group(2) or 0)
        exact = None
        if "." not in digits and exp >= 0 and exp < 40:
            exact = int(digits) * 10 ** exp * mult
        value = float(digits) * 10.0 ** exp if exp < 308 else math.inf
    if exact is None:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{text!r} is not a size >= 0")
        exact = math.floor(value * mult)
    if exact < 0:
        raise ValueError(f"{text!r} is not a size >= 0")
    if exact >= 1 << 63:
        raise ValueError(f"{text!r} is too large (more than 2**63 - 1 bytes)")
    return int(exact)


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it (``65536`` -> ``64KiB``),
    else with two decimals of the largest unit below it."""
    for mult in (TiB, GiB, MiB, KiB):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{_NAMES[mult]}"
    for mult in (TiB, GiB, MiB, KiB):
        if n >= mult:
            return f"{n / mult:.2f}{_NAMES[mult]}"
    return f"{n}B"
