"""GRPO memory: both phases of a GRPO step of the job, compiled from abstract shapes (nothing
allocated): the rollout's generation micro-batch (prefill and the decoding loop over a KV
cache of prompt + completion tokens, beside the training state) and the training step on
the completions, each next to the planner's figure.

Each row is ``jmem finetune --objective grpo --dry-run`` (``finetune.run``; the resolver
picks the generation batch, remat and offload that the planner finds fit ``--memory``,
default 24 GiB). Default: Llama-3.1-8B, LoRA r=32 on every projection (NF4 base), G = 8
completions of 1,024 prompt + 19,456 completion tokens (20,480 each, 163,840 per step),
compiled for h100_sxm (XLA:GPU's deviceless compile, no GPU: ``pip install
'jmem[gpu-plan]'``, ``JAX_PLATFORMS=cpu``; about a minute per row on 2 cores). Rows:
the resolver's choice, and the same at ``--generation-batch 4`` (which it refused).
Prints a table and writes ``benchmarks/results/grpo_8b_h100.json``.

    JAX_PLATFORMS=cpu python benchmarks/grpo_memory.py
    python benchmarks/grpo_memory.py --config tiny --target cpu --max-completion-len 48

unsloth's published figure (theirs, not measured here): 54.3 GB of VRAM for GRPO on Llama 3.1
8B at 20K context with 8 generations per prompt (unsloth.ai/blog/grpo, "Long-context GRPO",
2025-02-20: 42 GB training, 9.8 GB the GRPO loss, 2.5 GB the KV cache).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import subprocess
import tempfile
import time

import jax

import jmem
from jmem import finetune

GiB = 2**30


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs"


def run_row(flags: dict) -> dict:
    """One ``--objective grpo --dry-run`` of the job with ``flags``: its phases' record."""
    t0 = time.time()
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()) as log:
        config = finetune.FinetuneConfig.from_flat(**flags, objective="grpo", dry_run=True, out=out)
        record = finetune.run(config)
    lines = [
        ln for ln in log.getvalue().splitlines() if ln.startswith(("generation:", "training:"))
    ]
    phases = record["phases"]
    return {
        "flags": {k: v for k, v in flags.items()},
        "resolver": [ln for ln in log.getvalue().splitlines() if ln.startswith("resolver:")],
        "lines": lines,
        "generation_batch": record["args"].get("generation_batch"),
        "remat": record["args"]["remat"],
        "generation_peak_bytes": phases["generation"]["peak_bytes"],
        "generation_planner_bytes": phases["generation"]["planner_bytes"],
        "training_peak_bytes": phases["training"]["peak_bytes"],
        "training_planner_bytes": phases["training"]["planner_bytes"],
        "training_host_bytes": record["compiled"].get("host_peak_bytes"),
        "memory": record["memory"],
        "fits": record["fits"],
        "seconds": round(time.time() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama3_1_8b")
    parser.add_argument("--target", default="h100_sxm")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--max-completion-len", type=int, default=19456)
    parser.add_argument("--memory", default=None, help="--memory of the job (default 24 GiB)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    reason = jmem.targets.unavailable_reason(args.target)
    if reason:
        parser.error(f"--target {args.target}: {reason}")
    base = dict(
        config=args.config,
        lora_rank=args.lora_rank,
        num_generations=args.num_generations,
        batch_size=args.batch_size,
        max_prompt_len=args.max_prompt_len,
        max_completion_len=args.max_completion_len,
        target=args.target,
        **({"memory": args.memory} if args.memory else {}),
    )
    rows = [run_row(base)]
    if args.batch_size % 4 == 0 and rows[0]["generation_batch"] != 4:
        rows.append(run_row({**base, "generation_batch": 4}))
    print(f"{'generation batch':>16} {'remat':>15} {'phase':>11} {'compiled':>10} {'planner':>10}")
    for r in rows:
        for phase in ("generation", "training"):
            print(
                f"{r['generation_batch']:>16} {r['remat']:>15} {phase:>11} "
                f"{r[phase + '_peak_bytes'] / GiB:>6.2f} GiB {r[phase + '_planner_bytes'] / GiB:>6.2f} GiB"
            )
    compiler = (
        f"XLA:GPU compile for {args.target} without a GPU"
        if jmem.targets.get(args.target).platform == "gpu"
        else f"XLA:CPU compile ({args.target})"
    )
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": _commit(),
        "machine": _machine(),
        "compiler": compiler,
        "jax": jax.__version__,
        "rows": rows,
        "unsloth_published": {
            "what": "GRPO on Llama 3.1 8B, 20K context, 8 generations per prompt: total VRAM "
            "(unsloth.ai/blog/grpo, 2025-02-20; theirs, not measured here)",
            "gb": 54.3,
        },
    }
    os.makedirs(args.out, exist_ok=True)
    name = f"grpo_{args.config.replace('llama3_1_', '')}_{args.target.split('_')[0]}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {os.path.join(args.out, name)}")


if __name__ == "__main__":
    main()
