"""Value types of command-line flags (argparse ``type=``), shared by every ``kvshm``
command: a bad value is an ``argparse.ArgumentTypeError`` whose message says what was
expected, so argparse reports it naming the flag (exit status 2, no traceback).

This module imports nothing of kvshm but :mod:`kvshm.units` (sizes take units
everywhere: ``64KiB``, ``0.5GiB``; a plain number keeps the flag's old unit): the commands
(:mod:`kvshm.cli`, :mod:`kvshm.replay.cli`) import it, never each other's flag types.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

from kvshm.units import GiB, KiB, MiB, format_size, parse_size

__all__ = ["typed", "size_t", "port_t", "pos_float", "ratio_t", "block_kib_t", "pos_int",
           "nonneg_int", "nonneg_float", "ib_port_t", "pool_size_t", "block_size_t",
           "bytes_t", "gib_size_t", "gib_size0_t", "mib_size_t"]


def typed(conv: Callable[[str], Any], check: Callable[[Any], bool], what: str
          ) -> Callable[[str], Any]:
    """A flag type: ``conv(text)``, then ``check(value)``; either failing is a usage error
    saying the value is not ``what``."""
    def parse(text: str) -> Any:
        try:
            v = conv(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not check(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return v

    parse.__name__ = what
    return parse


port_t = typed(int, lambda v: 0 <= v <= 65535, "a port number (0-65535)")
pos_float = typed(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
ratio_t = typed(float, lambda v: 0.0 <= v <= 1.0, "a ratio in [0, 1]")
block_kib_t = typed(int, lambda v: v >= 4 and v % 4 == 0,
                    "a block size in KiB (>= 4, multiple of 4)")
pos_int = typed(int, lambda v: v > 0, "an integer > 0")
nonneg_int = typed(int, lambda v: v >= 0, "an integer >= 0")
nonneg_float = typed(float, lambda v: v >= 0, "a number >= 0")
ib_port_t = typed(int, lambda v: 1 <= v <= 255, "a port number (1-255)")


def size_t(unit: int, check: Callable[[int], bool] = lambda v: v > 0,
           what: str = "> 0", result: int | None = None) -> Callable[[str], Any]:
    """A size flag (:func:`kvshm.units.parse_size`): ``64KiB``, ``0.5GiB``, or a plain
    number in ``unit`` bytes (the flag's old unit). ``check(bytes)`` must hold, else a
    usage error saying ``what`` was expected. Returns bytes (an int), or with ``result``
    the size in that unit, as the flag always gave it (``--prealloc-size 512MiB`` -> 0.5
    GiB), so code reading the parsed flags does not change."""
    plain = {1: "bytes", KiB: "KiB", MiB: "MiB", GiB: "GiB"}.get(unit, f"x{unit} bytes")

    def parse(text: str) -> Any:
        try:
            v = parse_size(text, unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not check(v):
            raise argparse.ArgumentTypeError(f"{text!r} ({format_size(v)}) is not a size "
                                             f"{what}")
        if result is None:
            return v
        return v // result if v % result == 0 and result <= KiB else v / result

    parse.__name__ = f"a size (e.g. 64KiB, 0.5GiB; a plain number is {plain})"
    return parse


#: ``--prealloc-size``: a plain number is GiB; gives GiB (a float).
pool_size_t = size_t(GiB, lambda v: v > 0, result=GiB)
#: ``--block-size``: a plain number is KiB; at least 4 KiB, a multiple of 4 KiB; gives
#: KiB (an int).
block_size_t = size_t(KiB, lambda v: v >= 4 * KiB and v % (4 * KiB) == 0,
                      "of at least 4KiB, a multiple of 4KiB", result=KiB)
#: A size whose plain number is bytes (0 allowed: "no limit" where the flag says so);
#: gives bytes.
bytes_t = size_t(1, lambda v: v >= 0, ">= 0")
#: A size whose plain number is GiB, > 0; gives GiB (a float).
gib_size_t = size_t(GiB, lambda v: v > 0, result=GiB)
#: A size whose plain number is GiB, >= 0; gives GiB (a float).
gib_size0_t = size_t(GiB, lambda v: v >= 0, ">= 0", result=GiB)
#: A size whose plain number is MiB, >= 0; gives MiB (a float).
mib_size_t = size_t(MiB, lambda v: v >= 0, ">= 0", result=MiB)
