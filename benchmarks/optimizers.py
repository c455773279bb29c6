"""Optimizer update time and state memory: optax.adamw vs jmem 8-/4-bit vs bitsandbytes.

For a ~16M-parameter tree (four 2048x2048 matrices) measures, in one process:
  * median wall time of one jitted update+apply step (params and state donated; JAX:
    optax.adamw, jmem adamw_8bit/adamw_4bit) or ``optimizer.step()`` (PyTorch:
    bitsandbytes AdamW8bit, torchao AdamW8bit when installed), with the gradients passed
    in, and for JAX also inside a train step whose gradients come from a matmul,
  * minor page faults per step (fresh pages of the step's temporary buffers),
  * optimizer-state bytes per parameter,
  * ratio to optax.adamw's time.
Prints a markdown table and writes benchmarks/results/optimizers.json.

Run: ``python benchmarks/optimizers.py [--reps 10] [--dim 2048] [--num 4] [--skip-torch]``
(on a GPU: ``--dim 8192 --skip-torch``, 268M parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmem import tree as jmem_tree
from jmem._src.optim import quantized_adam as opt_lib


class _JaxRunner:
    """A jitted, donated step; ``run_once`` times one step.

    ``mode="update"``: ``update + apply_updates`` with the gradients passed in (as the
    issue's measurement; params and state donated). ``mode="train"``: the gradients are
    made inside the same jitted step by a small matmul (``x.T @ y`` per matrix, batch 8),
    as in a training step where the backward pass writes them into temporary buffers.
    """

    def __init__(self, tx, params, grads, mode="update"):
        if mode == "update":

            def step(p, s, g):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s
        else:

            def step(p, s, g):
                x, y = g  # [8, dim] each
                leaves, treedef = jax.tree.flatten(p)  # a different gradient per matrix
                grads = treedef.unflatten(
                    [(x.T @ (y * (i + 1.0))).astype(w.dtype) for i, w in enumerate(leaves)]
                )
                u, s = tx.update(grads, s, p)
                return optax.apply_updates(p, u), s

            dim = jax.tree.leaves(params)[0].shape[0]
            grads = (
                jax.random.normal(jax.random.key(1), (8, dim)) * 0.1,
                jax.random.normal(jax.random.key(2), (8, dim)) * 0.1,
            )

        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.grads = grads
        self.p, self.s = jax.tree.map(jnp.copy, params), tx.init(params)
        for _ in range(2):  # compile + warm up
            self.p, self.s = self.step(self.p, self.s, grads)
        jax.block_until_ready((self.p, self.s))
        self.times = []
        self.faults = []

    def run_once(self):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        self.p, self.s = self.step(self.p, self.s, self.grads)
        jax.block_until_ready((self.p, self.s))
        self.times.append(time.perf_counter() - t0)
        # Minor page faults: fresh pages for the step's temporary buffers (XLA:CPU allocates
        # them anew on each execution).
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)


def _time_torch(make_opt, params, grads, reps):
    import torch

    tparams = [torch.nn.Parameter(torch.tensor(np.asarray(p))) for p in jax.tree.leaves(params)]
    for tp, g in zip(tparams, jax.tree.leaves(grads)):
        tp.grad = torch.tensor(np.asarray(g))
    opt = make_opt(tparams)
    opt.step()
    opt.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    nbytes = 0
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k not in ("qmap1", "qmap2"):  # shared maps
                nbytes += v.numel() * v.element_size()
    return statistics.median(times), min(times), nbytes


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--num", type=int, default=4)
    ap.add_argument(
        "--skip-torch",
        action="store_true",
        help="skip the PyTorch optimizers (bitsandbytes, torchao; they run on the CPU), "
        "e.g. for a large tree on a GPU",
    )
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "optimizers.json")
    )
    args = ap.parse_args()

    keys = jax.random.split(jax.random.key(0), args.num)
    params = {
        f"w{i}": jax.random.normal(k, (args.dim, args.dim), jnp.float32) for i, k in enumerate(keys)
    }
    grads = jax.tree.map(lambda p: 0.01 * p, params)
    n = sum(p.size for p in jax.tree.leaves(params))

    rows = []
    jax_opts = [
        ("optax.adamw (fp32)", optax.adamw(1e-3, weight_decay=0.01)),
        ("jmem adamw_8bit", opt_lib.adamw_8bit(1e-3)),
        ("jmem adamw_4bit", opt_lib.adamw_4bit(1e-3)),
    ]
    # Interleave the JAX optimizers step by step, so that load from other processes on a
    # shared machine affects them alike; report medians.
    for mode in ("update", "train"):
        runners = [_JaxRunner(tx, params, grads, mode) for _, tx in jax_opts]
        for _ in range(args.reps):
            for r in runners:
                r.run_once()
        for (name, _), r in zip(jax_opts, runners):
            rows.append(
                {
                    "optimizer": name if mode == "update" else f"{name}, in a train step",
                    "mode": mode,
                    "median_ms": statistics.median(r.times) * 1e3,
                    "min_ms": min(r.times) * 1e3,
                    "page_faults_per_step": statistics.median(r.faults),
                    "state_bytes_per_param": jmem_tree.nbytes(r.s) / n,
                    "skipped": None,
                }
            )
        del runners

    torch_opts = []
    if args.skip_torch:
        rows.append({"optimizer": "bitsandbytes, torchao (CPU)", "skipped": "--skip-torch"})
    else:
        try:
            import bitsandbytes as bnb  # noqa: F401

            torch_opts.append(
                ("bitsandbytes AdamW8bit (CPU)", lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3))
            )
        except Exception as e:  # pragma: no cover - optional
            rows.append(
                {"optimizer": "bitsandbytes AdamW8bit (CPU)", "skipped": f"not available: {e}"}
            )
        try:
            from torchao.optim import AdamW8bit as TaoAdamW8bit

            torch_opts.append(("torchao AdamW8bit (CPU)", lambda ps: TaoAdamW8bit(ps, lr=1e-3)))
        except Exception as e:
            rows.append(
                {
                    "optimizer": "torchao AdamW8bit (CPU)",
                    "skipped": f"not available: {type(e).__name__}",
                }
            )
    for name, make in torch_opts:
        try:
            t, tmin, b = _time_torch(make, params, grads, max(3, args.reps // 2))
            rows.append(
                {
                    "optimizer": name,
                    "mode": "update",
                    "median_ms": t * 1e3,
                    "min_ms": tmin * 1e3,
                    "state_bytes_per_param": b / n,
                    "skipped": None,
                }
            )
        except Exception as e:  # pragma: no cover - optional
            rows.append({"optimizer": name, "skipped": f"failed: {type(e).__name__}: {e}"})

    base = {r["mode"]: r["median_ms"] for r in rows if r["optimizer"].startswith("optax.adamw")}
    for r in rows:
        if r.get("skipped") is None:
            r["ratio_to_optax_adamw"] = r["median_ms"] / base[r.get("mode", "update")]

    print(
        f"\n{n / 1e6:.1f}M params ({args.num} x [{args.dim}, {args.dim}] float32), "
        f"median of {args.reps} steps, {jax.devices()[0].platform}, {os.cpu_count()} CPUs\n"
    )
    print(
        "| optimizer | median step (ms) | min (ms) | x optax.adamw | page faults/step | state bytes/param |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if r.get("skipped"):
            print(f"| {r['optimizer']} | skipped: {r['skipped']} | | | | |")
        else:
            mn = f"{r['min_ms']:.1f}" if "min_ms" in r else ""
            pf = f"{r['page_faults_per_step']:.0f}" if "page_faults_per_step" in r else ""
            print(
                f"| {r['optimizer']} | {r['median_ms']:.1f} | {mn} | {r['ratio_to_optax_adamw']:.2f} | "
                f"{pf} | {r['state_bytes_per_param']:.3f} |"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "num_params": n,
                "shapes": [[args.dim, args.dim]] * args.num,
                "reps": args.reps,
                "backend": jax.devices()[0].platform,
                "cpu_count": os.cpu_count(),
                "jax": jax.__version__,
                "optax": optax.__version__,
                "machine": platform.machine(),
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
