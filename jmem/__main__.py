"""Command line: ``python -m jmem <command> ...`` (``jmem`` when installed).

Commands:
  estimate   memory ledgers of a training configuration and, with ``--memory``, the
             verdict and levers (``jmem.planner``).

Example::

  python -m jmem estimate --model llama2_7b --memory 24GB --optimizer adamw,adamw_8bit \\
      --lora-rank 8 --quant nf4 --remat full --seq-len 2048 --batch-size 1

``--optimizer`` and ``--remat`` take comma-separated lists; one table is printed per
combination. To add a command, write ``_add_<name>(subparsers)`` that registers its parser
with ``set_defaults(func=...)`` and list it in ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Sequence


def _resolve_model(name: str):
    """A config for ``name``: jmem.models.llama's configs first, then the planner's table,
    then a parameter count (``7e9``, ``7B``)."""
    try:
        from jmem.models import llama  # noqa: PLC0415 (lazy: only for config names)

        if name in llama.CONFIGS:
            return llama.get_config(name)
    except ImportError:
        pass
    return name  # the planner resolves table names and counts, and raises for the rest


def _bytes_or_zero(text: str) -> int:
    from jmem import planner  # noqa: PLC0415

    return 0 if text.strip() in ("0", "0B", "0GB") else planner.parse_memory(text)


def _estimate(args: argparse.Namespace) -> int:
    from jmem import planner  # noqa: PLC0415

    model = _resolve_model(args.model)
    lora = None
    if args.lora_rank:
        targets = tuple(t for t in args.lora_targets.split(",") if t)
        lora = (args.lora_rank, targets if targets != ("all",) else "all")
    shape_kw = {
        k: v
        for k, v in (("hidden_size", args.hidden_size), ("num_layers", args.num_layers))
        if v is not None
    }
    optimizers = [o for o in args.optimizer.split(",") if o]
    remats = [r for r in args.remat.split(",") if r]
    for opt, remat in itertools.product(optimizers, remats):
        kw = dict(
            param_dtype=args.param_dtype,
            optimizer=opt,
            remat=remat,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            num_shards=args.shards,
            zero_stage=args.zero_stage,
            offload=args.offload or False,
            lora=lora,
            quantization=args.quant,
            accounting=args.accounting,
            master_weights=args.master_weights,
            **shape_kw,
        )
        if args.activation_budget is not None:
            kw["activations"] = _bytes_or_zero(args.activation_budget)
        print(f"== optimizer={opt} remat={remat} ==")
        if args.memory:
            advice = planner.advise(args.memory, model, reserve=_bytes_or_zero(args.reserve), **kw)
            print(advice)
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
    p.add_argument("--param-dtype", default="bf16")
    p.add_argument("--optimizer", default="adamw", help="comma list, e.g. adamw,adamw_8bit")
    p.add_argument(
        "--master-weights",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="fp32 masters (default: on for 16-bit params)",
    )
    p.add_argument("--offload", choices=["optimizer", "optimizer+masters"])
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--lora-targets", default="q_proj,v_proj", help="comma list or 'all'")
    p.add_argument("--quant", choices=["nf4"], default=None)
    p.add_argument("--remat", default="none", help="comma list of none,dots,selective,full,offload")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=None)
    p.add_argument("--accounting", choices=["stored", "nominal"], default="stored")
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
