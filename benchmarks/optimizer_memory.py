"""Compiled memory of a full fine-tuning step per optimizer (compile only, nothing allocated).

Builds ``jmem.train_step`` for a model config (default ``llama2_7b``, bf16 params, full
fine-tuning, ``remat="full"``), compiles it from abstract shapes for each optimizer and
reads the compiled program's memory (``jmem.measure``): arguments (params + optimizer
state + batch), temporaries (gradients, activations and the update's transients) and the
peak. ``optax.sgd`` has no state and no update transients, so its temporaries are the
floor set by the gradients and activations; an optimizer's temporaries above it are what
its update costs.

Prints a markdown table and writes ``benchmarks/results/optimizer_memory.json``.

Run: ``python benchmarks/optimizer_memory.py [--config llama2_7b] [--seq-len 2048]
[--param-dtype bfloat16|float32] [--no-skip] [--out PATH]``. About 10 s a row on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import optax

import jmem
from jmem.models import llama


def _commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(jmem.__file__)),
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--config", default="llama2_7b")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--no-skip",
        action="store_true",
        help="train_step(skip_nonfinite=False): no skipping of non-finite steps",
    )
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "optimizer_memory.json")
    )
    args = ap.parse_args()

    cfg = llama.get_config(args.config)
    dtype = jnp.dtype(args.param_dtype)
    params = llama.abstract_params(cfg, dtype)
    short = {"bfloat16": "bf16", "float32": "f32"}[args.param_dtype]
    n = sum(x.size for x in jax.tree.leaves(params))
    batch = {
        k: jax.ShapeDtypeStruct((args.batch_size, args.seq_len), jnp.int32)
        for k in ("inputs", "targets")
    }
    optimizers = [
        ("optax.sgd (no state)", optax.sgd(1e-5)),
        ("optax.adamw", optax.adamw(1e-5)),
        ("jmem adamw_8bit", jmem.adamw_8bit(1e-5)),
        ("jmem adamw_4bit", jmem.adamw_4bit(1e-5)),
    ]
    rows = []
    for name, opt in optimizers:
        step = jmem.train_step(
            lambda p, b: llama.loss_fn(p, b, cfg),
            opt,
            precision=f"p={short},c={short},o=f32",
            remat="full",
            skip_nonfinite=not args.no_skip,
        )
        t0 = time.perf_counter()
        report = step.measure(step.abstract_state(params), batch)
        rows.append(
            {
                "optimizer": name,
                "argument_bytes": report.argument_bytes,
                "temp_bytes": report.temp_bytes,
                "peak_bytes": report.peak_bytes,
                "compile_s": time.perf_counter() - t0,
            }
        )
    floor = rows[0]["temp_bytes"]
    for r in rows:
        r["temp_above_sgd_bytes"] = r["temp_bytes"] - floor

    gib = 2.0**30
    print(
        f"\n{args.config}: {n / 1e9:.2f}B params, {args.param_dtype}, full fine-tune, batch "
        f"{args.batch_size} x {args.seq_len}, remat full, skip_nonfinite={not args.no_skip}; "
        f"compiled on {jax.devices()[0].platform} (GiB)\n"
    )
    print("| optimizer | arguments | temporaries | above optax.sgd | peak |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['optimizer']} | {r['argument_bytes'] / gib:.2f} | {r['temp_bytes'] / gib:.2f} | "
            f"{r['temp_above_sgd_bytes'] / gib:.2f} | {r['peak_bytes'] / gib:.2f} |"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "config": args.config,
                "num_params": n,
                "param_dtype": args.param_dtype,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "remat": "full",
                "skip_nonfinite": not args.no_skip,
                "backend": jax.devices()[0].platform,
                "jax": jax.__version__,
                "optax": optax.__version__,
                "machine": platform.machine(),
                "jmem_commit": _commit(),
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
