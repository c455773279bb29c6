"""``--dry-run``: the step compiled from abstract shapes (nothing allocated), its memory
next to the planner's estimate."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

from jmem import MemoryReport
from jmem import lora as jlora
from jmem import planner
from jmem import targets as jtargets
from jmem._src import lora_modules
from jmem._src.finetune import card_fit as cards
from jmem._src.finetune.advice_check import AdviceCheck
from jmem._src.finetune.build import abstract_batch
from jmem._src.finetune.build import base_bytes
from jmem._src.finetune.build import build
from jmem._src.finetune.build import dropout_key
from jmem._src.finetune.build import full_finetuning
from jmem._src.finetune.build import full_params
from jmem._src.finetune.build import model_name
from jmem._src.finetune.build import quantized_base
from jmem._src.finetune.build import rows_per_example
from jmem._src.finetune.config import offload_of
from jmem._src.finetune.mesh import mesh_axes
from jmem._src.finetune.mesh import mesh_record
from jmem._src.finetune.mesh import mesh_sizes
from jmem._src.finetune.rundir import flags
from jmem._src.finetune.setup import offload_record
from jmem._src.planner import context as cp_plan
from jmem._src.planner.offload import Offload
from jmem._src.units import format_count
from jmem.models import llama

format_bytes = MemoryReport.format_bytes


def dry_run(config, cfg, mesh=None, target=None):
    """``--dry-run``: compiles the train step from abstract shapes (nothing allocated), prints
    its memory (per device on a mesh) next to the planner's estimate and writes
    ``dry_run.json``. Returns that record.

    ``target``: a ``jmem.targets`` name or ``Target`` to compile for (``"h100_sxm"``: XLA:GPU,
    no GPU needed; attention ``"auto"`` resolves to cuDNN), None for the running backend. The
    mesh is rebuilt on the target's devices with the same axes, and the verdict is against
    the target's memory."""
    if target is not None and mesh is not None:
        mesh = jtargets.mesh(target, tuple(mesh.axis_sizes), tuple(mesh.axis_names))
    devices = 1 if mesh is None else int(mesh.size)
    grpo = config.training.objective == "grpo"
    if grpo:  # the planner picks what fits both phases, before the compile
        config = _grpo_resolved(config, cfg, target, devices)
    step, _, dtype, _ = build(config, cfg, mesh=mesh, target=target, disk=False)
    full = full_finetuning(config)
    trainable, frozen = _abstract_trainable(config, cfg, dtype)
    state = step.abstract_state(trainable, frozen=frozen, dropout_key=dropout_key(config))
    batch = abstract_batch(config)
    t0 = time.time()
    report = step.measure(state, batch, target=target, flops=True)
    if full:  # the params the forward pass reads: the compute dtype's bytes
        q_bytes, q_count = 0, llama.num_params(cfg)
        frozen_bytes = q_count * jnp.dtype(dtype).itemsize
        adapted = modules = None
    else:
        q_bytes, q_count, frozen_bytes = base_bytes(frozen)
        adapted = lora_modules.module_names(list(trainable))
        modules = lora_modules.linear_names(adapted)  # what the planner counts
    est = _estimate(config, step.levers, cfg, dtype, modules, devices)
    n_adapter = llama.num_params(cfg) if full else jlora.num_trainable(trainable)
    _print_heading(config, cfg, adapted, n_adapter, time.time() - t0)
    if not full:
        print(
            f"NF4 base: {format_bytes(q_bytes)} for {format_count(q_count)} weights = "
            f"{q_bytes / q_count:.3f} bytes/param; all frozen leaves {format_bytes(frozen_bytes)}"
        )
    print(f"levers (resolved for {step.levers.target}):\n{step.levers.describe()}\n")
    batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)) // devices
    state_bytes = report.argument_bytes - batch_bytes
    rows = [
        (
            "params + state (arguments)",
            state_bytes,
            est.params + est.optimizer_state + est.master_weights,
        ),
        ("temporaries / grads+activations", report.temp_bytes, est.grads + est.activations),
        ("peak", report.peak_bytes, est.total),
    ]
    _print_rows(rows, mesh, devices)
    compute = compute_record(report.dot_flops, cfg, batch, devices, target, full=full)
    print(compute_line(compute))
    print(
        collectives_line(report.collective_bytes, _planned_collectives(config, cfg, step, target))
    )
    memory, fit = _print_verdict(report, config.run.memory, target)
    smaller = advice = {}
    if not grpo and (config.run.memory is None or not fit):
        kwargs = _planner_kwargs(config, step.levers, dtype, modules, devices)
        peak = report.peak_bytes
        smaller, advice = _print_advice(config, cfg, peak, memory, est, kwargs, mesh, target)
    _print_transfers(config, est)
    ex = config.execution
    lever = not offload_of(ex).params and ex.remat != "none"
    if not fit and lever and not (full and ex.offload_dir):
        streamed = _estimate(config, step.levers, cfg, dtype, modules, devices, params=True)
        excess = max(0, int(report.peak_bytes) - int(est.total))
        _print_params_lever(frozen_bytes, est, streamed, full, (memory, excess))
    nf4 = None if full else q_bytes / q_count
    out = _record(config, cfg, report, compute, est, step, nf4, n_adapter, mesh)
    out.update(memory=memory, fits=fit, cards=smaller, offload=offload_record(config, cfg))
    out.update({"advice": advice} if advice else {})
    if grpo:
        out.update(_grpo_phases(config, cfg, state, report, target, devices))
    if target is not None:
        t = jtargets.get(target)
        out.update(target=t.name, device=t.description or t.name)
    os.makedirs(config.run.out, exist_ok=True)
    with open(os.path.join(config.run.out, "dry_run.json"), "w") as f:
        json.dump(out, f, indent=2)
    return out


