"""Human units: counts (parameters, weights, tokens) in reports (``1_400_000 -> '1.4M'``;
bytes are ``jmem.MemoryReport.format_bytes``'s, binary units), and memory sizes read from
text (``"24GB"``, ``"24GiB"``). No JAX import: the command lines' flag types use it."""

from __future__ import annotations

import math
import re
from typing import Any

#: Decimal suffixes, largest first (``B`` for billions, as model sizes are written).
_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))


def format_count(n: float) -> str:
    """A count with three significant digits and a decimal suffix: ``950 -> '950'``,
    ``3_200 -> '3.2K'``, ``1_400_000 -> '1.4M'``, ``6_738_415_616 -> '6.74B'``; never
    ``'0.00B'`` (the suffix is chosen for the value, after rounding).

    Args:
      n: a count (int or float; negative counts keep their sign).

    Returns:
      The text, without a unit name (``f"{format_count(n)} params"``).
    """
    n = float(n)
    for suffix, scale in _UNITS:
        if abs(n) >= scale * (1 - 5e-4):  # 999_600 is '1M', not '1e+03K'
            value = n / scale
            return f"{value:,.0f}{suffix}" if abs(value) >= 999.5 else f"{value:.3g}{suffix}"
    return f"{n:.0f}" if n == round(n) else f"{n:.3g}"


#: A decimal gigabyte and a binary gibibyte, in bytes.
GB = 10**9
GiB = 2**30

_MEM_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(memory: Any) -> int:
    """Bytes from ``24e9``, ``"24GB"`` (1e9), ``"24GiB"`` (2**30), ``"80G"``, ``"512MiB"``.

    Raises:
      ValueError: for an unparsable string, a non-positive amount, or a string without a
        unit under 1 MiB (``"24"``: a likely missing unit; a Python number is taken as bytes).
      TypeError: for anything but a number or a string.
    """
    if isinstance(memory, bool):
        raise TypeError("memory must be a number of bytes or a string like '24GB'.")
    if isinstance(memory, (int, float)):
        value = float(memory)
    elif isinstance(memory, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", memory)
        if not m or m.group(2).lower() not in _MEM_UNITS:
            raise ValueError(
                f"Cannot read memory {memory!r}; write e.g. '24GB', '24GiB', "
                "'80G' or a number of bytes."
            )
        value = float(m.group(1)) * _MEM_UNITS[m.group(2).lower()]
    else:
        raise TypeError(
            f"memory must be bytes or a string like '24GB'; got {type(memory).__name__}."
        )
    if not math.isfinite(value) or value <= 0 or value > 2**70:
        raise ValueError(f"memory must be a positive, finite size (< 1 ZiB); got {memory!r}.")
    if isinstance(memory, str) and not re.search(r"[A-Za-z]", memory) and value < 2**20:
        raise ValueError(
            f"memory {memory!r} has no unit and is under 1 MiB; write e.g. "
            f"'{memory}GB' or '{memory}GiB' (a bare number means bytes)."
        )
    return int(value)
