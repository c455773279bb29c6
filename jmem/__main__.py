"""Command line: ``python -m jmem estimate ...`` (the memory planner) and ``python -m jmem
finetune ...`` (the fine-tuning job, ``jmem.finetune``); ``jmem`` when installed.

``--optimizer`` and ``--remat`` take comma-separated lists; one table is printed per
combination. A bad input exits with status 2 and one line ``error: ...`` naming the flag
(``--debug`` shows the traceback instead). See ``docs/planner.md`` for examples and for
adding a command.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import sys
from typing import Any
from typing import Sequence

from jmem._src import cli
from jmem._src import native_logs
from jmem._src.planner.offload import PARAMS
from jmem._src.planner.offload import Offload
from jmem._src.units import GB


def _model(name: str) -> Any:
    """argparse type: a config from ``jmem.models.llama.CONFIGS``, else a parameter count
    (``7e9``, ``7B``) that the planner resolves. An unknown name gets one list of names and
    the closest one."""
    from jmem import planner  # noqa: PLC0415 (JAX: only once a command runs)
    from jmem.models import llama  # noqa: PLC0415

    if name in llama.CONFIGS:  # its shape, under its own name (llama3_1_8b, not llama3_8b)
        shape, _ = planner.resolve_shape(llama.get_config(name))
        return dataclasses.replace(shape, name=name)
    try:
        planner.resolve_shape(name)
    except ValueError:
        names = sorted(llama.CONFIGS)
        raise argparse.ArgumentTypeError(
            f"unknown model {name!r}{cli.did_you_mean(name, names)}; pass a config name "
            f"({', '.join(names)}) or a parameter count (7e9, 7B)"
        ) from None
    except TypeError as e:
        raise argparse.ArgumentTypeError(str(e).rstrip(".")) from None
    return name


#: ``--param-dtype``'s names: the dtypes weights train in (and their other spellings).
_PARAM_DTYPES = {
    "bf16": ("bf16", "bfloat16"),
    "fp16": ("fp16", "f16", "float16"),
    "fp32": ("fp32", "f32", "float32"),
}


def _param_dtype(text: str) -> str:
    """argparse type: ``--param-dtype``, a dtype weights train in (bf16, fp16, fp32)."""
    name = text.strip().lower()
    if any(name in names for names in _PARAM_DTYPES.values()):
        return name
    raise argparse.ArgumentTypeError(
        f"{text!r} is not one of {', '.join(_PARAM_DTYPES)} (the dtypes weights train in; "
        "a 4-bit frozen base: --quant nf4 with --lora-rank R)"
    )


#: ``estimate --offload``'s state rungs, as ``jmem finetune --offload`` names them -> the
#: planner's (the job's offloaded optimizer holds the fp32 masters with its state).
_OFFLOAD_STATES = {"none": "none", "optimizer": "optimizer+masters"}
_OFFLOAD_STATES["optimizer+masters"] = "optimizer+masters"  # the spelling of earlier releases


def _offload(text: str) -> Offload:
    """argparse type: ``--offload`` as ``jmem finetune`` reads it: ``none``, ``optimizer``
    (the optimizer state and the fp32 masters, the planner's ``optimizer+masters``; that
    spelling is read the same), ``params``, or a state rung and ``params`` joined by a comma.
    The planner's state-only rung (masters on the device) is no rung of the job: Python's
    ``planner.estimate(offload="optimizer")``."""
    parts = [p.strip() for p in text.split(",")]
    states = [p for p in parts if p != PARAMS]
    if (
        any(p not in _OFFLOAD_STATES for p in states)
        or len(states) > 1
        or parts.count(PARAMS) > 1
        or len(parts) > 1
        and "none" in parts
    ):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not one of none, optimizer, params, optimizer,params (as jmem "
            "finetune --offload; optimizer: the optimizer state and the fp32 masters)"
        )
    return Offload(_OFFLOAD_STATES[states[0]] if states else "none", PARAMS in parts)


def _lora_targets(text: str) -> str:
    """argparse type: ``--lora-targets`` as ``jmem finetune`` takes it (``lora_modules``:
    module names, ``all`` or a regex), canonical, checked against the planner's model."""
    from jmem._src import lora_modules  # noqa: PLC0415

    selection = lora_modules.parse(text)
    try:
        lora_modules.planner_names(selection)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{cli.one_line(e)}; {lora_modules.FORMS}") from None
    return selection


