"""What counts as an integer or a number in swakv's arguments, defined once for every layer.

``True`` is an ``int`` to Python, never a count or a size to us: ``is_int`` says no to bools. The
``check_*`` helpers raise ValueError with one wording, ``"{name} must be an integer >= {low}, got {value!r}"``,
so a bad value is named the same way wherever it is caught. Hot paths that test ``type(x) is int`` at C
speed keep doing so (the same answer, cheaper).
"""
from __future__ import annotations

import math


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value, low: int | None = None, note: str = "") -> int:
    """``value`` if it is an integer (>= ``low``), else ValueError naming ``name`` (``note``: why the bound)."""
    if not is_int(value) or (low is not None and value < low):
        bound = f" >= {low}" if low is not None else ""
        raise ValueError(f"{name} must be an integer{bound}{f' ({note})' if note else ''}, got {value!r}")
    return value


def check_number(name: str, value, low: float, *, above: bool = False):
    """``value`` if it is a finite number >= ``low`` (> with ``above``), else ValueError naming ``name``."""
    if not is_number(value) or value < low or (above and value == low):
        raise ValueError(f"{name} must be a finite number {'>' if above else '>='} {low}, got {value!r}")
    return value