def _grpo_resolved(config, cfg, target, devices: int):
    """``--objective grpo``: the config with the planner's choices (``grpo_plan.resolve``),
    each printed with its reason."""
    from jmem._src.finetune import grpo_plan  # noqa: PLC0415 (it imports this module)

    config, lines = grpo_plan.resolve(config, cfg, target, devices)
    for line in lines:
        print(line)
    return config


def _grpo_phases(config, cfg, state, report, target, devices: int) -> dict:
    """``--objective grpo``: the two phases' lines printed (``grpo_plan.phase_lines``: the
    rollout's micro-batch compiled too); their record for ``dry_run.json``."""
    from jmem._src.finetune import grpo_plan  # noqa: PLC0415 (it imports this module)

    lines, record = grpo_plan.phase_lines(config, cfg, state, report, target, devices)
    print()
    for line in lines:
        print(line)
    return record


def compute_record(flops: float | None, cfg, batch, devices: int, target, *, full: bool) -> dict:
    """The compiled step's dot FLOPs (per device) against the model's minimum: a forward
    and the input gradients, ``4 N T`` (``6 N T`` when the base trains, ``full``), with
    ``N`` the parameters in a token's matmuls (all but an untied input embedding; on a
    mixture of experts the k routed experts of E, not all of them) and ``T`` the device's
    tokens; with the target's bf16 peak, the step-time bound it implies. ``flops`` None (a
    loop of unknown trip count): ``dot_flops``, ``ratio`` and the bound are None."""
    n = llama.num_params(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size)
    if cfg.num_experts:  # the experts a token does not run: (E - k) of each layer's E
        idle = cfg.num_experts - cfg.num_experts_per_tok
        n -= cfg.num_layers * idle * 3 * cfg.hidden_size * llama.expert_size(cfg)
    tokens = batch["inputs"].size / devices
    minimum = (6 if full else 4) * n * tokens
    peak = None if target is None else jtargets.get(target).bf16_flops
    return {
        "dot_flops": flops,
        "minimum_flops": minimum,
        "minimum": "6NT" if full else "4NT",
        "ratio": None if flops is None else flops / minimum,
        "bf16_flops_per_s": peak,
        "seconds_bound": None if peak is None or flops is None else flops / peak,
    }


