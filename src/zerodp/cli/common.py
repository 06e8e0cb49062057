"""What every `zerodp` subcommand shares: usage errors in one line (exit status 2),
failures in one line (exit status 1), and the parsers of sizes and counts."""
from __future__ import annotations

import argparse
import math
import sys


class UsageError(Exception):
    """A mistake in the command line; reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage block) and exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def fail(prog: str, message: str, status: int = 1) -> int:
    sys.stderr.write(f"{prog}: error: {one_line(message)}\n")
    return status


def one_line(message: str) -> str:
    """A message as one line: an exception's text may span several."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def require(*checks: tuple) -> None:
    """A usage error for the first (flag, value, ok, fix) that is not ok, naming all three."""
    for flag, value, ok, fix in checks:
        if not ok:
            raise UsageError(f"{flag} {value:g}: {fix}" if isinstance(value, float) else f"{flag} {value}: {fix}")


def parse_size(text: str) -> float:
    """'32GB' -> 32e9 (the paper's GB), '80GiB' -> 80 * 2**30, '16e9' -> 16e9 bytes."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "tb": 1e12, "gb": 1e9, "mb": 1e6, "t": 1e12,
             "g": 1e9, "m": 1e6, "b": 1}
    t = text.strip().lower()
    for suffix, factor in units.items():
        if t.endswith(suffix):
            number, scale = t[: -len(suffix)], factor
            break
    else:
        number, scale = t, 1
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 32GB, 80GiB or 16e9") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a memory size must be a positive, finite number of bytes "
                                         "such as 32GB")
    return value


def parse_count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count such as 7.5e9") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a parameter count must be a finite number, at least 1")
    return int(round(value))
