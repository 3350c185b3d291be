"""Value types of command-line flags (argparse ``type=``), shared by every ``kvshm``
command: a bad value is an ``argparse.ArgumentTypeError`` whose message says what was
expected, so argparse reports it naming the flag (exit status 2, no traceback).

This module imports nothing of kvshm but :mod:`kvshm.units`: the commands
(:mod:`kvshm.cli`, :mod:`kvshm.replay.cli`) import it, never each other's flag types.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

__all__ = ["typed", "port_t", "pos_float", "ratio_t", "block_kib_t", "pos_int", "nonneg_int",
           "nonneg_float", "ib_port_t"]


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
