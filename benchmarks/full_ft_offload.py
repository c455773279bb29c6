"""Full-parameter fine-tuning with the params and the optimizer state in host memory,
compiled for a GPU target without a GPU (docs/offload.md, "The 8B figure").

    JAX_PLATFORMS=cpu python benchmarks/full_ft_offload.py                       # 8B, 4,096
    JAX_PLATFORMS=cpu python benchmarks/full_ft_offload.py --config tiny --seq-len 256 --no-save

Builds ``jmem.train_step`` for the reference Llama with ``Levers(remat="full",
offload_params=True)`` (bf16 params in ``pinned_host``, each layer streamed to the device in
the layer scan; each layer's gradient written to host memory by the backward loop),
``jmem.adamw_8bit`` (or ``optax.adamw``) and ``offload_optimizer="leaf_by_leaf"`` (the
8-bit moments in host memory, updated one parameter leaf at a time on the device), on
abstract shapes (nothing allocated), compiles it with XLA:GPU for ``--target`` and reads
its buffer assignment: device peak, host bytes, and whether any device buffer has the shape
of a stacked ``[L, ...]`` parameter (or gradient); and ``jmem.planner.estimate``'s device
total for the same step, with its error against the compile. Writes
``benchmarks/results/gpu_compile/full_ft_offload_<config>.json`` (labelled "XLA:GPU compile
for <target>, no GPU"). Needs the ``gpu-plan`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jmem  # noqa: E402
from jmem._src.measure import _compile_for  # noqa: E402
from jmem._src.measure import report_from_compiled  # noqa: E402
from jmem.models import llama  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_compile")
GIB = 2**30


def build(
    config: str,
    seq_len: int,
    optimizer: str = "adamw_8bit",
    masters: bool = False,
    streamed: bool = True,
    *,
    offload_optimizer: bool | str = "leaf_by_leaf",
    fsdp: int = 1,
    target: str = "h100_sxm",
):
    """``(step, abstract state, abstract batch, config)`` of the full fine-tuning step:
    bf16 params (fp32 masters in the optimizer state with ``masters``), full remat, the
    optimizer state leaf by leaf in host memory (``offload_optimizer``), and the params
    streamed from host memory (``streamed=False``: on the device, for comparison). With
    ``fsdp > 1``: ZeRO-3 over ``fsdp`` of ``target``'s devices (``jmem.targets.mesh``), a
    batch of one sequence per device."""
    cfg = llama.get_config(config, max_seq_len=max(seq_len, 512))
    lv = jmem.Levers(remat="full", offload_params=streamed)

    def loss_fn(params, batch):
        return llama.loss_fn(params, batch, cfg, levers=lv)

    opt = jmem.adamw_8bit(1e-5) if optimizer == "adamw_8bit" else optax.adamw(1e-5)
    kw = dict(precision="p=bf16,c=bf16", master_weights=True) if masters else {}
    if fsdp > 1:
        kw["mesh"] = jmem.targets.mesh(target, (1, fsdp), ("data", "fsdp"))
    step = jmem.train_step(loss_fn, opt, levers=lv, offload_optimizer=offload_optimizer, **kw)
    params = llama.abstract_params(cfg, jnp.float32 if masters else jnp.bfloat16)
    state = step.abstract_state(params)
    tokens = jax.ShapeDtypeStruct((fsdp, seq_len), jnp.int32)
    return step, state, {"inputs": tokens, "targets": tokens}, cfg


def planner_total(
    config: str, seq_len: int, optimizer: str, offload, lv, *, fsdp: int = 1, masters: bool
) -> tuple[int, int]:
    """``(device bytes, host bytes)`` per device of ``jmem.planner.estimate`` for the step
    (ZeRO-3 over ``fsdp`` devices when ``fsdp > 1``; ``lv``: the step's levers)."""
    ledger = jmem.planner.estimate(
        llama.get_config(config, max_seq_len=max(seq_len, 512)),
        param_dtype="bf16",
        optimizer=optimizer,
        master_weights=masters,
        offload=offload,
        batch_size=1,
        seq_len=seq_len,
        num_shards=fsdp,
        zero_stage=3 if fsdp > 1 else None,
        levers=lv,
        target="h100_sxm",
    )
    return int(ledger.total), int(ledger.host_total)


def stacked_on_device(text: str, stacked: list) -> list[str]:
    """HLO lines where one of the ``stacked`` shapes (``"bf16[32,4096,14336]"``) appears in
    device memory (any layout without the host memory space ``S(5)``)."""
    bad = []
    for line in text.splitlines():
        for s in stacked:
            if any(not h.split("}")[0].endswith("S(5)") for h in line.split(s + "{")[1:]):
                bad.append(line.strip()[:200])
    return bad


def run(config: str, seq_len: int, target: str, optimizer: str, masters: bool) -> dict:
    """Compiles the step for ``target`` and returns the figures (bytes, seconds)."""
    t0 = time.perf_counter()
    step, state, batch, cfg = build(config, seq_len, optimizer, masters)
    compiled = _compile_for(step.jitted, jmem.targets.get(target), (state, batch), {})
    report = report_from_compiled(compiled, target)
    layers = jax.tree.leaves(state.params["layers"])
    stacked = sorted({f"{jnp.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]" for x in layers})
    stacked = [s.replace("bfloat16", "bf16").replace("float32", "f32") for s in stacked]
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
    offload = "optimizer+masters,params" if masters else "optimizer,params"
    planned, planned_host = planner_total(
        config, seq_len, optimizer, offload, step.levers, masters=masters
    )
    return {
        "label": f"XLA:GPU compile for {target}, no GPU",
        "config": config,
        "num_params": llama.num_params(cfg),
        "seq_len": seq_len,
        "batch": 1,
        "remat": "full",
        "optimizer": optimizer + (" + fp32 masters" if masters else ""),
        "offload": "params (streamed per layer) + optimizer (leaf_by_leaf), pinned_host",
        "param_bytes": param_bytes,
        "grad_bytes": param_bytes,
        "optimizer_state_bytes": opt_bytes,
        "device_peak_bytes": report.peak_bytes,
        "device_peak_gib": round(report.peak_bytes / GIB, 3),
        "device_argument_bytes": report.argument_bytes,
        "device_temp_bytes": report.temp_bytes,
        "host_argument_bytes": report.host_argument_bytes,
        "host_temp_bytes": report.host_temp_bytes,
        "host_peak_bytes": report.host_peak_bytes,
        "planner_device_bytes": planned,
        "planner_host_bytes": planned_host,
        "planner_error": round(planned / report.peak_bytes - 1, 3),
        "stacked_shapes_on_device": stacked_on_device(compiled.as_text(), stacked)[:5],
        "compile_seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llama3_1_8b")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--target", default="h100_sxm")
    ap.add_argument("--optimizer", choices=("adamw_8bit", "adamw"), default="adamw_8bit")
    ap.add_argument("--masters", action="store_true", help="fp32 master weights (host)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    reason = jmem.targets.unavailable_reason(args.target)
    if reason:
        sys.exit(f"no XLA:GPU compiler here: {reason}")
    out = run(args.config, args.seq_len, args.target, args.optimizer, args.masters)
    print(json.dumps(out, indent=1))
    if not args.no_save:
        os.makedirs(RESULTS, exist_ok=True)
        name = "8b" if args.config == "llama3_1_8b" else args.config
        path = os.path.join(RESULTS, f"full_ft_offload_{name}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
