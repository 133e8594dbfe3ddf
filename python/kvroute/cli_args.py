"""Argument types for the ``kvroute`` command line: each checks its value at parse time, so bad
input gets argparse's one-line error and exit status 2, never a traceback from deep inside a run.

>>> integer(1)("3"), number(0, above=True)("0.5"), port("8000")
(3, 0.5, 8000)
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import NoReturn

__all__ = ["OneLineErrors", "existing_file", "integer", "number", "port", "rate_list"]


class OneLineErrors(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (``kvroute simulate: error: ...``, and where
    the options are listed) and exit status 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An integer in ``lo..=hi`` (either bound optional)."""
    want = "an integer" + (f" >= {lo}" if lo is not None else "") + (f" and <= {hi}" if hi is not None else "")

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {s!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {want}, got {s!r}")
        return v

    parse.__name__ = "integer"
    return parse


def number(lo: float | None = None, *, above: bool = False, hi: float | None = None) -> Callable[[str], float]:
    """A finite number ``>= lo`` (``> lo`` with ``above``) and ``<= hi``."""
    want = (
        "a finite number" + (f" {'>' if above else '>='} {lo:g}" if lo is not None else "") + (f" and <= {hi:g}" if hi is not None else "")
    )

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {s!r}") from None
        bad_lo = lo is not None and (v <= lo if above else v < lo)
        if not math.isfinite(v) or bad_lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {want}, got {s!r}")
        return v

    parse.__name__ = "number"
    return parse


def port(s: str) -> int:
    """A TCP port to listen on: 1..65535, or 0 for any free one."""
    return integer(0, 65535)(s)


def existing_file(s: str) -> str:
    """A path to a readable file."""
    if not os.path.isfile(s):
        raise argparse.ArgumentTypeError(f"no such file: {s!r}")
    if not os.access(s, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {s!r}")
    return s


def file_in_existing_dir(s: str) -> str:
    """A file path whose directory exists; the file itself may appear later (written by another process)."""
    d = os.path.dirname(os.path.abspath(s))
    if not os.path.isdir(d):
        raise argparse.ArgumentTypeError(f"no such directory: {d!r}")
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s!r} is a directory, not a file")
    return s


def rate_list(s: str) -> list[float]:
    """Rates (> 0): ``40``, a list ``40,70``, or an inclusive range ``40:90:10`` (start <= stop, step > 0)."""
    out: list[float] = []
    for part in s.replace(" ", "").split(","):
        if not part:
            continue
        if ":" in part:
            pieces = part.split(":")
            if len(pieces) != 3:
                raise argparse.ArgumentTypeError(f"a range is START:STOP:STEP, got {part!r}")
            a, b, c = (number(0, above=True)(x) for x in pieces)
            if a > b:
                raise argparse.ArgumentTypeError(f"empty range {part!r}: START must be <= STOP")
            n = math.floor((b - a) / c + 1e-9) + 1
            if n > 10_000:
                raise argparse.ArgumentTypeError(f"range {part!r} has {n} values; at most 10000")
            out += [round(a + k * c, 9) for k in range(n)]
        else:
            out.append(number(0, above=True)(part))
    if not out:
        raise argparse.ArgumentTypeError(f"expected one or more numbers > 0, got {s!r}")
    return out