def _lora(args: argparse.Namespace) -> tuple[int, Any] | None:
    """``(rank, module names)`` from ``--lora-rank``/``--lora-targets``; None without a
    rank."""
    from jmem._src import lora_modules  # noqa: PLC0415

    if not args.lora_rank:
        return None
    return args.lora_rank, lora_modules.planner_names(args.lora_targets)


def _quant(args: argparse.Namespace) -> str | None:
    """``--quant``: unset, NF4 with adapters (QLoRA, as the job) and none for full
    fine-tuning (``--lora-rank 0``)."""
    if args.quant is None:
        return "nf4" if args.lora_rank else None
    return None if args.quant == "none" else args.quant


def _levers(remat: str) -> Any:
    """The job's execution settings (``jmem finetune``'s defaults: attention, loss and token
    chunks) with ``remat``, by the job's own conversion (``setup.job_levers``), resolved by
    the planner per sequence length as the job does."""
    from jmem._src.finetune import setup  # noqa: PLC0415 (JAX: only once a command runs)
    from jmem._src.finetune.config import FinetuneConfig  # noqa: PLC0415

    return setup.job_levers(FinetuneConfig.from_flat(remat=remat))


def _estimate_kwargs(args: argparse.Namespace, optimizer: str, remat: str) -> dict[str, Any]:
    """Keywords of ``planner.estimate`` for one optimizer/remat combination."""
    kw = dict(
        param_dtype=args.param_dtype,
        optimizer=optimizer,
        levers=_levers(remat),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        num_shards=args.shards,
        zero_stage=args.zero_stage,
        offload=Offload.parse(args.offload),
        lora=_lora(args),
        quantization=_quant(args),
        accounting=args.accounting,
        master_weights=args.master_weights,
    )
    for k in ("hidden_size", "num_layers"):
        if getattr(args, k) is not None:
            kw[k] = getattr(args, k)
    if args.activation_budget is not None:
        kw["activations"] = args.activation_budget
    return kw


def static_line(ledger) -> str:
    """The static subtotal of a ``planner.Ledger``: everything but activations, in GB and
    GiB."""
    return (
        f"static (params + grads + optimizer state + master weights): "
        f"{ledger.static / GB:.3f} GB = {ledger.static / 2**30:.3f} GiB"
    )


def _estimate(args: argparse.Namespace) -> int:
    """Prints one ledger (or, with ``--memory``, one verdict) per optimizer and remat mode."""
    from jmem import planner  # noqa: PLC0415 (JAX: only once a command runs)

    _check_estimate_args(args)
    if args.objective == "grpo":
        return _estimate_grpo(args)
    _check_sft_args(args)
    if args.max_seq:
        return _max_seq(args)
    if args.target:
        return _estimate_compiled(args)
    tables = []  # every combination estimated before any is printed: an error is one line
    for opt, remat in itertools.product(args.optimizer, args.remat):
        kw = _estimate_kwargs(args, opt, remat)
        if args.memory:
            advice = planner.advise(args.memory, args.model, reserve=args.reserve, **kw)
            text = str(dataclasses.replace(advice, host_memory=args.host_memory))
        else:
            ledger = planner.estimate(args.model, **kw)
            text = f"{ledger}\n{static_line(ledger)}"
        tables.append(f"== optimizer={opt} remat={remat} ==\n{text}\n")
    print("\n".join(tables))
    return 0


def _check_estimate_args(args: argparse.Namespace) -> None:
    """The flags' combinations, before anything is printed: NF4 without adapters, a reserve
    that leaves no memory, the params rung of full fine-tuning without the optimizer rung
    (as ``jmem finetune`` refuses it)."""
    if _quant(args) and not args.lora_rank:
        raise ValueError(
            "--quant nf4 freezes the base weights: pass --lora-rank R for the trainable "
            "adapters (QLoRA)."
        )
    if args.memory and args.reserve >= args.memory:
        raise ValueError(
            f"--reserve {args.reserve / GB:.4g} GB leaves nothing of --memory "
            f"{args.memory / GB:.4g} GB ({args.memory / 2**30:.4g} GiB): pass a --reserve below "
            "--memory (default 2GB)"
        )
    if args.offload.params and not args.lora_rank and not args.offload.optimizer:
        raise ValueError(
            "--offload params under --lora-rank 0 (full fine-tuning) needs the optimizer state "
            "and masters in host memory too, as jmem finetune: pass --offload optimizer,params"
        )