def compute_line(c: dict) -> str:
    """``compute_record`` as the dry run prints it."""
    if c["dot_flops"] is None:
        return (
            "compute: not counted: the compiled step has a loop of unknown trip count, so its "
            "matmul work cannot be read from the HLO"
        )
    line = (
        f"compute: {c['dot_flops'] / 1e12:.4g} TFLOP of matmuls per step per device (compiled; "
        f"loops by trip count) = {c['ratio']:.2f}x the minimum {c['minimum']} = "
        f"{c['minimum_flops'] / 1e12:.4g} TFLOP"
    )
    if c["seconds_bound"] is not None:
        line += (
            f"; at {c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s dense bf16: at least "
            f"{c['seconds_bound']:.3g} s per step"
        )
    return line


def _planned_collectives(config, cfg, step, target) -> dict:
    """The planner's attention collectives per step per device on a context mesh
    (``jmem._src.planner.context``; empty without one); XLA:CPU (``target`` None on a CPU)
    moves bf16 collectives as f32."""
    context = mesh_sizes(config)[2]
    passes = 1 if config.execution.remat == "none" else 2
    strategy = step.levers.context_strategy
    cpu = target is None and jax.default_backend() == "cpu"
    return cp_plan.collective_bytes(
        cfg, config.data.seq_len, context, strategy, passes=passes, itemsize=4 if cpu else 2
    )


def collectives_line(counted: dict | None, planned: dict | None = None) -> str:
    """The compiled step's collectives per step per device (``MemoryReport.collective_bytes``,
    ``{kind: bytes}``), as the dry run prints them: the kinds that run, largest first; with
    the planner's attention collectives (``planned``) where there are any."""
    if counted is None:
        return "collectives: not counted: a loop with collectives has an unknown trip count"
    moved = sorted(((v, k) for k, v in counted.items() if v), reverse=True)
    if not moved:
        return "collectives: none (compiled; one device's program)"
    parts = ", ".join(f"{k} {format_bytes(v)}" for v, k in moved)
    line = (
        f"collectives: {format_bytes(sum(v for v, _ in moved))} per step per device (compiled, "
        f"bytes each delivers, loops by trip count): {parts}"
    )
    if planned:
        plan = ", ".join(f"{k} {format_bytes(v)}" for k, v in planned.items())
        line += f"; planner (attention): {plan}"
    return line


def _record(config, cfg, report, compute, est, step, nf4_bytes, n_adapter, mesh) -> dict:
    """``dry_run.json``'s record (the verdict and the target are added by the caller)."""
    return {
        "config": config.model.config,
        "checkpoint": config.model.checkpoint,
        "model": dataclasses.asdict(cfg),
        **dict(seq_len=config.data.seq_len, batch_size=config.data.batch_size),
        "compiled": dataclasses.asdict(report),
        "compute": compute,
        "transfers": dict(est.transfers),
        "estimate": est.as_dict(),
        "reserve": planner.DEFAULT_RESERVE,
        "levers": step.levers.as_dict(),
        "nf4_bytes_per_param": nf4_bytes,
        "trainable_params": n_adapter,
        "args": flags(config),
        "per_device": True,
        **mesh_record(mesh),
    }


#: per ``Ledger.transfers`` key: what moves and over which link
RUNGS = {
    "optimizer": ("optimizer state", "host<->device"),
    "master_weights": ("master weights", "host<->device"),
    "disk": ("optimizer state + masters", "disk<->host"),
    "params": ("parameters", "host<->device"),
    "activations": ("layer inputs (--remat offload*)", "host<->device"),
}


