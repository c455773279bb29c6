"""GRPO throughput: generation and training tokens per second of the job's GRPO step.

Runs ``jmem finetune --objective grpo`` (the README's toy task by default: ``--config
tiny``, the letters prompts and reward in ``examples/``) for ``--steps`` steps and reads
each step's ``generation_tokens_per_s`` and ``train_tokens_per_s`` from the run's
``metrics.jsonl``: the rollout's sampled tokens per second of its wall time, and the
training phase's (prompt + completion) tokens per second. Step 1 holds the compiles and
is left out of the medians. Prints a table and writes
``benchmarks/results/grpo_throughput.json`` with the date, commit and machine.

    python benchmarks/grpo_throughput.py                      # tiny on this machine's CPU
    python benchmarks/grpo_throughput.py --config llama3_1_8b --lora-rank 32 \\
        --num-generations 8 --batch-size 8 --max-prompt-len 1024 --max-completion-len 2048 \\
        --remat offload_inputs --generation-batch 2 --out benchmarks/results/grpo_8b.json
        # the 8B step on a GPU (every flag after the script's own goes to the job)

A timing taken while other work loads the machine is not a figure: run it alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOY = [
    "--config",
    "tiny",
    "--data",
    os.path.join(ROOT, "examples", "grpo_letters.jsonl"),
    "--reward",
    os.path.join(ROOT, "examples", "grpo_rewards.py") + ":lowercase_share",
    "--batch-size",
    "16",
    "--num-generations",
    "8",
    "--max-prompt-len",
    "32",
    "--max-completion-len",
    "16",
]


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, check=True)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _run_job(job_flags: list[str], steps: int, out_dir: str) -> list[dict]:
    """The job's per-step metrics (``metrics.jsonl`` rows of training steps)."""
    from jmem._src.finetune.command import main as finetune_main  # noqa: PLC0415

    argv = [*job_flags, "--objective", "grpo", "--steps", str(steps), "--no-progress"]
    finetune_main([*argv, "--out", out_dir])
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "generation_tokens_per_s" in r]


def measure(job_flags: list[str], steps: int) -> dict:
    """Medians over steps 2..N of the generation and training tokens per second."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = _run_job(job_flags, steps, os.path.join(tmp, "run"))
    timed = rows[1:] or rows
    return {
        "steps_timed": len(timed),
        "generation_tokens_per_s": statistics.median(r["generation_tokens_per_s"] for r in timed),
        "train_tokens_per_s": statistics.median(r["train_tokens_per_s"] for r in timed),
        "completion_length_mean": statistics.median(
            r.get("completions/mean_length", float("nan")) for r in timed
        ),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="GRPO steps (the first is not timed)")
    p.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results", "grpo_throughput.json")
    )
    args, job_flags = p.parse_known_args(argv)
    job_flags = job_flags or TOY
    row = measure(job_flags, args.steps)
    import jax  # noqa: PLC0415 (after the job has started JAX)

    result = {
        "what": "jmem finetune --objective grpo: rollout and training tokens per second "
        "(medians over steps 2..N of metrics.jsonl)",
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.devices()[0].device_kind}",
        "job_flags": job_flags,
        "steps": args.steps,
        **row,
    }
    print(f"{'phase':<12}{'tokens/s':>12}")
    print(f"{'generation':<12}{row['generation_tokens_per_s']:>12,.0f}")
    print(f"{'training':<12}{row['train_tokens_per_s']:>12,.0f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
