"""Compile targets: the machine a program is compiled and measured for, which need not be the
machine running the compile (XLA's deviceless ahead-of-time compile for NVIDIA GPUs, through
``jax.experimental.topologies`` and the CUDA PJRT plugin; the device facts follow XLA's
``xla/backends/gpu/target_config/specs`` and NVIDIA's data sheets; docs/targets.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import jax
import numpy as np

from jmem._src.names import COMPILE_TARGET_NAMES
from jmem._src.names import check_implements

GPU_PLAN_INSTALL = 'pip install "jmem[gpu-plan]"'


@dataclasses.dataclass(frozen=True)
class _GpuFacts:
    """The published facts of one NVIDIA GPU model that XLA:GPU's compiler reads (bytes,
    bytes/s, GHz). ``sm`` is the compute capability ``(major, minor)``."""

    description: str
    sm: tuple[int, int]
    cores: int  # streaming multiprocessors
    fpus_per_core: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    threads_per_core: int
    l2_cache: int
    memory_bandwidth: int
    clock_ghz: float
    memory: int


_GiB = 1 << 30
_GPUS = {
    "h100_sxm": _GpuFacts(
        "NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 233472, 232448, 2048, 50 << 20,
        3352320000000, 1.98, 84942979072,
    ),
    "h200": _GpuFacts(
        "NVIDIA H200 141GB HBM3e", (9, 0), 132, 128, 233472, 232448, 2048, 50 << 20,
        4800000000000, 1.98, 151397597184,
    ),
    "a100_sxm_80": _GpuFacts(
        "NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 167936, 166912, 2048, 40 << 20,
        2039040000000, 1.41, 85100068864,
    ),
    "a100_sxm_40": _GpuFacts(
        "NVIDIA A100-SXM4-40GB", (8, 0), 108, 64, 167936, 166912, 2048, 40 << 20,
        1555200000000, 1.41, 42331013120,
    ),
    "b200": _GpuFacts(
        "NVIDIA B200", (10, 0), 148, 128, 233472, 232448, 2048, 132644864,
        7672320000000, 1.965, 191514411008,
    ),
    # The 24 GB consumer card (unsloth's and bitsandbytes' reference size): AD102, sm_89,
    # 128 SMs, 100 KiB shared memory per SM, 72 MiB L2, 384-bit GDDR6X at 21 Gb/s, 2.52 GHz
    # boost; its memory as nvidia-smi reports it (24,564 MiB).
    "rtx4090": _GpuFacts(
        "NVIDIA GeForce RTX 4090", (8, 9), 128, 128, 102400, 101376, 1536, 72 << 20,
        1008000000000, 2.52, 24564 << 20,
    ),
}  # fmt: skip


def _config_text(f: _GpuFacts) -> str:
    """``f`` as a ``stream_executor.GpuTargetConfigProto`` in text form, with the fields that
    jaxlib 0.10's proto knows (no ``collective_memory_granularity``)."""
    major, minor = f.sm
    info = {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": 49152,
        "shared_memory_per_core": f.shared_memory_per_core,
        "threads_per_core_limit": f.threads_per_core,
        "core_count": f.cores,
        "fpus_per_core": f.fpus_per_core,
        "block_dim_limit_x": 2147483647,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": f.memory_bandwidth,
        "l2_cache_size": f.l2_cache,
        "clock_rate_ghz": f.clock_ghz,
        "device_memory_size": f.memory,
        "shared_memory_per_block_optin": f.shared_memory_per_block_optin,
        "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
        "thread_dim_limit_x": 1024,
        "thread_dim_limit_y": 1024,
        "thread_dim_limit_z": 64,
    }
    lines = ["gpu_device_info {"]
    lines += [f"  {k}: {v}" for k, v in info.items()]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}"]
    lines += ['platform_name: "CUDA"', "dnn_version_info { major: 9 minor: 10 patch: 0 }"]
    lines += [f'device_description_str: "{f.description}"']
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Target:
    """A machine to compile and measure for.

    Attributes:
      name: the target's name (``jmem.targets.NAMES``), e.g. ``"h100_sxm"``.
      platform: ``"cpu"`` or ``"gpu"`` (``jax.default_backend()``'s names): what backend
        choices (attention ``"auto"``, remat, memory kinds) resolve for.
      memory_bytes: one device's memory in bytes; None where it is the host's (``cpu``).
      host_memory_bytes: the host's memory in bytes where known (``cpu``: this machine's
        physical memory), else None.
      description: the device name as the driver reports it.
      target_config: the ``GpuTargetConfigProto`` text XLA:GPU compiles for (GPU targets),
        else None.
      bf16_flops: the device's dense bf16 tensor-core peak in FLOP/s (GPU targets), else
        None.
    """

    name: str
    platform: str
    memory_bytes: int | None = None
    host_memory_bytes: int | None = None
    description: str = ""
    target_config: str | None = None
    bf16_flops: float | None = None


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


