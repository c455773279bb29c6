"""The devices a run uses: ``--mesh data=N,fsdp=M,expert=E,context=C`` over ``jax.devices()``
(every process's devices after ``jax.distributed.initialize``), default FSDP over all of
them (``context``: each sequence split over ``C`` devices; ``expert``: a mixture of
experts' experts split over ``E`` devices, docs/sharding.md); the frozen
base (NF4 included), adapters, optimizer state and batch are placed by ``jmem.sharding``'s
rules (``jmem.train_step(mesh=...)``); with ``--offload params`` the base keeps its FSDP
sharding in host memory, each device streaming its shard."""

from __future__ import annotations

import math
import os

import jax
from jax.experimental import multihost_utils

from jmem import sharding
from jmem._src.cli import CliError
from jmem._src.context_attention import check_strategy


def _sizes(spec: str, n_devices: int) -> tuple[int, int, int]:
    """``(data, fsdp, context)`` of a ``--mesh`` spec: fsdp unset is the devices left over
    by data, expert and context when data is given, else 1."""
    sizes = dict((k, int(v)) for k, v in (p.split("=") for p in spec.split(",")))
    data, context = sizes.get("data", 1), sizes.get("context", 1)
    rest = data * context * sizes.get("expert", 1)
    fsdp = sizes.get("fsdp", n_devices // rest if "data" in sizes else 1)
    return data, max(fsdp, 1), context


def _expert(spec: str | None) -> int:
    """The ``expert=E`` size of a ``--mesh`` spec (1 unset)."""
    if spec is None:
        return 1
    return int(dict(p.split("=") for p in spec.split(",")).get("expert", 1))


def mesh_sizes(config) -> tuple[int, int, int]:
    """``(data, fsdp, context)`` of the run's ``--mesh`` (``(1, 1, 1)`` unset; fsdp counted
    over the visible devices when only data is given)."""
    spec = config.devices.mesh
    if spec is None:
        return 1, 1, 1
    # A --target mesh counts the target's devices: fsdp unset is 1 there (target_mesh).
    return _sizes(spec, len(jax.devices()) if config.devices.target is None else 0)


def check_expert(config, cfg) -> None:
    """The run's ``--mesh expert=E`` against the model and the other axes (nothing for
    ``E = 1``).

    Raises:
      CliError: a model without routed experts, an ``E`` that does not divide its number
        of experts, or a ``context`` axis as well (not combined).
    """
    n, spec = _expert(config.devices.mesh), config.devices.mesh
    if n == 1:
        return
    experts = int(getattr(cfg, "num_experts", 0) or 0)
    if experts == 0:
        raise CliError(
            f"--mesh {spec}: the model ({config.model.config or config.model.checkpoint}) has "
            "no routed experts to split over an expert axis; drop expert= or pick a "
            "mixture-of-experts model"
        )
    if experts % n:
        raise CliError(
            f"--mesh {spec}: expert={n} does not divide the model's {experts} experts; pass "
            f"an expert= size that divides {experts}"
        )
    if mesh_sizes(config)[2] > 1:
        raise CliError(
            f"--mesh {spec}: an expert axis and a context axis do not combine (the routed "
            "experts split a batch's rows, not a sequence); drop expert= or context="
        )


def check_context(config, cfg) -> None:
    """The run's ``--mesh context=C`` against the other flags and the model (nothing for
    ``C = 1``).

    Raises:
      CliError: a ``--seq-len`` that is not a multiple of ``2 * C`` (the zigzag order), an
        ``--attention cudnn`` (its causal mask needs consecutive token indices), a
        preference ``--objective`` (its ``[B, 2, S]`` pairs are not split over the
        sequence), or ``--context-strategy ulysses`` with head counts ``C`` does not divide.
    """
    context = mesh_sizes(config)[2]
    if context == 1:
        return
    spec, seq = config.devices.mesh, config.data.seq_len
    if seq is not None and seq % (2 * context):
        raise CliError(
            f"--mesh {spec}: --seq-len {seq} is not a multiple of 2 * context = {2 * context} "
            f"(the zigzag split of each sequence); pass a --seq-len that is a multiple of "
            f"{2 * context}"
        )
    if config.execution.attention == "cudnn":
        raise CliError(
            f"--mesh {spec}: --attention cudnn cannot split a sequence over a context axis (its "
            "causal mask needs consecutive token indices); use --attention blockwise or auto"
        )
    if config.training.objective != "sft":
        raise CliError(
            f"--mesh {spec}: context parallelism splits [B, S] batches, not the [B, 2, S] "
            f"pairs of --objective {config.training.objective}; drop context= or use "
            "--objective sft"
        )
    if config.execution.context_strategy == "auto":
        return
    try:
        check_strategy(config.execution.context_strategy, cfg.num_heads, cfg.num_kv_heads, context)
    except ValueError as e:
        raise CliError(f"--context-strategy {config.execution.context_strategy}: {e}") from e


def job_mesh(config) -> tuple[jax.sharding.Mesh | None, list[str]]:
    """``(mesh or None, notes)`` for the run: ``--mesh`` as given (the first
    ``data * fsdp * context`` devices), else FSDP over every device, or over the most
    devices that divide ``--batch-size`` (with a note). One device and no ``--mesh``: no
    mesh (a plain jit).

    Raises:
      CliError: for a ``--mesh`` larger than the devices, or a batch it does not divide.
    """
    devices = jax.devices()
    n = len(devices)
    if config.execution.offload_dir is not None:
        return None, _one_device(config, n, "--offload-dir")
    if config.devices.mesh is None:
        if n == 1:
            return None, []
        d = max(k for k in range(1, n + 1) if config.data.batch_size % k == 0 and k <= n)
        notes = []
        if d < n:
            notes.append(
                f"note: --batch-size {config.data.batch_size} is split over {d} of the {n} devices "
                f"(FSDP); pass a --batch-size that is a multiple of {n} to use them all"
            )
        return sharding.make_mesh(1, d, devices=devices[:d]), notes
    data, fsdp, context = _sizes(config.devices.mesh, n)
    expert = _expert(config.devices.mesh)
    total = data * fsdp * context * expert
    if total > n:
        raise CliError(
            f"--mesh {config.devices.mesh}: needs {total} devices, {n} are "
            f"visible; pass sizes whose product is at most {n}"
        )
    _check_batch(config, data * fsdp, expert)
    used = devices[:total]
    return sharding.make_mesh(data, fsdp, devices=used, context=context, expert=expert), []


def _check_batch(config, rows: int, expert: int = 1) -> None:
    if config.data.batch_size % (rows * expert):
        what = "data * fsdp" + (" * expert" if expert > 1 else "")
        raise CliError(
            f"--mesh {config.devices.mesh}: --batch-size {config.data.batch_size} is not a "
            f"multiple of {what} = {rows * expert}; pass a --batch-size that is"
        )


#: The rungs that run on one device: (why, what to do instead on a mesh, the idle note).
_ONE_DEVICE = {
    "--offload-dir": (
        "ordered disk reads and writes",
        "or keep the optimizer state in host memory with --offload on a mesh",
        "--offload (host memory) shards over them",
    ),
}


def _one_device(config, n: int, flag: str) -> list[str]:
    """``flag``'s steps run on one device (``_ONE_DEVICE``): the notes for the idle
    devices. Raises CliError for a ``--mesh`` of more than one device or a multi-process
    run."""
    why, instead, idle = _ONE_DEVICE[flag]
    spec = config.devices.mesh
    many = spec is not None and math.prod(_sizes(spec, n)) * _expert(spec) > 1
    if many or jax.process_count() > 1:
        where = f"--mesh {spec}" if spec is not None else "the processes beyond the first"
        raise CliError(f"{flag} runs on one device ({why}); drop {where}, {instead}")
    if spec is None and n > 1:
        return [
            f"note: {flag} runs on one device ({why}): {n - 1} of the {n} devices are idle; {idle}"
        ]
    return []


def target_mesh(config):
    """``--target`` with ``--mesh data=N,fsdp=M,expert=E,context=C``: the mesh on ``N * M * E *
    C`` of the target's compile-only devices (``jmem.targets.mesh``), or None without
    ``--mesh``.

    Raises:
      CliError: for a ``--mesh`` without both sizes, or a batch it does not divide.
    """
    from jmem import targets  # noqa: PLC0415

    spec = config.devices.mesh
    if spec is None:
        return None
    sizes = dict(part.split("=") for part in spec.split(","))
    data, fsdp = int(sizes.get("data", 1)), int(sizes.get("fsdp", 1))
    context, expert = int(sizes.get("context", 1)), int(sizes.get("expert", 1))
    _check_batch(config, data * fsdp, expert)
    if expert > 1:
        shape, axes = (data, fsdp, expert, context), ("data", "fsdp", "expert", "context")
        return targets.mesh(config.devices.target, shape, axes)
    axes = ("data", "fsdp", "context")
    return targets.mesh(config.devices.target, (data, fsdp, context), axes)


def mesh_record(mesh) -> dict:
    """What ``summary.json`` records of the devices: kind, count, processes, mesh axes."""
    return {
        "device": jax.devices()[0].device_kind,
        "devices": 1 if mesh is None else int(mesh.size),
        "processes": jax.process_count(),
        "mesh": None if mesh is None else mesh_axes(mesh),
    }


def mesh_axes(mesh) -> dict:
    """``{axis: size}`` of the mesh, without a ``context`` axis of size 1 (no context
    parallelism: the record and the printout of a data x fsdp mesh stay as they were)."""
    return {k: int(v) for k, v in mesh.shape.items() if k != "context" or int(v) > 1}


def auto_distributed() -> bool:
    """Whether the environment launched several processes that ``jax.distributed`` can
    join without flags (SLURM with more than one task, or ``JAX_COORDINATOR_ADDRESS``)."""
    slurm = int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1
    return slurm or "JAX_COORDINATOR_ADDRESS" in os.environ


def initialize_distributed(config) -> None:
    """``jax.distributed.initialize`` for a multi-process run: with ``--coordinator``,
    ``--num-processes`` and ``--process-id``, or auto-detected (``auto_distributed``: SLURM,
    ``JAX_COORDINATOR_ADDRESS``). A single process, or one already initialized, does
    nothing. CPU processes use the gloo collectives.

    Raises:
      CliError: for some but not all of the three flags, a ``--process-id`` not below
        ``--num-processes``, or a ``--coordinator`` that is not ``HOST:PORT``.
    """
    given = [config.devices.coordinator, config.devices.num_processes, config.devices.process_id]
    if any(v is not None for v in given) and not all(v is not None for v in given):
        raise CliError(
            "--coordinator, --num-processes and --process-id go together; pass all three, "
            "or none (auto-detected under SLURM)"
        )
    if given[0] is not None:
        check_processes(*given)
    if jax.distributed.is_initialized() or not (given[0] is not None or auto_distributed()):
        return
    if hasattr(jax.config, "jax_cpu_collectives_implementation"):  # CPU processes: gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if given[0] is not None:
        jax.distributed.initialize(
            config.devices.coordinator, config.devices.num_processes, config.devices.process_id
        )
    else:
        jax.distributed.initialize()


def check_processes(coordinator: str, num_processes: int, process_id: int) -> None:
    """``--coordinator HOST:PORT`` (a port in 1..65535; ``[::1]:1234`` for IPv6) and a
    ``--process-id`` in ``0..--num-processes - 1``.

    Raises:
      CliError: naming the flag and what it takes.
    """
    if not 0 <= process_id < num_processes:
        raise CliError(
            f"--process-id {process_id}: must be below --num-processes {num_processes} "
            f"(0 to {num_processes - 1})"
        )
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(
            f"--coordinator {coordinator}: expected HOST:PORT (process 0's address and a "
            "free port in 1..65535, e.g. 10.0.0.1:1234)"
        )


def sync(name: str) -> None:
    """A barrier across processes (nothing on one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
