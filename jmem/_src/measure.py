"""Memory of a compiled program, without running it (and without a GPU).

``jmem.measure(fn, *args)`` lowers and compiles ``fn`` for the given arguments — arrays
or ``jax.ShapeDtypeStruct``s, so a 7B model is measured on a laptop without allocating
it — and reads XLA's buffer assignment (``Compiled.memory_analysis()``); with
``target="h100_sxm"`` it compiles with XLA:GPU for that device (``jmem.targets``).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

import jax
import numpy as np

from jmem._src import native_logs
from jmem._src import targets as _targets
from jmem._src.hlo_collectives import collective_bytes
from jmem._src.hlo_flops import dot_flops


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
      peak_bytes: the device's peak: the backend's peak figure where it reports a
        meaningful one (GPU/TPU) and no buffer is in host memory; else ``argument + output +
        temp - alias`` (an upper bound: XLA may free arguments early; with host buffers the
        GPU's peak figure adds them in at their own peak, so the device's cannot be read
        from it). The CPU backend's own peak figure counts arguments only, so it is not used.
      host_peak_bytes: host-memory buffers at once, ``host argument + output + temp -
        alias`` (an upper bound); 0 without host memory kinds.
      source: where the figures come from: ``"compiler"`` (XLA's buffer assignment) or
        ``"planner"`` (``jmem.planner``'s analytic model).
      target: the target compiled for (``jmem.targets`` name, e.g. ``"h100_sxm"``, or the
        running backend's, e.g. ``"cpu"``).
      dot_flops: the program's matmul FLOPs per execution (per device), ``while`` loops
        counted by trip count (``jmem._src.hlo_flops``); None where not counted (not asked
        for, or a loop of unknown trip count)
        (``report_from_compiled(..., flops=True)`` and ``TrainStep.measure(flops=True)``
        count them).
      collective_bytes: ``{kind: bytes}`` the program's collectives deliver per execution
        (per device; ``all-gather``, ``all-to-all``, ``collective-permute``,
        ``reduce-scatter``, ``all-reduce``, ``collective-broadcast``), loops by trip count
        (``jmem._src.hlo_collectives``); None where not counted (counted with ``flops``).
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
    host_peak_bytes: int = 0
    source: str = "compiler"
    target: str = ""
    dot_flops: float | None = None
    collective_bytes: dict | None = None

    @classmethod
    def from_compiled(cls, compiled: Any, target: Any = None) -> MemoryReport:
        """The report of a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``): reuse
        the executable that runs the steps instead of compiling again (``jmem.measure``).
        ``target``: the ``jmem.targets`` name or ``Target`` it was compiled for (default: the
        running backend's).

        Raises:
          RuntimeError: if the backend gives no memory analysis.
        """
        return report_from_compiled(compiled, target)

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
            ("device peak", self.peak_bytes),
        ]
        if self.host_argument_bytes or self.host_output_bytes or self.host_temp_bytes:
            rows += [
                ("host arguments", self.host_argument_bytes),
                ("host outputs", self.host_output_bytes),
                ("host temporaries", self.host_temp_bytes),
                ("host peak", self.host_peak_bytes),
            ]
        w = max(len(r[0]) for r in rows)
        lines = [f"{name:<{w}}  {format_bytes(v):>12}" for name, v in rows]
        if self.target:
            lines.append(f"({self.source}: {self.target})")
        return "\n".join(lines)


def _target_name_platform(target: Any) -> tuple[str, str]:
    if target is None:
        return _targets.current().name, jax.default_backend()
    t = _targets.get(target)
    return t.name, t.platform


def report_from_compiled(compiled: Any, target: Any = None, *, flops: bool = False) -> MemoryReport:
    """``MemoryReport`` from a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``)
    for ``target`` (a ``jmem.targets`` name or ``Target``; None: the running backend);
    ``flops=True`` also counts its dot FLOPs and collective bytes from the HLO text
    (``MemoryReport.dot_flops``, ``MemoryReport.collective_bytes``).

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
    host = {k: get(f"host_{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
    host_peak = host["argument"] + host["output"] + host["temp"] - host["alias"]
    name, platform = _target_name_platform(target)
    # The CPU backend's peak figure counts arguments only; use the upper bound there. The
    # GPU's is the peak of device and host buffers together: exact for the device without
    # host buffers; with them, the device's can be neither read off nor subtracted out (the
    # host buffers need not peak with the device's), so the bound, which it never exceeds.
    reported = get("peak_memory_in_bytes")
    bound = arg + out + temp - alias
    if not reported or platform == "cpu":
        peak = bound
    else:
        peak = reported if host_peak == 0 else min(reported, bound)
    return MemoryReport(
        argument_bytes=arg,
        output_bytes=out,
        alias_bytes=alias,
        temp_bytes=temp,
        generated_code_bytes=get("generated_code_size_in_bytes"),
        host_argument_bytes=host["argument"],
        host_output_bytes=host["output"],
        host_alias_bytes=host["alias"],
        host_temp_bytes=host["temp"],
        peak_bytes=peak,
        host_peak_bytes=host_peak,
        source="compiler",
        target=name,
        **(_counted(compiled.as_text()) if flops else {}),
    )


def _counted(text: str) -> dict:
    """``dot_flops`` and ``collective_bytes`` of compiled HLO ``text``; each None where a
    loop's trip count is unknown (its work cannot be counted: the caller says so)."""
    out = {}
    for key, count in (("dot_flops", dot_flops), ("collective_bytes", collective_bytes)):
        try:
            out[key] = count(text)
        except ValueError:
            out[key] = None
    return out


def _sharding_for(s: Any, t: Any, meshes: set) -> Any:
    """``s`` rebuilt on ``t``'s devices: a ``NamedSharding`` on an ``AbstractMesh`` of the
    same axes (so memory kinds survive); None for an unsharded device placement."""
    kind = getattr(s, "memory_kind", None)
    if isinstance(s, jax.sharding.NamedSharding):
        key = (tuple(s.mesh.axis_sizes), tuple(s.mesh.axis_names))
        spec = s.spec
    elif s is None or len(s.device_set) == 1:
        if kind in (None, "device"):
            return None
        key, spec = ((1,), ("_device",)), jax.sharding.PartitionSpec()
    else:
        raise ValueError(
            f"measure(target=) rebuilds argument shardings for the target: use NamedShardings "
            f"(got a {type(s).__name__})."
        )
    meshes.add(key)
    return jax.sharding.NamedSharding(_targets.mesh(t, *key), spec, memory_kind=kind)


def _abstract_for(x: Any, t: Any, meshes: set) -> Any:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(x, np.ndarray):
        return x
    sharding = _sharding_for(getattr(x, "sharding", None), t, meshes)
    weak = bool(getattr(x, "weak_type", False))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=weak)


def _compile_for(jitted: Any, t: Any, args: tuple, kwargs: dict) -> Any:
    """``jitted`` lowered and compiled for target ``t`` (``measure``)."""
    meshes: set = set()
    args, kwargs = jax.tree.map(lambda x: _abstract_for(x, t, meshes), (args, kwargs))
    fn_mesh = getattr(jitted, "mesh", None)  # jmem's ShardedStep
    if isinstance(fn_mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        meshes.add((tuple(fn_mesh.axis_sizes), tuple(fn_mesh.axis_names)))
    if len(meshes) > 1:
        raise ValueError(
            f"measure(target=) needs one mesh shape for all arguments (got {sorted(meshes)})."
        )
    if meshes:
        ctx = jax.set_mesh(_targets.concrete_mesh(t, *meshes.pop()))
    else:
        ctx = jax.default_device(_targets.devices(t, 1)[0])
    with ctx:
        return jitted.lower(*args, **kwargs).compile()


def measure(fn: Callable, *args, target: Any = None, **kwargs) -> MemoryReport:
    """Compiles ``fn(*args, **kwargs)`` and reports its memory, allocating nothing.

    Args:
      fn: a function, or an already ``jax.jit``-ed one (its shardings and donation are kept;
        with ``target=``, shardings in it must be on ``jmem.targets.mesh(target, ...)``).
      *args, **kwargs: arrays or ``jax.ShapeDtypeStruct`` pytrees (with shardings if wanted).
      target: keyword-only and reserved (never passed to ``fn``): a ``jmem.targets`` name
        (``"h100_sxm"``, ``"a100_sxm_80"``, ``"rtx4090"``, ``"cpu"``, ...) or ``Target`` to
        compile for; None (default): the running backend. For a GPU target the program is
        compiled by XLA:GPU for compile-only devices (no GPU needed; ``pip install
        "jmem[gpu-plan]"``, ``JAX_PLATFORMS=cpu``): arrays become ``ShapeDtypeStruct``s,
        their ``NamedSharding``s are rebuilt on the target's mesh of the same axes (memory
        kinds kept), and backend choices made while tracing (attention ``"auto"``) resolve
        for the target. Per-device figures; not autotuned, so kernel choices may differ
        from a compile on the real GPU.

    Returns:
      A ``MemoryReport`` (bytes): device peak and host bytes apart, ``target`` and
      ``source="compiler"``.

    Raises:
      RuntimeError: if the backend gives no memory analysis, or the CUDA plugin is missing
        for a GPU target.
      ValueError: for an unknown target, or arguments sharded on meshes of different shapes.

    Source: XLA's buffer assignment (``jax.stages.Compiled.memory_analysis``); the deviceless
    compile is ``jax.experimental.topologies`` (docs/targets.md).
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return report_from_compiled(compile_for_target(jitted, args, kwargs, target), target)


def compile_for_target(jitted: Any, args: tuple, kwargs: dict, target: Any = None) -> Any:
    """``jitted`` lowered and compiled for ``target`` (None: the running backend), as
    ``measure`` compiles it; returns the ``jax.stages.Compiled``."""
    with native_logs.hidden():
        if target is None or _targets.get(target).platform == jax.default_backend():
            args, kwargs = jax.tree.map(_host_space_struct, (args, kwargs))
            return jitted.lower(*args, **kwargs).compile()
        return _compile_for(jitted, _targets.get(target), args, kwargs)


def _host_space_struct(x: Any) -> Any:
    """A ``ShapeDtypeStruct`` on one device in ``pinned_host`` as the same placement on a
    one-device mesh: JAX (0.10.2) traces a ``SingleDeviceSharding``'s struct in device memory
    whatever its memory kind, so the step compiled for it would not be the step its arrays
    run (host-resident params would be compiled as device ones); a ``NamedSharding`` keeps
    the memory kind in the traced type, as the arrays' own types do."""
    s = getattr(x, "sharding", None)
    if not isinstance(x, jax.ShapeDtypeStruct) or not isinstance(
        s, jax.sharding.SingleDeviceSharding
    ):
        return x
    if s.memory_kind != "pinned_host":
        return x
    mesh = jax.sharding.Mesh(np.asarray(list(s.device_set)), ("_device",))
    named = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(), memory_kind=s.memory_kind
    )
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named, weak_type=x.weak_type)
