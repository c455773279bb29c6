"""Memory of a compiled program, without running it (and without a GPU).

``jmem.measure(fn, *args)`` lowers and compiles ``fn`` for the given arguments — arrays
or ``jax.ShapeDtypeStruct``s, so a 7B model is measured on a laptop without allocating
it — and reads XLA's buffer assignment (``Compiled.memory_analysis()``).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

import jax


def format_bytes(n: float) -> str:
    """Human-readable binary units: ``1536 -> '1.50 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of one compiled program, per XLA's buffer assignment (all fields in bytes).

    Attributes:
      argument_bytes: inputs (parameters, optimizer state, batch...).
      output_bytes: outputs.
      alias_bytes: outputs that reuse (donated) input buffers; counted in both above.
      temp_bytes: scratch during execution (activations, gradients, fusion buffers).
      generated_code_bytes: the executable's code.
      host_argument_bytes, host_output_bytes, host_temp_bytes, host_alias_bytes: the same for
        buffers in host memory kinds (``pinned_host``), where the backend reports them.
      peak_bytes: the backend's peak figure where it reports a meaningful one (GPU/TPU),
        else ``argument + output + temp - alias`` (an upper bound: XLA may free arguments
        early). The CPU backend's own peak figure counts arguments only, so it is not used.
      state_bytes (property): bytes that persist between steps when the state is donated,
        i.e. ``argument_bytes``.
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int = 0
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_alias_bytes: int = 0
    host_temp_bytes: int = 0
    peak_bytes: int = 0

    @classmethod
    def from_compiled(cls, compiled: Any) -> MemoryReport:
        """The report of a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``): reuse
        the executable that runs the steps instead of compiling again (``jmem.measure``).

        Raises:
          RuntimeError: if the backend gives no memory analysis.
        """
        return report_from_compiled(compiled)

    @staticmethod
    def format_bytes(n: float) -> str:
        """Bytes in binary units, as the report prints them: ``1536 -> '1.50 KiB'``."""
        return format_bytes(n)

    @property
    def state_bytes(self) -> int:
        """Bytes that persist between steps when the state is donated: ``argument_bytes``."""
        return self.argument_bytes

    def __str__(self) -> str:
        rows = [
            ("arguments", self.argument_bytes),
            ("outputs", self.output_bytes),
            ("aliased (donated)", self.alias_bytes),
            ("temporaries", self.temp_bytes),
            ("peak", self.peak_bytes),
        ]
        if self.host_argument_bytes or self.host_output_bytes or self.host_temp_bytes:
            rows += [
                ("host arguments", self.host_argument_bytes),
                ("host outputs", self.host_output_bytes),
                ("host temporaries", self.host_temp_bytes),
            ]
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{w}}  {format_bytes(v):>12}" for name, v in rows)


def report_from_compiled(compiled: Any) -> MemoryReport:
    """``MemoryReport`` from a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``).

    Raises:
      RuntimeError: if the backend gives no memory analysis.
    """
    ma = compiled.memory_analysis()
    if ma is None:
        raise RuntimeError("This backend reports no memory analysis for compiled programs.")
    get = lambda name: int(getattr(ma, name, 0) or 0)
    arg, out, alias, temp = (
        get("argument_size_in_bytes"),
        get("output_size_in_bytes"),
        get("alias_size_in_bytes"),
        get("temp_size_in_bytes"),
    )
    # The CPU backend's peak figure counts arguments only; use the upper bound there.
    reported = get("peak_memory_in_bytes")
    bound = arg + out + temp - alias
    peak = reported if reported and jax.default_backend() != "cpu" else bound
    return MemoryReport(
        argument_bytes=arg,
        output_bytes=out,
        alias_bytes=alias,
        temp_bytes=temp,
        generated_code_bytes=get("generated_code_size_in_bytes"),
        host_argument_bytes=get("host_argument_size_in_bytes"),
        host_output_bytes=get("host_output_size_in_bytes"),
        host_alias_bytes=get("host_alias_size_in_bytes"),
        host_temp_bytes=get("host_temp_size_in_bytes"),
        peak_bytes=peak,
    )


def measure(fn: Callable, *args, **kwargs) -> MemoryReport:
    """Compiles ``fn(*args, **kwargs)`` and reports its memory, allocating nothing.

    Args:
      fn: a function, or an already ``jax.jit``-ed one (its shardings and donation are kept).
      *args, **kwargs: arrays or ``jax.ShapeDtypeStruct`` pytrees (with shardings if wanted).

    Returns:
      A ``MemoryReport`` (bytes).

    Raises:
      RuntimeError: if the backend gives no memory analysis.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return report_from_compiled(jitted.lower(*args, **kwargs).compile())
