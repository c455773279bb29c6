"""Mixture-of-experts QLoRA memory: the job's dry run (``jmem finetune --dry-run``) for
Qwen3-30B-A3B and Mixtral 8x7B, QLoRA r=16 (NF4 base, LoRA on attention and every expert
projection, the job's defaults otherwise), 4,096 tokens, batch 1, each with the frozen base
on the device and streamed from host memory (``--offload params``).

Each row is one ``jmem finetune ... --dry-run --target h100_sxm`` (XLA:GPU compile for
h100_sxm without a GPU; needs the ``gpu-plan`` extra and ``JAX_PLATFORMS=cpu``), read from
its ``dry_run.json``: the compiled device peak, arguments and temporaries (``jmem.measure``)
and the planner's total, state ledgers (params, optimizer state, masters: the compile's
arguments) and grads + activations (its temporaries).
The goals set against published figures (theirs, not measured here): Unsloth's 17.5 GB for
Qwen3-30B-A3B and 28 GB for Mixtral 8x7B QLoRA. Prints a table and writes
``benchmarks/results/moe_memory_h100.json``. One compile at a time (each takes about a
minute of CPU on 2 cores).

    JAX_PLATFORMS=cpu python benchmarks/moe_memory.py
    JAX_PLATFORMS=cpu python benchmarks/moe_memory.py --rows qwen3_30b_a3b
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

GIB = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "moe_memory_h100.json")
MACHINE = "XLA:GPU compile for h100_sxm, no GPU, shared 2-core CPU machine"
#: preset -> (goal GiB, published figure)
GOALS = {
    "qwen3_30b_a3b": (16, "Unsloth: 17.5 GB"),
    "mixtral_8x7b": (24, "Unsloth: 28 GB"),
}


def dry_run(preset: str, offload: bool) -> dict:
    """``dry_run.json`` of one ``jmem finetune --dry-run --target h100_sxm`` row."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "jmem", "finetune", "--config", preset, "--lora-rank"]
        cmd += ["16", "--seq-len", "4096", "--batch-size", "1", "--dry-run", "--target"]
        cmd += ["h100_sxm", "--out", out, "--no-check-advice"] + ["--offload", "params"] * offload
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "dry_run.json")) as f:
            return json.load(f)


def row(preset: str, offload: bool) -> dict:
    """One table row: compiled peak and planner total (GiB), the goal and the published."""
    rec = dry_run(preset, offload)
    goal, published = GOALS[preset]
    peak = rec["compiled"]["peak_bytes"] / GIB
    est = rec["estimate"]
    state = est["params"] + est["optimizer_state"] + est["master_weights"]
    return {
        "config": preset,
        "offload_params": offload,
        "compiled_peak_gib": round(peak, 2),
        "compiled_args_gib": round(rec["compiled"]["argument_bytes"] / GIB, 2),
        "compiled_temp_gib": round(rec["compiled"]["temp_bytes"] / GIB, 2),
        "planner_total_gib": round(est["total"] / GIB, 2),
        "planner_state_gib": round(state / GIB, 2),
        "planner_grads_activations_gib": round((est["grads"] + est["activations"]) / GIB, 2),
        "trainable_params": rec["trainable_params"],
        "goal_gib": goal,
        "meets_goal": peak <= goal,
        "published": published,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=sorted(GOALS), choices=sorted(GOALS))
    args = ap.parse_args()
    rows = [row(p, off) for p in args.rows for off in (False, True)]
    head = f"{'config':16} {'offload':8} {'peak GiB':>9} {'planner':>8} {'goal':>5}  published"
    print(head)
    for r in rows:
        print(
            f"{r['config']:16} {str(r['offload_params']):8} {r['compiled_peak_gib']:9.2f} "
            f"{r['planner_total_gib']:8.2f} {r['goal_gib']:5}  {r['published']}"
        )
    commit = subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "machine": MACHINE,
        "setting": "QLoRA r=16 (--lora-targets all), 4,096 tokens, batch 1, job defaults",
        "rows": rows,
    }
    with open(OUT, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