#: ``estimate``'s GRPO flags and their defaults (refused with ``--objective sft``).
GRPO_FLAGS = {
    "num_generations": 8,
    "max_prompt_len": 512,
    "max_completion_len": 256,
    "generation_batch": None,
    "beta": 0.0,
}


def _check_sft_args(args: argparse.Namespace) -> None:
    """GRPO's flags given (not at their defaults) without ``--objective grpo``."""
    given = [k for k, v in GRPO_FLAGS.items() if getattr(args, k) != v]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{flags} apply to --objective grpo; pass it, or drop them")


def _check_grpo_args(args: argparse.Namespace) -> None:
    """``--objective grpo``'s sizes: whole groups, a generation batch that divides them."""
    if args.max_seq:
        raise ValueError("--max-seq applies to --objective sft; drop it for grpo")
    g, b = args.num_generations, args.batch_size
    if b % g:
        raise ValueError(
            f"--batch-size {b} counts completions and must be a multiple of --num-generations "
            f"{g} (whole groups); pass e.g. --batch-size {g * max(1, b // g)}"
        )
    if args.generation_batch is not None and b % args.generation_batch:
        raise ValueError(f"--generation-batch {args.generation_batch} must divide --batch-size {b}")


def _generation(args: argparse.Namespace, kw: dict):
    """``(phase, why)``: the generation phase at ``--generation-batch``, else at the largest
    divisor of ``--batch-size`` that fits ``--memory``, else at the whole batch."""
    from jmem import planner  # noqa: PLC0415 (JAX: only once a command runs)
    from jmem._src.planner import grpo_phases  # noqa: PLC0415
    from jmem._src.planner import kv_cache  # noqa: PLC0415

    gen = dict(
        lora=kw["lora"],
        quantization=kw["quantization"],
        param_dtype=args.param_dtype,
        optimizer=kw["optimizer"],
        offload=kw["offload"],
        max_prompt_len=args.max_prompt_len,
        max_completion_len=args.max_completion_len,
        target=args.target,
    )
    b = args.batch_size
    if args.generation_batch is None and args.memory:
        _, phase, why = grpo_phases.largest_generation_batch(
            args.memory, args.model, rows=b, reserve=args.reserve, **gen
        )
        return phase, why
    gb = args.generation_batch or b
    phase = kv_cache.generation_phase(args.model, generation_batch=gb, **gen)
    if args.generation_batch is not None:
        why = f"generation batch {gb}: --generation-batch"
    else:
        why = f"generation batch {gb}: the whole batch (no --generation-batch, no --memory)"
    if args.memory and not planner.fits(phase.total, args.memory, args.reserve):
        why += "; pass --memory without --generation-batch for the largest that fits"
    return phase, why


def _verdict(phase, args: argparse.Namespace) -> str:
    """``; fits 24 GiB`` (with ``--memory``), by ``planner.fits`` and ``--reserve``."""
    from jmem import planner  # noqa: PLC0415 (JAX: only once a command runs)

    if not args.memory:
        return ""
    ok = planner.fits(phase.total, args.memory, args.reserve)
    return (
        f"; {'fits' if ok else 'does not fit'} {args.memory / 2**30:g} GiB with the "
        f"{args.reserve / GB:g} GB reserve"
    )


def _estimate_grpo(args: argparse.Namespace) -> int:
    """``--objective grpo``: per optimizer and remat mode, the generation phase (one rollout
    micro-batch) and the training phase (``--batch-size`` completions of ``--max-prompt-len +
    --max-completion-len`` tokens), one line each beginning with the phase's name."""
    from jmem._src.planner import grpo_phases  # noqa: PLC0415 (JAX: only once a command runs)

    _check_grpo_args(args)
    where = f"the planner, {_compiler_name(args.target)}"
    for opt, remat in itertools.product(args.optimizer, args.remat):
        kw = _estimate_kwargs(args, opt, remat)
        kw.pop("seq_len"), kw.pop("batch_size")
        gen, why = _generation(args, kw)
        train = grpo_phases.training_phase(
            args.model,
            batch_size=args.batch_size,
            max_prompt_len=args.max_prompt_len,
            max_completion_len=args.max_completion_len,
            beta=args.beta,
            target=args.target,
            **kw,
        )
        print(f"== objective=grpo optimizer={opt} remat={remat} ({where}) ==")  # both planned
        print(gen.line() + _verdict(gen, args))
        print(f"  {why}")
        print(train.line() + _verdict(train, args))
        if args.target:
            _grpo_compiled(args, opt, remat, gen.config["rows"])
        print()
    return 0