#: Dense bf16 tensor-core peaks (FLOP/s, FP32 accumulate, no sparsity), from NVIDIA's
#: datasheets: the step-time bound of a compiled step's dot FLOPs (``--dry-run``).
_BF16_FLOPS = {
    "h100_sxm": 989.4e12,
    "h200": 989.4e12,
    "a100_sxm_80": 312e12,
    "a100_sxm_40": 312e12,
    "b200": 2250e12,
    "rtx4090": 165.2e12,
}


def _gpu_target(name: str, f: _GpuFacts) -> Target:
    return Target(name, "gpu", f.memory, None, f.description, _config_text(f), _BF16_FLOPS[name])


TARGETS = {name: _gpu_target(name, f) for name, f in _GPUS.items()}
TARGETS["cpu"] = Target("cpu", "cpu", None, _host_memory(), "the host CPU (XLA:CPU)")
check_implements("TARGETS", COMPILE_TARGET_NAMES, TARGETS)
NAMES = COMPILE_TARGET_NAMES


def get(target: str | Target) -> Target:
    """The ``Target`` named ``target`` (a ``Target`` is returned as is).

    Args:
      target: a name in ``NAMES`` (``"h100_sxm"``, ``"h200"``, ``"a100_sxm_80"``,
        ``"a100_sxm_40"``, ``"b200"``, ``"rtx4090"``, ``"cpu"``) or a ``Target``.

    Raises:
      ValueError: for an unknown name (the message lists the names).
    """
    if isinstance(target, Target):
        return target
    if target not in TARGETS:
        raise ValueError(f"target {target!r} is unknown; choose from {', '.join(NAMES)}.")
    return TARGETS[target]


def current() -> Target:
    """The target of the running backend: ``cpu`` on XLA:CPU; on a GPU, a ``Target`` named
    after the device kind with its memory (``bytes_limit``) where the device reports it."""
    backend = jax.default_backend()
    if backend == "cpu":
        return TARGETS["cpu"]
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    kind = dev.device_kind
    for t in TARGETS.values():
        if t.description and t.description == kind:
            return dataclasses.replace(t, memory_bytes=stats.get("bytes_limit", t.memory_bytes))
    name = kind.lower().replace(" ", "_")
    return Target(name, backend, stats.get("bytes_limit"), _host_memory(), kind)


def _missing_plugin() -> str:
    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        found = False
    if not found:
        return f"compiling for a GPU target needs the CUDA plugin: {GPU_PLAN_INSTALL}"
    return (
        "the CUDA plugin is installed but did not load (no GPU here?): set JAX_PLATFORMS=cpu "
        "before importing jax to compile for a GPU target without one"
    )


@functools.lru_cache(maxsize=None)
def _topology_devices(config: str, n: int) -> tuple:
    from jax.experimental import topologies  # noqa: PLC0415 (optional: jax's AOT API)

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", topology=f"1x1x{n}", target_config=config
        )
    except NotImplementedError:  # "topology not implemented for cuda": no CUDA plugin loaded
        raise RuntimeError(_missing_plugin()) from None
    return tuple(topo.devices)


def unavailable_reason(target: str | Target = "h100_sxm") -> str | None:
    """Why ``devices(target)`` cannot run here (a one-line message naming what to install),
    or None when it can. For tests and tools that skip GPU compiles."""
    t = get(target)
    if t.platform == "cpu":
        return None
    try:
        _topology_devices(t.target_config, 1)
    except RuntimeError as e:
        return str(e)
    return None


