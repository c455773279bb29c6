"""Long context on a CPU: the dense paths against the memory-efficient ones.

Contenders on a Llama-shaped model (hidden 512, 4 layers, 8 heads of 64, 2 KV heads, MLP
1376, vocabulary 32,000; batch 1; full remat; float32), each a ``LlamaConfig``:

- ``dense``: ``attention="dense"``, ``loss_chunk=0``, ``mlp_chunk=0`` (no chunks:
  float32 ``[nH, S, S]`` scores and ``[S, V]`` logits);
- ``long``: ``attention="blockwise"``, ``loss_chunk=2048``, ``mlp_chunk=4096`` (each
  layer's token-local parts in 4,096-token chunks; the job's default is 2,048).

For each sequence length: temp and peak bytes of the compiled gradient step
(``jmem.measure``, compile-only) and, up to ``--time-max-seq``, the median step time, the
contenders alternated run by run in one process so that load hits them alike. Prints a
table and writes ``benchmarks/results/long_context.json``.

    python benchmarks/long_context.py                       # memory at 4k, 8k, 16k; time at 4k
    python benchmarks/long_context.py --time-max-seq 16384 --reps 5

Step times taken on a shared, loaded machine are not valid figures: re-take them on idle
cores (or a GPU: ``benchmarks/long_context_gpu.sh``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

import jmem
from jmem.models import llama

CONTENDERS = {
    "dense": jmem.Levers(attention="dense", loss_chunk=0, token_chunk=0),
    "long": jmem.Levers(attention="blockwise", loss_chunk=2048, token_chunk=4096),
}

MODEL = llama.LlamaConfig(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1376,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    max_seq_len=1 << 17,
)


def grad_step(levers):
    loss = jmem.remat(lambda p, b: llama.loss_fn(p, b, MODEL, levers=levers), "full")
    return jax.jit(jax.value_and_grad(loss))


def batch(seq: int, abstract: bool):
    if abstract:
        return {k: jax.ShapeDtypeStruct((1, seq), jnp.int32) for k in ("inputs", "targets")}
    tokens = jax.random.randint(jax.random.key(0), (1, seq + 1), 0, MODEL.vocab_size, jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def memory_row(seq: int) -> dict:
    row = {}
    for name in CONTENDERS:
        lv = CONTENDERS[name]
        report = jmem.measure(grad_step(lv), llama.abstract_params(MODEL), batch(seq, True))
        row[name] = {"temp_bytes": report.temp_bytes, "peak_bytes": report.peak_bytes}
    return row


def time_row(seq: int, reps: int) -> dict:
    """Median seconds per step, contenders alternated (one warm-up each)."""
    runs = {}
    for name in CONTENDERS:
        params = llama.init(jax.random.key(0), MODEL)
        step = grad_step(CONTENDERS[name])
        jax.block_until_ready(step(params, batch(seq, False)))
        runs[name] = (step, params, [])
    for _ in range(reps):
        for step, params, times in runs.values():
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, batch(seq, False)))
            times.append(time.perf_counter() - t0)
    return {name: statistics.median(times) for name, (_, _, times) in runs.items()}


def main(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="4096,8192,16384", help="comma list of sequence lengths")
    p.add_argument("--time-max-seq", type=int, default=4096, help="time steps up to this length")
    p.add_argument("--reps", type=int, default=3, help="timed steps per contender")
    p.add_argument("--out", default="benchmarks/results/long_context.json")
    p.add_argument(
        "--config", default=None, help="a llama.CONFIGS preset instead of the model above"
    )
    args = p.parse_args(argv)
    global MODEL
    if args.config is not None:
        MODEL = llama.CONFIGS[args.config]
    load_at_start = os.getloadavg()
    rows = []
    print(f"{'seq':>7} {'contender':>9} {'temp MiB':>10} {'peak MiB':>10} {'step s':>8}")
    for seq in (int(s) for s in args.seqs.split(",")):
        mem = memory_row(seq)
        times = time_row(seq, args.reps) if seq <= args.time_max_seq else {}
        for name in CONTENDERS:
            m = mem[name]
            t = times.get(name)
            rows.append({"seq_len": seq, "contender": name, **m, "step_seconds": t})
            print(
                f"{seq:>7} {name:>9} {m['temp_bytes'] / 2**20:>10.1f} "
                f"{m['peak_bytes'] / 2**20:>10.1f} {'' if t is None else f'{t:.2f}':>8}"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "model": dataclasses.asdict(MODEL),
                "levers": {k: dataclasses.asdict(v) for k, v in CONTENDERS.items()},
                "backend": jax.default_backend(),
                "cpu": platform.processor() or platform.machine(),
                "load_avg_at_start": load_at_start,
                "note": "step times are valid only when the machine was idle (load_avg_at_start)",
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