def _grpo_compiled(args: argparse.Namespace, opt: str, remat: str, rows: int) -> None:
    """``--objective grpo --target``: both phases compiled for the target at ``rows``
    generation rows (``compiled_plan.compile_grpo``), one line each."""
    from jmem import planner  # noqa: PLC0415 (JAX: only once a command runs)
    from jmem._src.finetune import compiled_plan  # noqa: PLC0415
    from jmem._src.measure import format_bytes  # noqa: PLC0415

    flags = _compiled_flags(args, opt, remat)
    flags.update(
        num_generations=args.num_generations,
        max_prompt_len=args.max_prompt_len,
        max_completion_len=args.max_completion_len,
        **({"beta": args.beta} if args.beta else {}),
    )
    phases = compiled_plan.compile_grpo(flags, args.target, generation_batch=rows)
    for name, rec in phases.items():
        fits = ""
        if args.memory:
            ok = planner.fits(rec["peak_bytes"], args.memory, args.reserve)
            fits = f"; {'fits' if ok else 'does not fit'} {args.memory / 2**30:g} GiB"
        print(
            f"{name}: compiled for {args.target} ({_compiler(args.target)}; source: compiler): "
            f"device peak {format_bytes(rec['peak_bytes'])}{fits}"
        )


def _max_seq(args: argparse.Namespace) -> int:
    """Prints the longest sequence that fits ``--memory``, without and with offload."""
    from jmem import planner  # noqa: PLC0415 (JAX: only once a command runs)

    if not args.memory:
        raise ValueError("--max-seq needs --memory (e.g. --memory 24GB).")
    if args.target:
        return _max_seq_compiled(args)
    for opt, remat in itertools.product(args.optimizer, args.remat):
        kw = _estimate_kwargs(args, opt, remat)
        found = planner.largest_seq_len_by_remat(
            args.memory, args.model, reserve=args.reserve, **kw
        )
        (mode, plain), (_, offloaded) = found.items()
        print(f"== optimizer={opt} remat={mode} ==")
        print(f"longest sequence in {args.memory / GB:g} GB: {plain:,} tokens")
        print(
            f"with each layer's input offloaded to host (remat offload_inputs): "
            f"{offloaded:,} tokens"
        )
        if not plain:
            print(_why_nothing_fits(args, kw))
        print()
    return 0


def _compiled_flags(args: argparse.Namespace, opt: str, remat: str) -> dict:
    """The job's flags for ``--target``'s compiles (``compiled_plan.job_flags``)."""
    from jmem._src.finetune import compiled_plan  # noqa: PLC0415

    return compiled_plan.job_flags(
        getattr(args.model, "name", None),
        lora_rank=args.lora_rank,
        quant=_quant(args),
        lora_targets=args.lora_targets,
        offload=Offload.parse(args.offload),
        optimizer=opt,
        remat=remat,
        batch_size=args.batch_size,
    )


def _estimate_compiled(args: argparse.Namespace) -> int:
    """``--target``: the job's step compiled for the target at ``--seq-len``: device peak
    and host bytes from XLA's buffer assignment (and, with ``--memory``, the verdict)."""
    from jmem import planner  # noqa: PLC0415
    from jmem._src.finetune import compiled_plan  # noqa: PLC0415

    for opt, remat in itertools.product(args.optimizer, args.remat):
        step = compiled_plan.compile_step(
            _compiled_flags(args, opt, remat),
            args.target,
            args.seq_len,
            memory=args.memory,
            host_memory=args.host_memory,
        )
        print(f"== optimizer={opt} remat={remat} ==")
        print(
            f"compiled for {args.target} ({_compiler(args.target)}; source: compiler): "
            f"{args.seq_len:,} tokens, device peak {step.peak_bytes / 2**30:.2f} GiB, "
            f"host {step.host_bytes / 2**30:.2f} GiB"
        )
        if args.memory:
            fits = planner.fits(step.peak_bytes, args.memory, args.reserve)
            print(f"verdict: {'FITS' if fits else 'DOES NOT FIT'} in {args.memory / 2**30:g} GiB")
            if step.advice:  # the dry run's, with its 2 GB reserve
                print(compiled_plan.advice_line(step.advice))
        print()
    return 0