def transfer_lines(
    est, pcie_gbps: float, disk_gbps: float, flag: str = "--offload", remat_flag: str = ""
) -> list[str]:
    """The dry run's transfer lines from the planner's ledger ``est``: per offload rung in
    use (each key of ``est.transfers``), the bytes one step moves and their time at the
    stated bandwidth (``pcie_gbps`` for host<->device, ``disk_gbps`` for disk, GB/s with
    GB = 1e9 bytes) and the flag that turned it on (``flag`` for the optimizer's rungs,
    ``--offload-dir`` for disk, ``remat_flag`` for the offloaded layer inputs of
    ``--remat offload``/``offload_inputs``), then ``est.trade()``'s one-line summary. Raises
    ValueError for a bandwidth <= 0 (``Ledger.transfer_seconds``)."""
    secs = est.transfer_seconds(pcie_gbps, disk_gbps)
    lines = ["transfers per step (planner; GB = 1e9 B):" if secs else "transfers per step: none"]
    for key, nbytes in est.transfers.items():
        what, link = RUNGS.get(key, (key.replace("_", " "), "host<->device"))
        gbps, knob = (disk_gbps, "--disk-gbps") if key == "disk" else (pcie_gbps, "--pcie-gbps")
        by = {"disk": "--offload-dir", "params": "--offload params"}.get(key, flag)
        by = remat_flag if key == "activations" and remat_flag else by
        lines.append(
            f"  {what + ' ' + link:40}{nbytes / 1e9:>10.3g} GB  {secs[key]:>9.3g} s at "
            f"{gbps:g} GB/s ({knob})  [{by}]"
        )
    return lines + [est.trade(pcie_gbps, disk_gbps) + " (planner; GB = 1e9 B)"]


def _print_transfers(config, est) -> None:
    ex = config.execution
    flag = "--offload-dir" if ex.offload_dir else "--offload"
    remat = f"--remat {ex.remat}"
    for line in transfer_lines(est, ex.pcie_gbps, ex.disk_gbps, flag, remat):
        print(line)


#: ``--memory`` unset and no ``--target``: a 24 GiB card (RTX 3090/4090).
DEFAULT_MEMORY = 24 * 2**30


def verdict(peak: int, memory: int | None, target=None) -> tuple[int, bool]:
    """``(memory, fits)``: the compiled ``peak`` judged as ``jmem estimate --memory`` judges
    its estimate (``planner.fits``: ``peak + planner.DEFAULT_RESERVE <= memory``);
    ``memory`` None is the target's device memory, else ``DEFAULT_MEMORY``."""
    if memory is None:
        t = None if target is None else jtargets.get(target)
        memory = DEFAULT_MEMORY if t is None or t.memory_bytes is None else t.memory_bytes
    return int(memory), planner.fits(peak, int(memory), planner.DEFAULT_RESERVE)


def _print_rows(rows, mesh, devices: int) -> None:
    """The compiled-against-planner table, per device of the mesh when there is one."""
    if mesh is not None:
        axes = ",".join(f"{k}={v}" for k, v in mesh_axes(mesh).items())
        print(f"per device of the mesh {axes} ({devices} devices; FSDP, ZeRO-3 ledger):")
    print(f"{'':34}{'compiled (jmem.measure)':>26}{'planner (estimate)':>26}")
    for name, a, b in rows:
        print(f"{name:34}{format_bytes(a):>26}{format_bytes(b):>26}")


def _print_verdict(report, memory: int | None, target) -> tuple[int, bool]:
    memory, fit = verdict(report.peak_bytes, memory, target)
    host = f", host {format_bytes(report.host_peak_bytes)}" if report.host_peak_bytes else ""
    where = "" if target is None else f" (XLA:GPU compile for {target}, no GPU; not autotuned)"
    print(
        f"\nverdict: device peak {format_bytes(report.peak_bytes)}{host} + "
        f"{planner.DEFAULT_RESERVE / 1e9:g} GB reserve {'fits' if fit else 'does not fit'} in "
        f"{format_bytes(memory)}{where} (--memory, default the target's memory or 24 GiB; "
        "the reserve and the rule are jmem estimate --memory's)."
    )
    return memory, fit


