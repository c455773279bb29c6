"""``--objective grpo --dry-run``: the two phases of a GRPO step planned and compiled. Before
the compile, the planner picks what the flags leave open so that both phases fit the
memory (``--memory``, else 24 GiB): the generation micro-batch (``--generation-batch``), layer
input offload (``--remat offload_inputs`` for the default ``full``) and gradient
accumulation (``--grad-accum``); after it, one line per phase: the compiled device peak (the training
step, and the rollout's micro-batch program with the training state beside it) next to the
planner's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jmem import planner
from jmem._src import lora_modules
from jmem._src.finetune.build import job_resolved_levers
from jmem._src.finetune.dry_run import DEFAULT_MEMORY
from jmem._src.finetune.dry_run import _planner_kwargs
from jmem._src.finetune.dry_run import format_bytes
from jmem._src.finetune.rollout_compile import rollout_report
from jmem._src.planner import grpo_phases
from jmem._src.planner import kv_cache
from jmem._src.units import GiB

#: ``--remat`` the resolver may change (its default), and what it changes it to.
DEFAULT_REMAT, LONG_REMAT = "full", "offload_inputs"


def budget(config) -> int:
    """The memory both phases are planned for: ``--memory``, else ``DEFAULT_MEMORY`` (24
    GiB, the cards GRPO runs are planned for; a target's own memory is not the default)."""
    return int(config.run.memory) if config.run.memory is not None else DEFAULT_MEMORY


def _dtype(config):
    return jnp.float16 if config.execution.precision == "fp16" else jnp.bfloat16


def _modules(config):
    """The planner's names of ``--lora-targets`` (None for full fine-tuning)."""
    if not config.training.lora_rank:
        return None
    return lora_modules.planner_names(config.training.lora_targets)


def _sizes(config) -> dict:
    g = config.grpo
    return dict(max_prompt_len=g.max_prompt_len, max_completion_len=g.max_completion_len)


def _kwargs(config, cfg, target, devices: int) -> dict:
    """The planner's keywords for the job's step (``dry_run._planner_kwargs``), no sizes."""
    dtype = _dtype(config)
    levers = job_resolved_levers(config, cfg, dtype, target)
    kw = _planner_kwargs(config, levers, dtype, _modules(config), devices)
    for k in ("batch_size", "seq_len"):
        kw.pop(k)
    return kw


def training_phase(config, cfg, target, devices: int = 1):
    """The planner's training phase of the job: one micro-batch (``--batch-size /
    --grad-accum`` completions per device) of prompt + completion tokens."""
    rows = max(1, config.data.batch_size // config.execution.grad_accum // devices)
    return grpo_phases.training_phase(
        cfg,
        batch_size=rows,
        beta=config.training.beta or 0.0,
        target=target,
        **_sizes(config),
        **_kwargs(config, cfg, target, devices),
    )


def _generation_kwargs(config, cfg, target, devices: int) -> dict:
    kw = _kwargs(config, cfg, target, devices)
    keep = ("lora", "quantization", "param_dtype", "optimizer", "offload")
    return {**{k: kw[k] for k in keep}, **_sizes(config), "target": target}


def generation_phase(config, cfg, target, devices: int = 1):
    """The planner's generation phase of the job at ``--generation-batch``."""
    gb = config.grpo.generation_batch or config.data.batch_size
    kw = _generation_kwargs(config, cfg, target, devices)
    return kv_cache.generation_phase(cfg, generation_batch=gb, **kw)


def _candidates(config) -> list[tuple[str, dict]]:
    """The training levers the resolver may pull, in order, as ``(flag, change)``: layer-input
    offload (``--remat`` at its default), then gradient accumulation over the divisors of
    ``--batch-size`` (``--grad-accum`` at its default 1), cumulative. Not ``--offload
    params``: the GRPO step's log-prob pass does not stream the base."""
    ex, tried = config.execution, []
    if ex.remat == DEFAULT_REMAT:
        tried.append((f"--remat {LONG_REMAT}", {"remat": LONG_REMAT}))
    b = config.data.batch_size
    if ex.grad_accum == 1:
        tried += [(f"--grad-accum {k}", {"grad_accum": k}) for k in range(2, b + 1) if b % k == 0]
    return tried


def _training_choice(config, cfg, target, devices, memory) -> tuple[dict, list[str]]:
    """The changes (only from their defaults: ``_candidates``) that make the planned
    training phase fit ``memory``, and the lines saying why."""
    phase = training_phase(config, cfg, target, devices)
    if planner.fits(phase.total, memory):
        return {}, []
    changes, lines = {}, []
    for flag, change in _candidates(config):
        before = phase.total
        changes.update(change)
        phase = training_phase(config.replace(**changes), cfg, target, devices)
        lines.append(
            f"resolver: {flag}: the planned training phase {format_bytes(before)} does not "
            f"fit {format_bytes(memory)} with the {planner.DEFAULT_RESERVE / 1e9:g} GB reserve "
            f"(-> {format_bytes(phase.total)})"
        )
        if planner.fits(phase.total, memory):
            return changes, lines
    lines.append(
        f"resolver: no lever fits the planned training phase ({format_bytes(phase.total)}) in "
        f"{format_bytes(memory)}; shorten --max-completion-len"
    )
    return changes, lines


def run_generation_batch(config, cfg, memory: int, devices: int = 1):
    """``(config, line)`` for a training run with ``--generation-batch`` unset: the largest
    generation micro-batch whose planned phase fits ``memory`` bytes (``--memory``, or the
    accelerator's own), and the line saying why; ``config`` unchanged (and ``line`` None)
    when ``--generation-batch`` is given. Rollout rows draw from their own keys, so the
    completions do not depend on it."""
    if config.grpo.generation_batch is not None:
        return config, None
    kw = _generation_kwargs(config, cfg, None, devices)
    reserve = min(grpo_phases.DEFAULT_RESERVE, memory // 8)  # a small --memory keeps 1/8
    gb, _, why = grpo_phases.largest_generation_batch(
        memory, cfg, rows=config.data.batch_size, reserve=reserve, **kw
    )
    line = f"resolver: {why}" + ("; generating 1 row at a time" if not gb else "")
    return config.replace(generation_batch=max(gb, 1)), line


def resolve(config, cfg, target=None, devices: int = 1):
    """``(config, lines)``: ``config`` with the generation batch, remat and accumulation that the
    planner finds fit ``budget(config)`` in both phases (only options left at their
    defaults change; ``--memory`` set to that budget), and one line per choice saying
    why."""
    memory = budget(config)
    changes, lines = _training_choice(config, cfg, target, devices, memory)
    config = config.replace(**changes, memory=memory)  # the verdicts judge this memory
    if config.grpo.generation_batch is None:
        kw = _generation_kwargs(config, cfg, target, devices)
        gb, _, why = grpo_phases.largest_generation_batch(
            memory, cfg, rows=config.data.batch_size, **kw
        )
        config = config.replace(generation_batch=max(gb, 1))
        lines.append(f"resolver: {why}" + ("; compiling 1 row" if not gb else ""))
    return config, lines


def _resident_state_bytes(state, lora: bool) -> int:
    """Device bytes of the training state beside the rollout: the optimizer state (and
    masters) not in ``pinned_host`` memory, and with LoRA the adapters as the state keeps
    them (the rollout reads a copy in the compute dtype; the base is its own argument)."""
    total = 0
    leaves = jax.tree.leaves(state.opt_state) + (jax.tree.leaves(state.params) if lora else [])
    for x in leaves:
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
        if kind != "pinned_host":
            total += x.size * jnp.dtype(x.dtype).itemsize
    return int(total)


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _in_compute_dtype(tree, dtype):
    """``tree``'s float leaves as ``jax.ShapeDtypeStruct``s of ``dtype``."""

    def cast(x):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(x.shape, dtype if floating else x.dtype)

    return jax.tree.map(cast, tree)


def phase_lines(config, cfg, state, report, target=None, devices: int = 1):
    """``(lines, record)``: the two phases' lines, ``generation ... device peak X (planner
    Y)`` and ``training ... device peak X (planner Y)``, from the compiled training step's
    ``report`` and a compile of the rollout's micro-batch program, and the verdict against
    ``budget(config)``."""
    g, memory = config.grpo, budget(config)
    frozen, adapters = state.frozen, state.params
    if frozen is None:  # full fine-tuning: the params are the model
        frozen, adapters = adapters, None
    else:  # the job samples with the adapters in the compute dtype (GrpoRun._policy)
        adapters = _in_compute_dtype(adapters, _dtype(config))
    sampling = (g.temperature, g.top_p, g.top_k)
    gen = rollout_report(
        frozen,
        adapters,
        cfg,
        generation_batch=g.generation_batch,
        sampling=sampling,
        target=target,
        **_sizes(config),
    )
    gen_peak = gen.peak_bytes + _resident_state_bytes(state, adapters is not None)
    planned_gen = generation_phase(config, cfg, target, devices)
    planned_train = training_phase(config, cfg, target, devices)
    rows = config.data.batch_size // config.execution.grad_accum
    tokens = f"{g.max_prompt_len:,} + {g.max_completion_len:,} tokens"
    phases = {
        "generation": (
            f"{_rows(g.generation_batch)} x {tokens} (micro-batch of {config.data.batch_size} "
            "completions; prefill and the decoding loop over the whole KV cache)",
            gen_peak,
            planned_gen.total,
        ),
        "training": (
            f"{_rows(rows)} x {tokens}, remat {config.execution.remat}, offload "
            f"{config.execution.offload}",
            report.peak_bytes,
            planned_train.total,
        ),
    }
    lines, record = [], {}
    for name, (what, peak, planned) in phases.items():
        lines.append(
            f"{name}: {what}: device peak {format_bytes(peak)} (planner {format_bytes(planned)})"
        )
        record[name] = {"what": what, "peak_bytes": int(peak), "planner_bytes": int(planned)}
    ok = all(planner.fits(r["peak_bytes"], memory) for r in record.values())
    if devices > 1:
        lines.append(
            f"note: on the {devices}-device mesh the compiled figures are per device (XLA's "
            "partitioning of the rollout); the generation planner counts one device holding "
            "the whole base and cache (an upper bound)"
        )
    lines.append(
        f"verdict: both phases {'fit' if ok else 'do not both fit'} in {memory / GiB:g} GiB "
        f"with the {planner.DEFAULT_RESERVE / 1e9:g} GB reserve (--memory, default 24 GiB)"
    )
    record["generation"]["rollout"] = dataclasses.asdict(gen)
    return lines, {"phases": record, "memory": memory, "fits": ok}
