"""Dot FLOPs of a compiled program, counted from its HLO text.

``compiled.cost_analysis()`` counts a ``while`` loop's body once; a layer scan or a
token-chunk loop runs it many times. This counts every ``dot`` as ``2 * prod(out) *
prod(contracted)`` and a ``while`` body ``known_trip_count`` times (XLA's backend config),
fusions and called computations once per call. Per device for an SPMD-partitioned module.
"""

from __future__ import annotations

import math
import re

__all__ = ["dot_flops"]

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+?)(?:\{[^}]*\})? ([\w-]+)\((.*)$")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _dims(shape: str) -> list[int]:
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _computations(text: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str | None]:
    """``({computation: [(name, shape, op, rest)]}, entry name)`` of HLO text."""
    comps: dict = {}
    entry, cur = None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            cur = comps.setdefault(m.group(1), [])
            entry = m.group(1) if line.startswith("ENTRY") else entry
            continue
        m = _INSTRUCTION.match(line)
        if m and cur is not None:
            cur.append(m.groups())
    return comps, entry


def _dot(rest: str, shape: str, shapes: dict[str, str]) -> float:
    lhs = shapes[re.match(r"%(\S+?),", rest).group(1)]
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
    k = math.prod(_dims(lhs)[int(d)] for d in dims.split(",") if d)
    return 2.0 * math.prod(_dims(shape)) * k


def dot_flops(hlo_text: str) -> float:
    """The FLOPs of every ``dot`` of a compiled module, loops counted by trip count.

    Args:
      hlo_text: ``jax.stages.Compiled.as_text()`` (the optimized HLO module).

    Returns:
      FLOPs per execution (per device for an SPMD module), a float.

    Raises:
      ValueError: a ``while`` loop without a known trip count (its work cannot be counted).
    """
    comps, entry = _computations(hlo_text)
    memo: dict[str, float] = {}

    def flops(comp: str) -> float:
        if comp not in memo:
            instructions = comps.get(comp, [])
            shapes = {name: shape for name, shape, _, _ in instructions}
            total = 0.0
            for _, shape, op, rest in instructions:
                if op == "dot":
                    total += _dot(rest, shape, shapes)
                elif op == "while":
                    n = _TRIP_COUNT.search(rest)
                    if n is None:
                        raise ValueError("a while loop without a known trip count.")
                    body = re.search(r"body=%([\w.-]+)", rest).group(1)
                    total += int(n.group(1)) * flops(body)
                else:
                    total += sum(
                        flops(c) for c in re.findall(r"(?:calls|to_apply)=%([\w.-]+)", rest)
                    )
            memo[comp] = total
        return memo[comp]

    return flops(entry) if entry else 0.0
