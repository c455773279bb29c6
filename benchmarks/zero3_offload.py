"""The seed's 7B / 8-GPU ZeRO-3 table, compiled: full fine-tuning of Llama-2-7B on 8
``h100_sxm`` devices with and without each offload rung, without a GPU.

    JAX_PLATFORMS=cpu python benchmarks/zero3_offload.py                    # all rungs
    JAX_PLATFORMS=cpu python benchmarks/zero3_offload.py --rungs none --no-save
    JAX_PLATFORMS=cpu python benchmarks/zero3_offload.py --config tiny --seq-len 256 --no-save

Builds ``jmem.train_step`` (``benchmarks/full_ft_offload.py``'s ``build``) with ZeRO-3 over
an 8-device ``h100_sxm`` mesh (``jmem.targets.mesh``), bf16 params, fp32 masters and AdamW
moments (``optax.adamw``; ``--optimizer adamw_8bit`` for 8-bit moments), full remat, one
sequence of ``--seq-len`` tokens per device, for the rungs: ``none`` (everything on the
device), ``optimizer`` (moments and masters in ``pinned_host``, updated leaf by leaf) and
``optimizer,params`` (the params too, each device streaming its FSDP shard of a layer).
Compiles each with XLA:GPU on abstract shapes and prints, per device: the compiled peak,
the host bytes, the seed's figure and ``jmem.planner.estimate``'s device total for the same
rung (``offload="optimizer+masters"``: jmem offloads the masters with the state). Writes
``benchmarks/results/gpu_compile/zero3_<config>.json``, labelled "XLA:GPU compile for
h100_sxm, no GPU". Needs the ``gpu-plan`` extra. Sources: ZeRO (Rajbhandari et al., 2020,
arXiv:1910.02054), ZeRO-Offload (arXiv:2101.06840), ZeRO-Infinity (arXiv:2104.07857).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
from full_ft_offload import build  # noqa: E402
from full_ft_offload import planner_total  # noqa: E402
from full_ft_offload import stacked_on_device  # noqa: E402

import jmem  # noqa: E402
from jmem._src.measure import _compile_for  # noqa: E402
from jmem._src.measure import report_from_compiled  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_compile")
GB = 1e9
#: rung -> (offload_optimizer, params streamed, planner offload=, the seed's GB per GPU).
RUNGS = {
    "none": (False, False, False, 72),
    "optimizer": ("leaf_by_leaf", False, "optimizer+masters", 24),
    "optimizer,params": ("leaf_by_leaf", True, "optimizer+masters,params", 12),
}


def run(config: str, seq_len: int, target: str, optimizer: str, rung: str, fsdp: int) -> dict:
    """Compiles one rung's step for ``fsdp`` ``target`` devices; the figures (bytes)."""
    mode, streamed, planner_offload, seed = RUNGS[rung]
    t0 = time.perf_counter()
    step, state, batch, cfg = build(
        config,
        seq_len,
        optimizer,
        masters=True,
        streamed=streamed,
        offload_optimizer=mode,
        fsdp=fsdp,
        target=target,
    )
    compiled = _compile_for(step.jitted, jmem.targets.get(target), (state, batch), {})
    report = report_from_compiled(compiled, target)
    layers = jax.tree.leaves(state.params["layers"])
    stacked = sorted({f"bf16[{','.join(map(str, x.shape))}]" for x in layers})
    planned, planned_host = planner_total(
        config, seq_len, optimizer, planner_offload, step.levers, fsdp=fsdp, masters=True
    )
    return {
        "rung": rung,
        "offload_optimizer": mode,
        "offload_params": streamed,
        "device_peak_bytes": report.peak_bytes,
        "device_argument_bytes": report.argument_bytes,
        "device_temp_bytes": report.temp_bytes,
        "host_argument_bytes": report.host_argument_bytes,
        "host_temp_bytes": report.host_temp_bytes,
        "planner_device_bytes": planned,
        "planner_host_bytes": planned_host,
        "planner_error": round(planned / report.peak_bytes - 1, 3),
        "seed_gb_per_gpu": seed,
        "whole_stacked_leaf_on_device": stacked_on_device(compiled.as_text(), stacked)[:3],
        "compile_seconds": round(time.perf_counter() - t0, 1),
    }


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (GB = 1e9 bytes, per device)."""
    out = [
        "| rung | device peak | host (args + temps) | seed | planner device total | planner vs compile |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        host = (r["host_argument_bytes"] + r["host_temp_bytes"]) / GB
        out.append(
            f"| `{r['rung']}` | {r['device_peak_bytes'] / GB:.2f} GB | {host:.2f} GB | "
            f"~{r['seed_gb_per_gpu']} GB | {r['planner_device_bytes'] / GB:.2f} GB | "
            f"{100 * r['planner_error']:+.1f}% |"
        )
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama2_7b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--fsdp", type=int, default=8)
    ap.add_argument("--target", default="h100_sxm")
    ap.add_argument("--optimizer", choices=("adamw", "adamw_8bit"), default="adamw")
    ap.add_argument("--rungs", default=";".join(RUNGS), help="';'-separated subset of RUNGS")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    reason = jmem.targets.unavailable_reason(args.target)
    if reason:
        sys.exit(f"no XLA:GPU compiler here: {reason}")
    rungs = args.rungs.split(";")
    if not set(rungs) <= set(RUNGS):
        sys.exit(f"--rungs: ';'-separated names from {list(RUNGS)}; got {args.rungs!r}")
    rows = []
    for rung in rungs:
        rows.append(run(args.config, args.seq_len, args.target, args.optimizer, rung, args.fsdp))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.no_save:
        return
    out = {
        "label": f"XLA:GPU compile for {args.target}, no GPU",
        "config": args.config,
        "devices": args.fsdp,
        "strategy": "zero3",
        "seq_len_per_device": args.seq_len,
        "batch_per_device": 1,
        "remat": "full",
        "optimizer": args.optimizer + " + fp32 masters, bf16 params",
        "rows": rows,
    }
    os.makedirs(RESULTS, exist_ok=True)
    name = "7b" if args.config == "llama2_7b" else args.config
    suffix = "" if args.optimizer == "adamw" else "_8bit"
    path = os.path.join(RESULTS, f"zero3_{name}{suffix}.json")
    if os.path.exists(path):  # merge: one rung per run keeps memory low
        old = {r["rung"]: r for r in json.load(open(path)).get("rows", [])}
        old.update({r["rung"]: r for r in rows})
        out["rows"] = [old[r] for r in RUNGS if r in old]
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
