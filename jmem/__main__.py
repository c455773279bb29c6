"""Command line: ``python -m jmem estimate ...`` (``jmem`` when installed), the memory planner.

``--optimizer`` and ``--remat`` take comma-separated lists; one table is printed per
combination. See ``docs/planner.md`` for examples and for adding a command.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any
from typing import Sequence

from jmem import planner
from jmem.models import llama


def _resolve_model(name: str) -> Any:
    """A config for ``name`` from ``jmem.models.llama.CONFIGS``, else ``name`` itself: the
    planner resolves its table's names and counts (``7e9``, ``7B``) and raises for the rest."""
    return llama.get_config(name) if name in llama.CONFIGS else name


def _bytes_or_zero(text: str) -> int:
    return 0 if text.strip() in ("0", "0B", "0GB") else planner.parse_memory(text)


def _lora(args: argparse.Namespace) -> tuple[int, Any] | None:
    """``(rank, targets)`` from ``--lora-rank``/``--lora-targets``; None without a rank."""
    if not args.lora_rank:
        return None
    targets = tuple(t for t in args.lora_targets.split(",") if t)
    return args.lora_rank, targets if targets != ("all",) else "all"


def _estimate_kwargs(args: argparse.Namespace, optimizer: str, remat: str) -> dict[str, Any]:
    """Keywords of ``planner.estimate`` for one optimizer/remat combination."""
    kw = dict(
        param_dtype=args.param_dtype,
        optimizer=optimizer,
        remat=remat,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        num_shards=args.shards,
        zero_stage=args.zero_stage,
        offload=args.offload or False,
        lora=_lora(args),
        quantization=args.quant,
        accounting=args.accounting,
        master_weights=args.master_weights,
    )
    for k in ("hidden_size", "num_layers"):
        if getattr(args, k) is not None:
            kw[k] = getattr(args, k)
    if args.activation_budget is not None:
        kw["activations"] = _bytes_or_zero(args.activation_budget)
    return kw


def _estimate(args: argparse.Namespace) -> int:
    """Prints one ledger (or, with ``--memory``, one verdict) per optimizer and remat mode."""
    model = _resolve_model(args.model)
    optimizers = [o for o in args.optimizer.split(",") if o]
    remats = [r for r in args.remat.split(",") if r]
    for opt, remat in itertools.product(optimizers, remats):
        kw = _estimate_kwargs(args, opt, remat)
        print(f"== optimizer={opt} remat={remat} ==")
        if args.memory:
            print(planner.advise(args.memory, model, reserve=_bytes_or_zero(args.reserve), **kw))
        else:
            print(planner.estimate(model, **kw))
        print()
    return 0


def _add_estimate(sub) -> None:
    p = sub.add_parser(
        "estimate",
        help="memory ledgers of a training configuration",
        description="Estimate the device memory of a training step, ledger by "
        "ledger, and (with --memory) whether it fits.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="config name (tiny, llama_1b, llama2_7b, llama3_8b) or parameter count (7e9, 7B)",
    )
    p.add_argument("--memory", help="device memory: 24GB, 24GiB, 80G or bytes")
    p.add_argument("--reserve", default="2GB", help="memory kept free (default 2GB)")
    p.add_argument(
        "--param-dtype", default="bf16", help="dtype the params are stored in (default bf16)"
    )
    p.add_argument(
        "--optimizer", default="adamw", help="comma list, e.g. adamw,adamw_8bit (default adamw)"
    )
    p.add_argument(
        "--master-weights",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="fp32 masters (default: on for 16-bit params)",
    )
    p.add_argument(
        "--offload",
        choices=["optimizer", "optimizer+masters"],
        help="ledgers kept in host memory",
    )
    p.add_argument(
        "--lora-rank", type=int, default=0, help="LoRA rank r (default 0: full fine-tuning)"
    )
    p.add_argument(
        "--lora-targets",
        default="q_proj,v_proj",
        help="comma list or 'all' (default q_proj,v_proj)",
    )
    p.add_argument("--quant", choices=["nf4"], default=None, help="quantization of the frozen base")
    p.add_argument(
        "--remat",
        default="none",
        help="comma list of none,dots,selective,full,offload (default none)",
    )
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument(
        "--shards", type=int, default=1, help="devices the state is split over (default 1)"
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
        default=None,
        help="fix activations to this many bytes (e.g. 6GB) instead of computing them",
    )
    p.add_argument("--hidden-size", type=int, default=None, help="shape for a parameter count")
    p.add_argument("--num-layers", type=int, default=None, help="shape for a parameter count")
    p.set_defaults(func=_estimate)


_COMMANDS = (_add_estimate,)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jmem", description="jmem command line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"jmem {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