def _compiler_name(target: str | None) -> str:
    """``XLA:GPU's buffers for h100_sxm``: whose buffers the planner's GRPO phases model
    (None: the running backend's, with the flag that changes it)."""
    import jax  # noqa: PLC0415

    from jmem import targets  # noqa: PLC0415

    if target is None:
        gpu = jax.default_backend() == "gpu"
        return f"XLA:{'GPU' if gpu else 'CPU'}'s buffers (this machine; --target h100_sxm: a GPU's)"
    gpu = targets.get(target).platform == "gpu"
    return f"XLA:{'GPU' if gpu else 'CPU'}'s buffers for {target}"


def _compiler(target: str) -> str:
    """How ``target`` is compiled for, as the printouts label it."""
    from jmem import targets  # noqa: PLC0415

    if targets.get(target).platform == "gpu":
        return "XLA:GPU compile, no GPU; not autotuned"
    return "XLA:CPU compile"


def _max_seq_compiled(args: argparse.Namespace) -> int:
    """``--max-seq --target``: the longest sequence (multiples of 8,192 tokens) whose
    compiled device peak fits, with ``--remat`` and with the layer inputs offloaded."""
    from jmem._src.finetune import compiled_plan  # noqa: PLC0415

    for opt, remat in itertools.product(args.optimizer, args.remat):
        print(f"== optimizer={opt} remat={remat} (compiled for {args.target}) ==")
        for mode in dict.fromkeys(["full" if remat == "none" else remat, "offload_inputs"]):
            flags = _compiled_flags(args, opt, mode)
            got = compiled_plan.longest(
                flags, args.target, args.memory, args.reserve, args.search_limit
            )
            print(
                f"remat {mode}: longest sequence {got.seq_len:,} tokens (device peak "
                f"{got.peak_bytes / 2**30:.2f} GiB, host {got.host_bytes / 2**30:.2f} GiB)"
            )
        print()
    return 0


def _why_nothing_fits(args: argparse.Namespace, kw: dict) -> str:
    """Why not even 1,024 tokens fit: the states alone (or with the shortest sequence)
    exceed ``--memory`` less the reserve, and the first lever that would make them fit."""
    from jmem import planner  # noqa: PLC0415 (JAX: only once a command runs)

    advice = planner.advise(
        args.memory, args.model, reserve=args.reserve, **{**kw, "seq_len": 1024}
    )
    need = (advice.ledger.static + args.reserve) / GB
    lever = next((s for s in advice.suggestions if s.fits), None)
    help_ = (
        f"{lever.name} would fit ({lever.total / GB:.2f} GB)"
        if lever
        else "none of the levers alone fits; see jmem estimate --memory for a cumulative plan"
    )
    return (
        f"why 0: the {advice.short or 'step'} alone need {need:.2f} GB with the "
        f"{args.reserve / GB:g} GB reserve, more than {args.memory / GB:g} GB "
        f"even at 1,024 tokens; {help_}"
    )


def _add_memory_flags(p) -> None:
    """``estimate``'s ``--memory``, ``--reserve`` and ``--host-memory``."""
    p.add_argument(
        "--memory", type=cli.memory(False), help="device memory: 24GB, 24GiB, 80G or bytes"
    )
    p.add_argument(
        "--reserve", type=cli.memory(True), default="2GB", help="memory kept free (default 2GB)"
    )
    p.add_argument(
        "--host-memory",
        type=cli.memory(False),
        default="128GiB",
        help="host memory the levers' host bytes are judged against (default 128GiB, a "
        "typical workstation's)",
    )


