"""Remat policies on a Llama-shaped model: compiled memory and train-step time.

For each policy in ``jmem.REMAT_POLICIES``: temp and peak bytes of the compiled
gradient step (``jmem.measure``, compile-only, at the memory shape) and the median
step time relative to ``"none"`` (timed shape; policies interleaved in one process so
load on the machine hits them alike). Prints a table and writes
``benchmarks/results/remat.json``.

    python benchmarks/remat.py                 # memory at 8x1024, seq 1024, batch 4; time at a CPU-sized shape
    python benchmarks/remat.py --time-shape memory   # time at the memory shape too (GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

import jmem
from jmem.models import llama


def make(layers, hidden, seq, batch):
    cfg = llama.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875),
        num_layers=layers,
        num_heads=hidden // 64,
        num_kv_heads=hidden // 64,
        max_seq_len=seq,
    )
    batch_shape = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in ("inputs", "targets")}
    return cfg, batch_shape


def grad_step(cfg, policy):
    loss = lambda p, b: llama.loss_fn(p, b, cfg)
    f = loss if policy == "none" else jmem.remat(loss, policy)
    return jax.jit(jax.value_and_grad(f))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument(
        "--time-shape",
        default="cpu",
        choices=["cpu", "memory"],
        help="'cpu': time at 8 layers, hidden 256, seq 256, batch 4; 'memory': the memory shape",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "remat.json")
    )
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    policies = list(jmem.REMAT_POLICIES)

    cfg, batch = make(args.layers, args.hidden, args.seq_len, args.batch_size)
    params = llama.abstract_params(cfg, dtype)
    mem = {}
    for pol in policies:
        r = jmem.measure(grad_step(cfg, pol), params, batch)
        mem[pol] = {
            "temp_bytes": r.temp_bytes,
            "peak_bytes": r.peak_bytes,
            "host_temp_bytes": r.host_temp_bytes,
        }

    tshape = (
        (args.layers, args.hidden, args.seq_len, args.batch_size)
        if args.time_shape == "memory"
        else (8, 256, 256, 4)
    )
    tcfg, tbatch = make(*tshape)
    tparams = llama.init(jax.random.key(0), tcfg, dtype)
    toks = jax.random.randint(jax.random.key(1), tbatch["inputs"].shape, 0, tcfg.vocab_size)
    real = {"inputs": toks, "targets": toks}
    fns = {pol: grad_step(tcfg, pol) for pol in policies}
    for f in fns.values():  # compile + warm up
        jax.block_until_ready(f(tparams, real))
    times = {pol: [] for pol in policies}
    for _ in range(args.reps):
        for pol, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(tparams, real))
            times[pol].append(time.perf_counter() - t0)
    med = {pol: statistics.median(ts) for pol, ts in times.items()}

    rows = []
    print(
        f"\nmemory: {args.layers} layers, hidden {args.hidden}, seq {args.seq_len}, batch {args.batch_size}, "
        f"{dtype.name}; time: layers/hidden/seq/batch = {tshape}, median of {args.reps}, backend "
        f"{jax.default_backend()}\n"
    )
    print("| policy | temp MiB | peak MiB | temp vs none | step time vs none |")
    print("|---|---:|---:|---:|---:|")
    for pol in policies:
        row = {
            "policy": pol,
            **mem[pol],
            "median_s": med[pol],
            "time_ratio": med[pol] / med["none"],
            "temp_ratio": mem[pol]["temp_bytes"] / mem["none"]["temp_bytes"],
        }
        rows.append(row)
        print(
            f"| {pol} | {mem[pol]['temp_bytes'] / 2**20:,.0f} | {mem[pol]['peak_bytes'] / 2**20:,.0f} | "
            f"{row['temp_ratio']:.2f} | {row['time_ratio']:.2f}x |"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "memory_shape": [args.layers, args.hidden, args.seq_len, args.batch_size],
                "time_shape": list(tshape),
                "dtype": dtype.name,
                "backend": jax.default_backend(),
                "reps": args.reps,
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
