"""Remat policies on a Llama-shaped model: compiled memory and train-step time.

For each policy in ``jmem.REMAT_POLICIES``: temp and peak bytes of the compiled
gradient step (``jmem.measure``, compile-only, at the memory shape) and the median
step time relative to ``"none"`` (timed shape; policies interleaved in one process so
load on the machine hits them alike). Prints a table and writes
``benchmarks/results/remat.json``.

    python benchmarks/remat.py                 # memory at 8x1024, seq 1024, batch 4; time at a CPU-sized shape
    python benchmarks/remat.py --time-shape memory   # time at the memory shape too (GPU)
    python benchmarks/remat.py --user-code-only      # only the user-code table below

A second table (``user_code_table``, ``benchmarks/results/remat_user_code.json``) takes
small transformers written as users write them (``tests/user_models.py``: Flax NNX with
``nnx.scan``, Flax linen with ``nn.scan``, plain JAX with ``lax.scan``; hidden 256, 4
layers, batch 4, seq 256 by default) and compares the temp bytes of a whole train step
(``value_and_grad`` + AdamW update) with no remat, ``jmem.remat`` around the loss inside
the step, and ``jmem.remat`` around the whole step. For the same layers run by a Python
loop it also compares no remat, ``jax.checkpoint`` on each layer, and ``jmem.remat`` on the
step (which warns). Memory only: compile-only, no timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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


def user_code_table(layers, hidden, seq, batch, policy, out):
    """Temp MiB of user-style train steps: none / remat(loss) / remat(step), per style."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import user_models

    shape = dict(layers=layers, hidden=hidden, seq=seq, batch_size=batch, vocab=1024)
    cases = [(style, where) for style in user_models.STYLES for where in ("none", "loss", "step")]
    cases += [("jax_unrolled", "none"), ("jax_unrolled", "per-layer"), ("jax_unrolled", "step")]
    temp = {}
    for style, where in cases:
        kw = {"layer_transform": jax.checkpoint} if where == "per-layer" else {}
        m = user_models.make(style, **shape, **kw)
        f = m.step(policy, "none" if where == "per-layer" else where)
        temp[(style, where)] = jmem.measure(f, m.state, m.batch).temp_bytes
    print(
        f"\nuser code: train step (value_and_grad + AdamW), {layers} layers, hidden {hidden}, "
        f"seq {seq}, batch {batch}, float32, policy {policy!r}, backend {jax.default_backend()}\n"
    )
    print("| model | no remat | remat(loss) | remat(step) | remat(step) / no remat |")
    print("|---|---:|---:|---:|---:|")
    mib = lambda b: f"{b / 2**20:,.1f}"
    for style in user_models.STYLES:
        n, lo, st = (temp[(style, w)] for w in ("none", "loss", "step"))
        print(f"| {style} | {mib(n)} | {mib(lo)} | {mib(st)} | {st / n:.2f} |")
    n, pl, st = (temp[("jax_unrolled", w)] for w in ("none", "per-layer", "step"))
    print("\n| Python-loop layers | no remat | jax.checkpoint per layer | remat(step) (warns) |")
    print("|---|---:|---:|---:|")
    print(f"| jax_unrolled | {mib(n)} | {mib(pl)} | {mib(st)} |")
    rows = [{"style": s, "where": w, "temp_bytes": b} for (s, w), b in temp.items()]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "shape": shape,
                "policy": policy,
                "dtype": "float32",
                "backend": jax.default_backend(),
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"\nwrote {out}")


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--user-code-only", action="store_true", help="only the user-code table")
    ap.add_argument("--user-code-policy", default="selective")
    args = ap.parse_args(argv)
    results = os.path.join(os.path.dirname(__file__), "results")
    user_code_table(
        4, 256, 256, 4, args.user_code_policy, os.path.join(results, "remat_user_code.json")
    )
    if args.user_code_only:
        return
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
