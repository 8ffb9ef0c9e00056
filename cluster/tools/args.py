"""Command-line value types shared by ``swakv serve``, ``swakv plan`` and ``swakv loadtest``: each turns a
bad value into argparse's usage error naming the flag, before anything starts."""
from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'20GiB', '16 GB', '512MiB', '1.5GiB', '21474836480' -> bytes (GB decimal, GiB binary)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: use a number with an optional unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 20GiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{text!r}: the size must be positive")
    return value


def size_arg(text: str) -> int:
    """A size in bytes (``parse_bytes``)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def positive(kind):
    """A number of type ``kind`` (int or float) > 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value
    return parse


def non_negative(text: str) -> float:
    """A number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value
