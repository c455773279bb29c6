"""Context parallelism per device: the job's dry run on a ``--mesh context=N`` of a GPU
target's compile-only devices, for each ``--remat`` policy and ``--context-strategy``.

Each row is one ``jmem finetune --dry-run --target TARGET --mesh context=N`` (a subprocess,
``JAX_PLATFORMS=cpu``; nothing allocated, no GPU needed): QLoRA rank 32 on the NF4 base,
batch 1, one sequence of ``--seq-len`` tokens split over the ``N`` devices. Per device:
the compiled arguments, temporaries and peak, the host buffers (``offload_inputs``: the
layer inputs in pinned host memory), and the bytes each kind of collective delivers per
step (``jmem._src.hlo_collectives``, loops by trip count). Prints a table and writes
``benchmarks/results/context_parallel_h100.json``.

    python benchmarks/context_parallel.py          # llama3_1_8b, 1M tokens, context=8
    python benchmarks/context_parallel.py --remats offload_inputs --strategies ulysses \\
        --seq-lens 2097152 4194304 --out /tmp/longest.json

Figures are "XLA:GPU compile for h100_sxm without a GPU" (not autotuned, not run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

GiB = 2**30


def dry_run(args, remat: str, strategy: str, seq: int) -> dict:
    """One dry run's ``dry_run.json`` plus its wall time (``seconds``)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "jmem", "finetune", "--config", args.config]
        cmd += ["--lora-rank", "32", "--batch-size", "1", "--seq-len", str(seq)]
        cmd += ["--mesh", f"context={args.context}", "--dry-run"]
        cmd += ["--target", args.target] if args.target else []
        cmd += ["--remat", remat, "--context-strategy", strategy, "--out", out]
        cmd += ["--no-check-advice"]  # the step's own figures (and time) only
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        t0 = time.time()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            return {"error": done.stderr.strip().splitlines()[-1:], "seconds": time.time() - t0}
        with open(os.path.join(out, "dry_run.json")) as f:
            record = json.load(f)
        return {**record, "seconds": time.time() - t0}


def row(remat: str, strategy: str, seq: int, record: dict) -> dict:
    """The table's row of one dry run's record."""
    base = dict(remat=remat, strategy=strategy, seq_len=seq, seconds=round(record["seconds"]))
    if "error" in record:
        return {**base, "error": record["error"]}
    c = record["compiled"]
    return {
        **base,
        "argument_bytes": c["argument_bytes"],
        "temp_bytes": c["temp_bytes"],
        "peak_bytes": c["peak_bytes"],
        "host_peak_bytes": c["host_peak_bytes"],
        "collective_bytes": c.get("collective_bytes"),
        "planner_total_bytes": record["estimate"]["total"],
        "fits": record["fits"],
        "memory": record["memory"],
    }


def table(rows: list[dict]) -> str:
    """The rows as a text table (GiB)."""
    head = f"{'remat':16}{'strategy':12}{'seq':>9}{'peak':>9}{'temp':>9}{'host':>9}"
    head += f"{'planner':>9}  collectives per step (GiB)"
    lines = [head]
    for r in rows:
        start = f"{r['remat']:16}{r['strategy']:12}{r['seq_len']:>9}"
        if "error" in r:
            lines.append(f"{start}  error: {r['error']}")
            continue
        g = lambda k, r=r: f"{r[k] / GiB:>9.2f}"
        moved = r["collective_bytes"] or {}
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in moved.items() if v)
        lines.append(
            start + g("peak_bytes") + g("temp_bytes") + g("host_peak_bytes")
            + g("planner_total_bytes") + "  " + parts
        )  # fmt: skip
    return "\n".join(lines)


def commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True
        )
        return out.stdout.decode().strip()
    except OSError:
        return "unknown"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama3_1_8b")
    p.add_argument("--target", default="h100_sxm", help="'' for the running backend")
    p.add_argument("--context", type=int, default=8)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1 << 20])
    p.add_argument("--remats", nargs="+", default=["full", "offload_inputs"])
    p.add_argument("--strategies", nargs="+", default=["all_gather", "ring", "ulysses"])
    p.add_argument("--out", default="benchmarks/results/context_parallel_h100.json")
    args = p.parse_args(argv)
    rows = []
    for seq in args.seq_lens:
        for remat in args.remats:
            for strategy in args.strategies:
                rows.append(row(remat, strategy, seq, dry_run(args, remat, strategy, seq)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
        "figures": f"XLA:GPU compile for {args.target} without a GPU (not autotuned)"
        if args.target
        else "compiled for the running backend",
        "config": args.config,
        "context": args.context,
        "method": "QLoRA r=32 (NF4 base), batch 1, --dry-run --mesh context=N",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
