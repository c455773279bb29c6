"""``jmem estimate --target``: the answers from the compiler instead of the planner.

The job's step (QLoRA, or full fine-tuning with ``--lora-rank 0``; ``jmem finetune
--dry-run --target NAME``: abstract shapes, nothing allocated, XLA:GPU's deviceless compile
for a GPU target) is compiled at the requested length, or at the lengths a bisection needs
for ``--max-seq``; its device peak and host bytes are XLA's own buffer assignment
(``jmem.measure(..., target=)``), not a model of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile

from jmem._src.cli import CliError
from jmem._src.planner.offload import Offload

#: ``--max-seq --target`` searches multiples of this many tokens.
SEARCH_MULTIPLE = 8192


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """One compile of the job's step: ``seq_len`` tokens, device peak and host bytes;
    ``advice``: the dry run's advice for a ``memory`` it misses (``dry_run.json``'s
    ``advice``: the lever, each compiled for the target), None when not asked or it fits."""

    seq_len: int
    peak_bytes: int
    host_bytes: int
    advice: dict | None = None


def job_flags(model, *, lora_rank: int, quant, lora_targets, offload, **flags) -> dict:
    """``jmem finetune`` flags for ``estimate``'s options (``model``: a preset's name, or
    None for a parameter count), or a one-line ``CliError`` for what the job does not run
    (LoRA on a float base, a parameter count). ``lora_rank`` 0 with no ``quant`` is the
    job's full fine-tuning (``--lora-rank 0``: bf16 params, fp32 masters)."""
    from jmem._src.finetune.config import MODEL_NAMES  # noqa: PLC0415

    if model not in MODEL_NAMES:
        raise CliError(
            "--target compiles the job's step: --model must be a preset name (jmem finetune "
            "--config), not a parameter count or shape"
        )
    full = not lora_rank and quant is None
    if not full and (not lora_rank or quant is None):
        raise CliError(
            "--target compiles the job's step: QLoRA (NF4 base, LoRA adapters: --lora-rank "
            ">= 1 and no --quant none) or full fine-tuning (--lora-rank 0)"
        )
    extra = {} if full or lora_targets is None else {"lora_targets": lora_targets}
    off = Offload.parse(offload)  # the job has no masters or disk here: optimizer
    job = Offload("optimizer" if off.optimizer else "none", off.params)
    return dict(config=model, lora_rank=lora_rank, offload=str(job), **extra, **flags)


def compile_step(
    flags: dict, target: str, seq_len: int, memory: int | None = None, host_memory=None
) -> CompiledStep:
    """Compiles the job's step for ``target`` at ``seq_len`` (``jmem finetune --dry-run
    --target``), its printout silenced; ``flags``: ``job_flags``'s. ``memory`` (bytes):
    when the step misses it, the dry run's advice too, each lever compiled for the target
    (at most 3 more compiles; ``host_memory``: ``--host-memory``, bytes, None: the job's
    default); None: the step alone."""
    from jmem import finetune  # noqa: PLC0415 (JAX: only once a command runs)

    judged = {"no_check_advice": True} if memory is None else {"memory": memory}
    if memory is not None and host_memory is not None:
        judged["host_memory"] = host_memory
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        config = finetune.FinetuneConfig.from_flat(
            **flags, **judged, seq_len=seq_len, dry_run=True, target=target, out=out
        )
        record = finetune.run(config)
    compiled = record["compiled"]
    host = int(compiled.get("host_peak_bytes") or 0)
    return CompiledStep(seq_len, int(compiled["peak_bytes"]), host, record.get("advice"))


def advice_line(advice: dict) -> str:
    """``compile_step``'s ``advice`` in one line: the lever and its compile's device and
    host bytes and transfers (GiB; GB = 1e9 B), or the planner's figure labelled
    planner-only where it was not compiled."""
    from jmem._src.measure import format_bytes  # noqa: PLC0415

    lever, row = advice.get("lever"), advice.get("checked")
    if lever is None:
        return "advice: no lever of the planner's advice brings it under"
    if row is None or not row[-1]:
        return f"advice: {lever[0]}, planner: {format_bytes(lever[1])} (planner-only)"
    return (
        f"advice: {lever[0]}; compiled: {row[1] / 2**30:.2f} GiB device + "
        f"{row[2] / 2**30:.2f} GiB host, moves {row[3] / 1e9:.3g} GB per step "
        f"({row[4]:.3g} s at {row[5]:g} GB/s); planner: {format_bytes(lever[1])}"
    )


def longest(flags: dict, target: str, memory: int, reserve: int, limit: int) -> CompiledStep:
    """The longest multiple of ``SEARCH_MULTIPLE`` tokens up to ``limit`` whose compiled
    device peak plus ``reserve`` fits ``memory`` (bisection: about log2(limit / 8192)
    compiles), or a ``CompiledStep`` of 0 tokens when none does."""
    lo, hi, best = 1, max(1, limit // SEARCH_MULTIPLE), CompiledStep(0, 0, 0)
    while lo <= hi:
        mid = (lo + hi) // 2
        step = compile_step(flags, target, mid * SEARCH_MULTIPLE)
        if step.peak_bytes + reserve <= memory:
            best, lo = step, mid + 1
        else:
            hi = mid - 1
    return best


#: ``--memory`` of ``compile_grpo``'s dry runs: everything fits, so the dry run's resolver
#: changes nothing and the flags compile as given (the caller judges the peaks).
_AS_GIVEN = 1 << 50


def compile_grpo(flags: dict, target: str, *, generation_batch: int) -> dict:
    """Compiles both GRPO phases for ``target`` at ``generation_batch`` rows (``jmem
    finetune --objective grpo --dry-run --target``: the training step and the rollout's
    micro-batch program) with the flags as given (no resolver), its printout silenced;
    ``flags``: ``job_flags``'s with the GRPO
    sizes (``num_generations``, ``max_prompt_len``, ``max_completion_len``, ``beta``).
    Returns ``dry_run.json``'s ``phases`` record (``{"generation": {"peak_bytes", ...},
    "training": {...}}``)."""
    from jmem import finetune  # noqa: PLC0415 (JAX: only once a command runs)

    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        config = finetune.FinetuneConfig.from_flat(
            **flags,
            objective="grpo",
            generation_batch=generation_batch,
            memory=_AS_GIVEN,
            dry_run=True,
            target=target,
            out=out,
        )
        record = finetune.run(config)
    return record["phases"]