def devices(target: str | Target, n: int = 1) -> list:
    """``n`` devices of ``target`` to compile for: compile-only devices for a GPU target (no
    GPU needed; run with ``JAX_PLATFORMS=cpu``), this host's devices for ``cpu``.

    Args:
      target: a name in ``NAMES`` or a ``Target``.
      n: how many devices (one host); a positive int.

    Returns:
      A list of ``n`` ``jax.Device``s. Compile-only devices lower and compile programs
      (``jax.jit(f).lower(...).compile()``); they cannot run them or hold arrays.

    Raises:
      ValueError: for an unknown target, ``n < 1``, or more ``cpu`` devices than this host
        has (``XLA_FLAGS=--xla_force_host_platform_device_count``).
      RuntimeError: when the CUDA plugin is missing (the message names
        ``pip install "jmem[gpu-plan]"``).

    Source: ``jax.experimental.topologies.get_topology_desc`` (XLA's deviceless AOT compile).
    """
    t = get(target)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int (got {n!r}).")
    if t.platform == "cpu":
        host = jax.devices("cpu")
        if n > len(host):
            raise ValueError(
                f"n={n} exceeds this host's {len(host)} CPU devices; set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={n} before importing jax."
            )
        return list(host[:n])
    return list(_topology_devices(t.target_config, n))


def mesh(target: str | Target, shape: tuple[int, ...], axes: tuple[str, ...]):
    """A mesh of ``prod(shape)`` ``target`` devices named ``axes``, on which shardings keep
    their memory kinds.

    For ``cpu``, a ``jax.sharding.Mesh`` of host devices. For a GPU target, a
    ``jax.sharding.AbstractMesh``: ``NamedSharding(mesh, spec, memory_kind="pinned_host")``
    on a ``Mesh`` of compile-only devices silently drops the memory kind (the devices list no
    memories), while one on an ``AbstractMesh`` keeps it. Lower under
    ``jax.sharding.use_mesh(jmem.targets.concrete_mesh(...))`` or through
    ``jmem.measure(..., target=)``, which binds it.

    Raises:
      ValueError: for an unknown target, or ``shape`` and ``axes`` of different lengths.
      RuntimeError: for a GPU target without the CUDA plugin.
    """
    shape, axes = tuple(shape), tuple(axes)
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and axes {axes} must have the same length.")
    m = concrete_mesh(target, shape, axes)
    if get(target).platform == "cpu":
        return m
    return m.abstract_mesh


def concrete_mesh(target: str | Target, shape: tuple[int, ...], axes: tuple[str, ...]):
    """A ``jax.sharding.Mesh`` of ``target``'s devices (``devices``) with ``shape`` and
    ``axes``; for a GPU target, memory kinds of shardings on it are dropped (use ``mesh``).

    Raises:
      ValueError: for an unknown target or a bad ``shape``.
    """
    shape, axes = tuple(shape), tuple(axes)
    n = int(np.prod(shape)) if shape else 1
    devs = np.array(devices(target, n), dtype=object).reshape(shape)
    return jax.sharding.Mesh(devs, axes)


def _platform_of(device_platform: str) -> str:
    return "gpu" if device_platform in ("gpu", "cuda", "rocm") else device_platform


def compile_platform() -> str:
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``) that the program being traced is
    compiled for: the platform of ``jax.default_device`` when one is set, else that of the
    current mesh (``jax.set_mesh``; ``AbstractMesh``es of ``jmem.targets.mesh`` carry it),
    else ``jax.default_backend()``. ``jmem.measure(..., target=)`` sets one of the first two,
    so backend choices made while tracing (attention ``"auto"``) follow the target; both are
    part of JAX's trace cache key, so a program traced for the CPU is not reused."""
    dev = jax.config.jax_default_device
    if isinstance(dev, jax.Device):
        return _platform_of(dev.platform)
    if isinstance(dev, str) and dev:
        return _platform_of(dev)
    m = jax.sharding.get_abstract_mesh()
    abstract_device = None if m.empty else getattr(m, "abstract_device", None)
    if abstract_device is not None and getattr(abstract_device, "platform", None):
        return _platform_of(abstract_device.platform)
    return jax.default_backend()
