"""Where jmem's QLoRA step spends its time: XLA op time per category, and host overhead.

Builds the step of ``benchmarks/peer_qlora.py`` (the ``examples/qlora_7b.py`` step: NF4
double-quant base, LoRA r=8 on the seven projections, 8-bit AdamW, remat per layer;
default ``tiny`` Llama, batch 16 x seq 128), traces ``--steps`` steps with
``jax.profiler`` (one trace per step) and sums the duration of every XLA op (fusion,
library dot, loop) per step. Each op is put in a category from the JAX name stack that
XLA keeps in the op's metadata (``op_name``) for the op itself and, for a fusion, for
every instruction fused into it (jmem tags its pieces with ``jax.named_scope``:
``rms_norm``, ``rope``, ``attention``, ``cross_entropy``, ``lora``; the NF4 decoding runs
under ``jit(dequantize)``):

* ``matmul: base projections`` -- dots in the layer loop outside ``attention``/``lora``
  (the seven NF4 projections, forward, recomputation and input gradients);
* ``matmul: LoRA`` -- the ``x·a·b`` paths and their gradients;
* ``matmul: attention`` -- ``q·k`` scores and ``p·v`` context, forward and backward;
* ``matmul: LM head`` -- the output head (outside the layer loop);
* ``NF4 dequantization`` -- unpacking nibbles, code-book lookup, absmax decoding;
* ``attention: mask + softmax``, ``RMSNorm``, ``RoPE``, ``loss (cross-entropy)``;
* ``layout copies`` -- fusions whose result is a ``copy``/``transpose`` (XLA changing the
  layout of an operand, with the producing element-wise work fused in);
* ``element-wise (SwiGLU, residual)`` -- the rest of the layer body;
* ``layer loop bookkeeping`` -- slicing the stacked layer params, stacking residuals;
* ``optimizer (8-bit AdamW, clipping)`` -- the update (in the step's skip-if-non-finite
  ``cond``), the global norm and the rest outside the layer loop.

Host overhead per step: the step's wall time (``compiled(state, batch)`` then
``float(loss)``, as the example's loop) minus the span from the first op start to the last
op end of the same step's trace; also the time until ``compiled(...)`` returns
(dispatch). Op times are summed over the runtime's threads: independent ops run
concurrently on a multi-core CPU, so their sum can exceed the span (both are printed).

Run: ``python benchmarks/qlora_profile.py [--dtype float32] [--steps 5] [--batch 16]
[--seq 128]``; writes ``benchmarks/results/qlora_profile_<dtype>.json``. Checked on
XLA:CPU; on a GPU the categories come from the same metadata (kernel names are matched
to HLO names with ``.``/``-`` read as ``_``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
import time

import jax
from peer_qlora import HOST_ALLOCATOR_HELP
from peer_qlora import HOST_ALLOCATORS
from peer_qlora import JmemStep  # benchmarks/peer_qlora.py (this script's folder)
from peer_qlora import _batch
from peer_qlora import _commit
from peer_qlora import host_allocator

from jmem.models import llama

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_COMP = re.compile(r"^%?([\w.\-]+) .*\{\s*$")
_OPCODE = re.compile(r"^[^=(]*?\]\S*\s+([\w\-]+)\(|^\(.*?\)\s+([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")

CATEGORIES = (
    "matmul: base projections",
    "matmul: LoRA",
    "matmul: attention",
    "matmul: LM head",
    "NF4 dequantization",
    "attention: mask + softmax",
    "RMSNorm",
    "RoPE",
    "loss (cross-entropy)",
    "layout copies",
    "element-wise (SwiGLU, residual)",
    "layer loop bookkeeping",
    "optimizer (8-bit AdamW, clipping)",
)


def _norm(name: str) -> str:
    """Op names as the trace spells them (GPU kernel names use ``_`` for ``.`` and ``-``)."""
    return name.replace(".", "_").replace("-", "_")


def parse_hlo(text: str) -> dict[str, dict]:
    """Instruction name -> {opcode, op_name, fused: [(opcode, op_name)], root_opcode}."""
    comps: dict[str, list[tuple[str, str, bool]]] = collections.defaultdict(list)
    instrs: dict[str, dict] = {}
    comp = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("(")[0]:
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m or comp is None:
            continue
        name, rest = m.group(1), m.group(2)
        oc = _OPCODE.match(rest)
        opcode = (oc.group(1) or oc.group(2)) if oc else "?"
        on = _OP_NAME.search(rest)
        calls = _CALLS.search(rest)
        root = line.lstrip().startswith("ROOT ")
        comps[comp].append((opcode, on.group(1) if on else "", root))
        instrs[_norm(name)] = {
            "opcode": opcode,
            "op_name": on.group(1) if on else "",
            "calls": calls.group(1) if calls else None,
            "kind": "custom" if "kind=kCustom" in rest else "",
        }
    for v in instrs.values():
        body = comps.get(v["calls"] or "", []) if v["opcode"] == "fusion" else []
        v["fused"] = [(o, n) for o, n, _ in body]
        roots = [o for o, _, r in body if r]
        v["root_opcode"] = roots[0] if roots else v["opcode"]
    return instrs


_TAGS = (
    ("attention", "attention: mask + softmax"),
    ("rms_norm", "RMSNorm"),
    ("rope", "RoPE"),
    ("cross_entropy", "loss (cross-entropy)"),
)
_STRUCTURAL = {"parameter", "constant", "broadcast", "bitcast", "reshape", "get-tuple-element"}


def classify(ins: dict) -> str:
    """The category of one HLO instruction (see the module docstring)."""
    names = [ins["op_name"]] + [n for _, n in ins["fused"]]
    opcodes = {ins["opcode"]} | {o for o, _ in ins["fused"]}
    has = lambda tag: any(tag in n for n in names)  # noqa: E731
    # In the layer loop, or in an inlined layer (``scan_unroll``: the body's closed_call).
    in_loop = has("/while/") or has("closed_call")
    if "dot" in opcodes or "convolution" in opcodes or ins["kind"] == "custom":
        # The dot's own name; when a pass dropped it (bf16 dots rewritten through float32
        # on XLA:CPU), the names of whatever was fused with it.
        dot_names = [n for o, n in ins["fused"] if o == "dot" and n] or [ins["op_name"]]
        if not any(dot_names):
            dot_names = names
        if any("attention" in n for n in dot_names):
            return "matmul: attention"
        if any("/lora" in n for n in dot_names):
            return "matmul: LoRA"
        return "matmul: base projections" if in_loop else "matmul: LM head"
    if has("dequantize"):
        return "NF4 dequantization"
    fused_ops = {o for o, _ in ins["fused"]}
    if ins["root_opcode"] in ("copy", "transpose") or (
        ins["root_opcode"] == "bitcast" and fused_ops & {"copy", "transpose"}
    ):
        return "layout copies"
    # The tag most of the fused arithmetic carries (a SwiGLU fusion may take in one op of
    # the attention's backward); untagged arithmetic in the layer loop is element-wise.
    arith = [n for o, n in ins["fused"] if o not in _STRUCTURAL] or [ins["op_name"]]
    votes = collections.Counter(
        next((cat for tag, cat in _TAGS if tag in n), "element-wise" if "/while/" in n else "")
        for n in arith
    )
    best = max(votes, key=votes.get)
    if best and best != "element-wise":
        return best
    if ins["opcode"] in ("while", "conditional", "call"):
        return (
            "layer loop bookkeeping"
            if ins["opcode"] == "while"
            else "optimizer (8-bit AdamW, clipping)"
        )
    if in_loop:
        if opcodes & {"dynamic-slice", "dynamic-update-slice"} and not opcodes & {
            "multiply",
            "add",
            "divide",
        }:
            return "layer loop bookkeeping"
        return "element-wise (SwiGLU, residual)"
    return "optimizer (8-bit AdamW, clipping)"


def _trace_step(run) -> tuple[list[dict], float, float]:
    """One traced step: (its op events, wall seconds, dispatch seconds)."""
    tmp = tempfile.mkdtemp(prefix="jmem_qlora_profile_")
    try:
        with jax.profiler.trace(tmp):
            t0 = time.perf_counter()
            run.state, metrics = run.compiled(run.state, run.batch)
            t1 = time.perf_counter()
            float(metrics["loss"])
            t2 = time.perf_counter()
        files = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            raise RuntimeError(f"jax.profiler wrote no trace under {tmp}")
        with gzip.open(files[0]) as f:
            events = json.load(f)["traceEvents"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [e for e in events if e.get("ph") == "X"], t2 - t0, t1 - t0


def profile(dtype: str, args) -> dict:
    cfg = llama.get_config(args.config)
    run = JmemStep(cfg, dtype, _batch(cfg, args.batch, args.seq), remat=args.remat)
    text = run.compiled.as_text()
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(text)
    instrs = parse_hlo(text)
    for _ in range(args.warmup):
        run()
    walls, dispatch, spans = [], [], []
    per_cat = collections.defaultdict(float)
    per_op = collections.defaultdict(float)
    for _ in range(args.steps):
        events, wall, disp = _trace_step(run)
        ops = [e for e in events if _norm(e.get("name", "")) in instrs]
        if not ops:
            raise RuntimeError("the trace holds no event named after an HLO instruction")
        start = min(e["ts"] for e in ops)
        end = max(e["ts"] + e["dur"] for e in ops)
        walls.append(wall)
        dispatch.append(disp)
        spans.append((end - start) / 1e6)
        for e in ops:
            name = _norm(e["name"])
            ins = instrs[name]
            if ins["opcode"] in ("while", "conditional", "call"):
                continue  # their bodies' ops are traced on their own; avoid double counting
            per_cat[classify(ins)] += e["dur"] / 1e3 / args.steps
            per_op[name] += e["dur"] / 1e3 / args.steps
    untraced = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        run()
        untraced.append(time.perf_counter() - t0)
    op_sum = sum(per_cat.values())
    wall = statistics.median(walls)
    span = statistics.median(spans)
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[: args.top]
    return {
        "dtype": dtype,
        "wall_ms_median_untraced": statistics.median(untraced) * 1e3,
        "wall_ms_median_traced": wall * 1e3,
        "op_span_ms_median": span * 1e3,
        "host_overhead_ms": (wall - span) * 1e3,
        "dispatch_ms_median": statistics.median(dispatch) * 1e3,
        "op_ms_sum": op_sum,
        "categories": {
            c: {"ms_per_step": per_cat.get(c, 0.0), "share": per_cat.get(c, 0.0) / op_sum}
            for c in sorted(CATEGORIES, key=lambda c: -per_cat.get(c, 0.0))
        },
        "top_ops": [
            {
                "op": k,
                "ms_per_step": v,
                "category": classify(instrs[k]),
                "op_name": instrs[k]["op_name"],
            }
            for k, v in top
        ],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(llama.CONFIGS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="traced steps (one trace each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--remat", default="full")
    ap.add_argument(
        "--host-allocator", choices=HOST_ALLOCATORS, default="huge-pages", help=HOST_ALLOCATOR_HELP
    )
    ap.add_argument("--hlo", default=None, help="also write the compiled HLO text here")
    ap.add_argument("--top", type=int, default=15, help="slowest ops listed")
    ap.add_argument("--out", default=None, help="default results/qlora_profile_<dtype>.json")
    args = ap.parse_args(argv)
    applied = host_allocator(args.host_allocator, restart=argv is None)
    r = profile(args.dtype, args)
    tokens = args.batch * args.seq
    print(
        f"\njmem QLoRA step, {args.config} Llama, batch {args.batch} x seq {args.seq}, "
        f"{args.dtype} compute, {jax.devices()[0].platform}, {os.cpu_count()} CPUs: "
        f"{r['wall_ms_median_untraced']:.1f} ms/step untraced "
        f"({tokens / r['wall_ms_median_untraced'] * 1e3:,.0f} tok/s)\n"
    )
    print("| category | op time (ms/step) | share of op time |")
    print("|---|---:|---:|")
    for c, v in r["categories"].items():
        print(f"| {c} | {v['ms_per_step']:.1f} | {v['share']:.0%} |")
    print(f"| **all ops** (summed over threads) | {r['op_ms_sum']:.1f} | |")
    print(
        f"\nstep wall (traced) {r['wall_ms_median_traced']:.1f} ms; first op start to last op "
        f"end {r['op_span_ms_median']:.1f} ms; host overhead {r['host_overhead_ms']:.1f} ms "
        f"(dispatch returns after {r['dispatch_ms_median']:.2f} ms)\n"
    )
    print("slowest ops:")
    for t in r["top_ops"]:
        print(
            f"  {t['ms_per_step']:7.2f} ms  {t['op']:34s} {t['category']:32s} {t['op_name'][-70:]}"
        )
    out = args.out or os.path.join(
        os.path.dirname(__file__), "results", f"qlora_profile_{args.dtype}.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    meta = {
        "config": args.config,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "remat": args.remat,
        "host_allocator": args.host_allocator,
        "host_allocator_applied": applied,
        "backend": jax.devices()[0].platform,
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "jax": jax.__version__,
        "jmem_commit": _commit(),
    }
    with open(out, "w") as f:
        json.dump({**meta, **r}, f, indent=2)
    print(f"\nwrote {out}")
    return r


if __name__ == "__main__":
    main()  # argv None: the command line, which huge pages may restart
