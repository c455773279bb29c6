"""Collective bytes of a compiled program, counted from its HLO text.

Per kind (``all-gather``, ``all-to-all``, ``collective-permute``, ``reduce-scatter``,
``all-reduce``, ``collective-broadcast``): the bytes of each collective's result on one
device (an SPMD-partitioned module is one device's program), a ``while`` body counted
``known_trip_count`` times and called computations once per call, as
``jmem._src.hlo_flops`` counts dots. An asynchronous pair (``all-gather-start`` /
``all-gather-done``) counts once, at its ``-done`` (whose shape is the result); a
collective wrapped in ``async-start`` counts inside the wrapped computation. The result
is what lands on the device: for an all-gather the gathered array, for a reduce-scatter
the device's shard, for an all-reduce the reduced array, for an all-to-all and a
collective-permute the received array.
"""

from __future__ import annotations

import math
import re

from jmem._src.hlo_flops import _computations

__all__ = ["KINDS", "collective_bytes"]

#: the collective kinds counted, as HLO spells them
KINDS = (
    "all-gather",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
    "all-reduce",
    "collective-broadcast",
)

_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
#: bits per element of HLO's element types (sub-byte types count a fraction of a byte)
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16}
_BITS.update({"bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64})
_BITS.update({"c64": 64, "c128": 128})


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string (an array ``bf16[4,128]{1,0}`` or a tuple of them);
    fp8 types (``f8e4m3fn``...) count 1 byte, ``token[]`` and unknown types 0."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        bits = 8 if dtype.startswith("f8") else _BITS.get(dtype, 0)
        total += bits / 8 * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _kind(op: str) -> str | None:
    """The counted kind of HLO opcode ``op`` (``all-gather``, ``all-gather-done``), None for
    a ``-start`` or any other op."""
    base = op[: -len("-done")] if op.endswith("-done") else op
    return base if base in KINDS else None


def collective_bytes(hlo_text: str) -> dict[str, float]:
    """The bytes each kind of collective delivers per execution of a compiled module.

    Args:
      hlo_text: ``jax.stages.Compiled.as_text()`` (the optimized HLO module).

    Returns:
      ``{kind: bytes}`` for every kind of ``KINDS`` (0.0 where none runs), per device for an
      SPMD module, loops counted by trip count (module docstring).

    Raises:
      ValueError: a ``while`` loop with a collective inside and no known trip count.
    """
    comps, entry = _computations(hlo_text)
    memo: dict[str, dict[str, float]] = {}

    def add(total: dict, part: dict, times: int = 1) -> None:
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + times * v

    def count(comp: str) -> dict[str, float]:
        if comp not in memo:
            memo[comp] = {}  # a recursive reference counts nothing
            total: dict[str, float] = {}
            for _, shape, op, rest in comps.get(comp, []):
                kind = _kind(op)
                if kind is not None:
                    add(total, {kind: shape_bytes(shape)})
                elif op == "while":
                    body = count(re.search(r"body=%([\w.-]+)", rest).group(1))
                    n = _TRIP_COUNT.search(rest)
                    if n is None and any(body.values()):
                        raise ValueError("a while loop with collectives and no known trip count.")
                    add(total, body, int(n.group(1)) if n else 0)
                else:
                    for c in re.findall(r"(?:calls|to_apply)=%([\w.-]+)", rest):
                        add(total, count(c))
            memo[comp] = total
        return memo[comp]

    found = count(entry) if entry else {}
    return {k: float(found.get(k, 0.0)) for k in KINDS}