# --offload-dir compiles as host offload (build(disk=False)): the same device footprint.
def _print_params_lever(frozen_bytes: int, est, streamed, full: bool, judged) -> None:
    """The ``--offload params`` rung, when the step does not fit and it is not in use: the
    frozen base's (``full``: the trained params') bytes leave the device (a layer's slice
    is fetched per layer, the head for the loss) and the layer stack crosses PCIe three
    times a step (forward, remat recomputation, backward); ``est``/``streamed``: the
    planner without and with it. ``judged``: ``(memory, excess)``, bytes: whether it brings
    the step under ``memory`` by the advice's rule (``card_fit.lever_fits``: its planner
    total plus the compile's ``excess`` over the planner, with the reserve)."""
    flag, what = ("optimizer,params", "the params") if full else ("params", "the frozen base")
    memory, excess = judged
    over = f" plus the compile's {format_bytes(excess)} over the planner" if excess else ""
    brings = "brings" if cards.lever_fits(streamed.total, memory, excess) else "does not bring"
    print(
        f"lever: --offload {flag} keeps {what} ({format_bytes(frozen_bytes)}) in host "
        "memory and streams one layer at a time to the device: planner device total "
        f"{format_bytes(est.total)} -> {format_bytes(streamed.total)}, moving "
        f"{streamed.transfers['params'] / 1e9:.3g} GB host-to-device per step (the layer "
        f"stack 3x: forward, remat recomputation, backward); with the "
        f"{planner.DEFAULT_RESERVE / 1e9:g} GB reserve{over}, by the planner it {brings} the step under "
        f"{format_bytes(memory)}."
    )


def _print_advice(config, cfg, peak: int, memory: int, est, kwargs: dict, mesh, target):
    """``(cards record, --memory advice record)``: with ``--memory`` unset the cards below
    the target's ``memory`` (``_print_cards``), else the advice for the ``memory`` the
    compiled ``peak`` misses (``card_fit.memory_lines``); each lever compiled for the
    ``target`` (``AdviceCheck``; no target: planner-only) unless ``--no-check-advice``, a
    lever over ``--host-memory`` labelled so."""
    run = config.run
    compiled = target is not None and not run.no_check_advice
    check = AdviceCheck(config, cfg, mesh, target) if compiled else None
    if run.memory is None:
        return _print_cards(peak, memory, est.total, cfg, kwargs, run.host_memory, check), {}
    excess = max(0, int(peak) - int(est.total))
    reserve = planner.DEFAULT_RESERVE + excess
    advice = planner.advise(memory, cfg, reserve=reserve, **kwargs) if reserve < memory else None
    lines, record = cards.memory_lines(
        memory, planner.DEFAULT_RESERVE, advice, excess, run.host_memory, check
    )
    for line in lines + _check_time(check, record):
        print(line)
    return {}, record


def _check_time(check, record: dict) -> list[str]:
    """The line saying how many compiles the advice check made and their time (recorded
    as ``check_seconds``); none without compiles."""
    if check is None or not check.compiles:
        return []
    record["check_seconds"] = check.seconds
    return [
        f"  (advice checked by {check.compiles} compile(s) of the step in {check.seconds:.0f}s; "
        "--no-check-advice skips them)"
    ]


def _print_cards(
    peak: int, memory: int, planned: int, cfg, kwargs: dict, host=None, check=None
) -> dict:
    """``cards.card_lines`` printed: the verdict for the cards below ``memory`` and the
    planner's cheapest lever per card missed, its totals judged with the compiled
    ``peak``'s bytes over the planner's ``planned`` added to the reserve, a lever over
    ``host`` (``--host-memory``, bytes) labelled so, each compiled by ``check``
    (``AdviceCheck``; None: planner-only) with the compiles' time; its record."""
    excess = max(0, int(peak) - int(planned))

    def advise_at(card: int):
        reserve = planner.DEFAULT_RESERVE + excess
        if reserve >= card:  # the compile's excess alone fills the card: no lever helps
            return None
        return planner.advise(card, cfg, reserve=reserve, **kwargs)

    reserve = planner.DEFAULT_RESERVE
    lines, record = cards.card_lines(peak, memory, reserve, advise_at, excess, host, check)
    for line in lines + (_check_time(check, record) if lines else []):
        print(line)
    return record


