"""Human units for counts (parameters, weights, tokens) in reports: ``1_400_000 ->
'1.4M'``; bytes are ``jmem.MemoryReport.format_bytes``'s (binary units)."""

from __future__ import annotations

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