def _add_estimate(sub, full: bool) -> None:
    """``estimate``: its flags only when it is the command (they need the planner, which
    imports JAX; ``jmem --help`` answers without)."""
    p = sub.add_parser(
        "estimate",
        help="memory ledgers of a training configuration",
        description="Estimate the device memory of a training step, ledger by "
        "ledger, and (with --memory) whether it fits.",
        add_help=full,
    )
    if not full:
        return
    from jmem import planner  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    p.add_argument(
        "--model",
        required=True,
        type=_model,
        help=f"config name ({', '.join(sorted(llama.CONFIGS))}) or parameter count (7e9, 7B)",
    )
    _add_memory_flags(p)
    p.add_argument(
        "--param-dtype",
        type=_param_dtype,
        default="bf16",
        help="dtype the weights the forward pass reads are stored in: bf16 (the default), "
        "fp16 or fp32 (a 4-bit base: --quant nf4)",
    )
    p.add_argument(
        "--optimizer",
        type=cli.choices_list(sorted(planner.OPTIMIZERS)),
        default="adamw_8bit",
        help="comma list, e.g. adamw,adamw_8bit (default adamw_8bit, as jmem finetune)",
    )
    p.add_argument(
        "--master-weights",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="fp32 masters (default: on for 16-bit params)",
    )
    p.add_argument(
        "--offload",
        type=_offload,
        default=Offload(),
        metavar="WHAT",
        help="what lives in host memory, as jmem finetune --offload: none (the default); "
        "optimizer (the optimizer state and the fp32 masters; optimizer+masters is the same); "
        "params (the weights, streamed to the device a layer at a time: the frozen base, or "
        "with --lora-rank 0 the trained params, which need optimizer too); or "
        "optimizer,params (both)",
    )
    p.add_argument(
        "--lora-rank",
        type=cli.nonnegative_int,
        default=8,
        help="LoRA rank r (default 8, as jmem finetune; 0: full fine-tuning)",
    )
    p.add_argument(
        "--lora-targets",
        type=_lora_targets,
        default="all",
        help="module names (q_proj,v_proj), all (the default) or a full-match regex, as finetune",
    )
    p.add_argument(
        "--max-seq",
        action="store_true",
        help="print the longest --seq-len that fits --memory, without and with offload",
    )
    p.add_argument("--debug", action="store_true", help="tracebacks and XLA's own log lines")
    _add_target_flags(p)
    p.add_argument(
        "--quant",
        choices=["nf4", "none"],
        default=None,
        help="quantization of the frozen base (default: nf4 with --lora-rank > 0, as jmem "
        "finetune; none for full fine-tuning)",
    )
    _add_shape_flags(p)
    p.set_defaults(func=_estimate)


def _add_grpo_flags(p) -> None:
    """``estimate --objective grpo``'s flags (as ``jmem finetune``'s)."""
    p.add_argument(
        "--objective",
        choices=["sft", "grpo"],
        default="sft",
        help="sft (default): one training step; grpo: its two phases, the rollout's "
        "generation micro-batch (KV cache) and the training step on the completions",
    )
    p.add_argument(
        "--num-generations",
        type=cli.positive_int,
        default=GRPO_FLAGS["num_generations"],
        help="grpo: completions per prompt G (default 8); --batch-size counts completions",
    )
    p.add_argument(
        "--max-prompt-len",
        type=cli.positive_int,
        default=GRPO_FLAGS["max_prompt_len"],
        help="grpo: prompt tokens (default 512, as jmem finetune)",
    )
    p.add_argument(
        "--max-completion-len",
        type=cli.positive_int,
        default=GRPO_FLAGS["max_completion_len"],
        help="grpo: completion tokens (default 256, as jmem finetune)",
    )
    p.add_argument(
        "--generation-batch",
        type=cli.positive_int,
        default=None,
        help="grpo: completions per rollout micro-batch; unset: the largest divisor of "
        "--batch-size that fits --memory (else the whole batch)",
    )
    p.add_argument(
        "--beta",
        type=cli.nonnegative_float,
        default=GRPO_FLAGS["beta"],
        help="grpo: the KL weight (> 0 adds the reference's log-probs; default 0)",
    )


