"""Where the optimizer update's time goes: XLA ops per pass, optax.adamw vs jmem 8-/4-bit.

Traces a few jitted update steps (update + apply, params and state donated, gradients
passed in; the tree of ``benchmarks/optimizers.py``: four 2048 x 2048 float32 matrices)
with ``jax.profiler`` and sums the duration of every XLA op (fusion) per step. Each op is
put in a pass by the array it writes (read from the compiled HLO):

* ``uint8 codes`` from float32 operands -> ``requantize`` (scale by the new absmax, nearest
  code), from codes only -> ``unpack 4-bit codes`` (the two nibbles of each byte);
* ``float32 [blocks]`` -> ``block absmax`` (the reduction, and the tiny scale fusions);
* ``float32 [blocks, block_size]`` (4-bit: ``[blocks, 2, block_size / 2]``) ->
  ``dequantize + moment`` (float32 moments written as temporaries);
* the parameter's shape -> ``parameter`` for jmem (update and apply), ``moment or
  parameter`` for optax.adamw (its three element-wise passes write m, v and the params);
* anything else -> ``other`` (step count, bias correction, the ordering dependency).

Op times are wall times of each op on the runtime's threads; ops on independent data run
concurrently, so their sum can exceed the step's wall time (both are reported). The wall
time is the median of ``2 * steps + 1`` untraced steps; untraced steps, then ``steps``
traced ones, alternate between the optimizers. Checked on XLA:CPU only.
Prints a table and writes ``benchmarks/results/optimizer_profile.json``.

Run: ``python benchmarks/optimizer_profile.py [--steps 10] [--dim 2048] [--num 4]``.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import optax
from optimizers import _JaxRunner  # benchmarks/optimizers.py (this script's folder)

from jmem._src.optim import quantized_adam as opt_lib

_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (\w[\w-]*)\(([^)]*)\)")


def _norm(name: str) -> str:
    """Op names as the trace spells them (GPU kernel names use ``_`` for ``.`` and ``-``)."""
    return name.replace(".", "_").replace("-", "_")


def _ops(hlo_text: str) -> dict[str, tuple[str, tuple[int, ...], list[str]]]:
    """Name -> (dtype, shape, operand names) of every array-valued instruction of the
    module (names are unique in an HLO module; loop bodies included)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if m:
            shape = tuple(int(d) for d in m.group(3).split(",") if d)
            operands = [_norm(o.strip().lstrip("%")) for o in m.group(5).split(",") if o.strip()]
            out[_norm(m.group(1))] = (m.group(2), shape, operands)
    return out


def _classify(name, ops, param_shape, quantized: bool) -> str:
    dtype, shape, operands = ops[name]
    if dtype == "u8" and len(shape) == 2 and shape[1] > 1:
        # From float32 moments: requantize; from codes only: unpacking 4-bit codes.
        if any(ops.get(o, ("",))[0] == "f32" for o in operands):
            return "requantize"
        return "unpack 4-bit codes"
    if shape == param_shape:
        return "parameter" if quantized else "moment or parameter"
    if dtype == "f32" and len(shape) >= 2:
        return "dequantize + moment"
    if dtype == "f32" and len(shape) == 1 and shape[0] > 1:
        return "block absmax"
    return "other"


class _Profiled(_JaxRunner):
    """``benchmarks/optimizers.py``'s jitted, donated update step, also traced."""

    def __init__(self, name, tx, params, grads, quantized):
        super().__init__(tx, params, grads, mode="update")  # compiles, warms up
        self.name, self.quantized = name, quantized
        self.param_shape = tuple(jax.tree.leaves(params)[0].shape)
        self.ops = _ops(self.step.lower(self.p, self.s, self.grads).compile().as_text())
        self.events, self.traced_steps = [], 0

    def trace(self):
        """One traced step; keeps its XLA op events."""
        tmp = tempfile.mkdtemp(prefix="jmem_profile_")
        try:
            with jax.profiler.trace(tmp):
                self.run_once()
            files = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
            if not files:
                raise RuntimeError(f"jax.profiler wrote no trace under {tmp}")
            with gzip.open(files[0]) as f:
                events = json.load(f)["traceEvents"]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        del self.times[-1], self.faults[-1]  # wall times: untraced steps only
        self.events += [
            e for e in events if e.get("ph") == "X" and _norm(e.get("name", "")) in self.ops
        ]
        self.traced_steps += 1

    def result(self) -> dict:
        per_pass = collections.defaultdict(lambda: {"ms_per_step": 0.0, "ops": set()})
        for e in self.events:
            kind = _classify(_norm(e["name"]), self.ops, self.param_shape, self.quantized)
            per_pass[kind]["ms_per_step"] += e["dur"] / 1e3 / self.traced_steps
            per_pass[kind]["ops"].add(e["name"])
        passes = {
            k: {"ms_per_step": v["ms_per_step"], "ops_per_step": len(v["ops"])}
            for k, v in sorted(per_pass.items(), key=lambda kv: -kv[1]["ms_per_step"])
        }
        return {
            "optimizer": self.name,
            "wall_ms_median": statistics.median(self.times) * 1e3,
            "traced_steps": self.traced_steps,
            "op_ms_sum": sum(v["ms_per_step"] for v in passes.values()),
            "passes": passes,
        }


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--num", type=int, default=4)
    ap.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "results", "optimizer_profile.json"),
    )
    args = ap.parse_args()

    keys = jax.random.split(jax.random.key(0), args.num)
    params = {
        f"w{i}": jax.random.normal(k, (args.dim, args.dim), jnp.float32) for i, k in enumerate(keys)
    }
    grads = jax.tree.map(lambda p: 0.01 * p, params)
    n = sum(p.size for p in jax.tree.leaves(params))
    runs = [
        _Profiled("optax.adamw (fp32)", optax.adamw(1e-3, weight_decay=0.01), params, grads, False),
        _Profiled("jmem adamw_8bit", opt_lib.adamw_8bit(1e-3), params, grads, True),
        _Profiled("jmem adamw_4bit", opt_lib.adamw_4bit(1e-3), params, grads, True),
    ]
    # Interleaved, step by step, so that load from other processes affects all alike.
    for _ in range(2 * args.steps + 1):
        for r in runs:
            r.run_once()
    for _ in range(args.steps):
        for r in runs:
            r.trace()
    rows = [r.result() for r in runs]

    print(
        f"\n{n / 1e6:.1f}M params ({args.num} x [{args.dim}, {args.dim}] float32), "
        f"{args.steps} traced steps, {jax.devices()[0].platform}, {os.cpu_count()} CPUs\n"
    )
    print("| optimizer | pass | ops/step | op time (ms/step) | share of op time |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        for k, v in r["passes"].items():
            print(
                f"| {r['optimizer']} | {k} | {v['ops_per_step']} | {v['ms_per_step']:.1f} | "
                f"{v['ms_per_step'] / r['op_ms_sum']:.0%} |"
            )
        print(
            f"| {r['optimizer']} | **all ops** (step wall time {r['wall_ms_median']:.1f} ms) | | "
            f"{r['op_ms_sum']:.1f} | |"
        )
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(__file__),
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "num_params": n,
                "shapes": [[args.dim, args.dim]] * args.num,
                "steps": args.steps,
                "backend": jax.devices()[0].platform,
                "cpu_count": os.cpu_count(),
                "jax": jax.__version__,
                "optax": optax.__version__,
                "machine": platform.machine(),
                "jmem_commit": commit,
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