def _abstract_trainable(config, cfg, dtype):
    """``(trainable, frozen)`` as ``jax.ShapeDtypeStruct``s: LoRA adapters on the NF4 base,
    or (``--lora-rank 0``) the float32 params (fp32 masters; 16-bit params in the state)."""
    if full_finetuning(config):
        return full_params(config, cfg, abstract=True), None
    frozen = quantized_base(config, cfg, dtype, abstract=True)
    return _abstract_adapters(config, frozen), frozen


def _print_heading(config, cfg, adapted, n_trainable: int, seconds: float) -> None:
    """The model, what trains (LoRA's rank and modules, or full fine-tuning), the compile."""
    if adapted is None:
        what = "full fine-tuning (bf16 params, fp32 masters; no NF4 base, no adapters)"
    else:
        what = f"LoRA r={config.training.lora_rank} on {adapted}"
    print(
        f"\n{model_name(config)}: {format_count(llama.num_params(cfg))} params, {what}: "
        f"{format_count(n_trainable)} trainable; compiled in {seconds:.0f}s (abstract shapes, "
        "nothing allocated)"
    )


def _abstract_adapters(config, frozen) -> dict:
    """The job's adapters (``--lora-*``) as shapes, for the abstract ``frozen`` base."""
    t = config.training
    return jax.eval_shape(
        lambda k: jlora.init(
            k,
            frozen,
            rank=t.lora_rank,
            alpha=t.lora_alpha,
            modules=lora_modules.modules(t.lora_targets),
            dropout=t.lora_dropout,
        ),
        jax.random.key(0),
    )


def _estimate(config, levers, cfg, dtype, modules, devices: int, params: bool = False):
    """The planner's ledger for one device (``_planner_kwargs``; ``params``: with the
    params rung added)."""
    kwargs = _planner_kwargs(config, levers, dtype, modules, devices)
    if params:  # full fine-tuning streams its params with the state in host memory
        off = kwargs["offload"]
        if full_finetuning(config) and off.state == "none":
            off = dataclasses.replace(off, state="optimizer+masters")
        kwargs["offload"] = dataclasses.replace(off, params=True)
    est = planner.estimate(cfg, **kwargs)
    context = mesh_sizes(config)[2]
    if context == 1:
        return est
    extra = cp_plan.attention_bytes(
        cfg,
        config.data.seq_len,
        context,
        levers.context_strategy,
        kwargs["batch_size"],
    )
    return dataclasses.replace(est, activations=est.activations + extra)


def _offload(config) -> Offload:
    """The planner's offload for the job's flags (``offload_of``); full fine-tuning's fp32
    masters live in the optimizer state and move with it."""
    off = offload_of(config.execution)
    if full_finetuning(config) and off.state == "optimizer":
        off = dataclasses.replace(off, state="optimizer+masters")
    return off


def _method_kwargs(config, modules) -> dict:
    """The planner's ``lora`` and ``quantization`` for the job's method: LoRA on the NF4
    base, or (``--lora-rank 0``) full fine-tuning (bf16 params, fp32 masters)."""
    if full_finetuning(config):
        return dict(lora=None, quantization=None, master_weights=True)
    return dict(lora={"rank": config.training.lora_rank, "targets": modules}, quantization="nf4")


def _planner_kwargs(config, levers, dtype, modules, devices: int) -> dict:
    """``planner.estimate``'s options for the job's step on one device: the batch split and
    the state sharded (ZeRO-3) over ``devices``; preference pairs count as two sequences
    each (the planner's activations are those of an SFT step over as many rows); the
    offload rungs of ``--offload``/``--offload-dir``."""
    context = mesh_sizes(config)[2]
    sharded = devices // context  # the params are replicated over the context axis
    shards = {"num_shards": sharded, "zero_stage": 3} if sharded > 1 else {}
    return dict(
        offload=_offload(config),
        param_dtype=jnp.dtype(dtype).name,
        optimizer=config.training.optimizer,
        **_method_kwargs(config, modules),
        levers=levers,
        batch_size=max(1, rows_per_example(config) * config.data.batch_size // sharded),
        seq_len=None if config.data.seq_len is None else config.data.seq_len // context,
        **shards,
    )