def _add_target_flags(p) -> None:
    """``estimate``'s flags that answer from the compiler (``--target``)."""
    from jmem import targets  # noqa: PLC0415 (JAX: only once a command runs)

    p.add_argument(
        "--target",
        choices=targets.NAMES,
        help="answer from the compiler: compile the job's QLoRA step for this target (XLA:GPU "
        "deviceless compile, pip install 'jmem[gpu-plan]' and JAX_PLATFORMS=cpu); with "
        "--max-seq, a bisection over multiples of 8,192 tokens (minutes for an 8B model); with "
        "--objective grpo: the planner with that compiler's buffers, then both phases compiled "
        "(jmem finetune --objective grpo --dry-run --target)",
    )
    p.add_argument(
        "--search-limit",
        type=cli.positive_int,
        default=1 << 19,
        help="with --max-seq --target: the longest sequence tried (default 524,288)",
    )


def _add_shape_flags(p) -> None:
    """``estimate``'s flags for the activations and the layout: remat, sizes, shards, and
    ``--objective grpo``'s sizes (``_add_grpo_flags``)."""
    _add_grpo_flags(p)
    from jmem import planner  # noqa: PLC0415 (JAX: only once a command runs)

    p.add_argument(
        "--remat",
        type=cli.choices_list(planner.REMAT_MODES),
        default="full",
        help=f"comma list of {','.join(planner.REMAT_MODES)} (default full, as jmem finetune)",
    )
    p.add_argument(
        "--seq-len", type=cli.positive_int, default=2048, help="tokens per sequence (default 2048)"
    )
    p.add_argument(
        "--batch-size", type=cli.positive_int, default=1, help="sequences per step (default 1)"
    )
    p.add_argument(
        "--shards",
        type=cli.positive_int,
        default=1,
        help="devices the state is split over (default 1)",
    )
    p.add_argument(
        "--zero-stage", type=int, choices=[1, 2, 3], default=None, help="ZeRO stage with --shards"
    )
    p.add_argument(
        "--accounting",
        choices=["stored", "nominal"],
        default="stored",
        help="stored (default): bytes as stored, with padding and absmax; nominal: bits per "
        "parameter only",
    )
    p.add_argument(
        "--activation-budget",
        type=cli.memory(True),
        default=None,
        help="fix activations to this many bytes (e.g. 6GB) instead of computing them",
    )
    p.add_argument(
        "--hidden-size", type=cli.positive_int, default=None, help="shape for a parameter count"
    )
    p.add_argument(
        "--num-layers", type=cli.positive_int, default=None, help="shape for a parameter count"
    )


def _add_finetune(sub, full: bool) -> None:
    """``finetune``: listed here; its flags are parsed by ``jmem.finetune.main``."""
    sub.add_parser(
        "finetune",
        help="the QLoRA fine-tuning job (jmem.finetune); jmem finetune --help for its flags",
        add_help=False,
    )


_COMMANDS = (_add_estimate, _add_finetune)

#: Keyword names in the planner's messages -> the flags that set them.
_FLAGS = {
    "param_dtype": "--param-dtype",
    "hidden_size": "--hidden-size",
    "num_layers": "--num-layers",
}


def _one_line(e: BaseException) -> str:
    """The message of ``e`` on one line, with the planner's keywords spelled as flags."""
    text = cli.one_line(e)
    return re.sub(r"\b(" + "|".join(_FLAGS) + r")\b", lambda m: _FLAGS[m[1]], text)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command. A bad input exits with status 2 and one line ``error: ...``.

    ``argv`` None is the process's own command line: ``finetune`` then restarts the process
    once with glibc's huge-page tunable where its flags ask for it
    (``finetune.main(restart_with_huge_pages=True)``: the flags parsed once, for the
    restart and the job)."""
    command_line = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["finetune"]:
        from jmem._src.finetune.command import main as finetune_main  # noqa: PLC0415

        finetune_main(argv[1:], prog="jmem finetune", restart_with_huge_pages=command_line)
        return 0
    native_logs.show("--debug" in argv)
    with native_logs.hidden():  # XLA's start-up and compile log lines (--debug: shown)
        return _run(argv)


def _run(argv: list[str]) -> int:
    """``jmem estimate`` and the other planner commands: parse, run, one-line errors."""
    parser = cli.Parser(prog="jmem", description="jmem command line tools")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=cli.Parser)
    for add in _COMMANDS:
        add(sub, full=argv[:1] == ["estimate"])
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        if args.debug:
            raise
        parser.exit(2, f"error: {_one_line(e)}\n")


if __name__ == "__main__":
    sys.exit(main())
