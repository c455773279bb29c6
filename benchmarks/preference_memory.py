"""Preference fine-tuning memory: a QLoRA DPO step with chunked log-probs against dense logits,
and the reference computed in the step (adapters off) against precomputed once.

Each row is a ``jmem.train_step`` (QLoRA: NF4 base, bfloat16 compute, LoRA on every
projection, 8-bit AdamW, full remat, ``has_aux``) over a batch of pairs, chosen and rejected
answers as rows of one batch, compiled from ``jax.ShapeDtypeStruct``s (nothing allocated)
and measured with ``jmem.measure`` (``step.measure``: XLA's temp / peak bytes, CPU backend):

- ``chunked``: ``jmem.ops.sequence_logprobs`` with ``loss_chunk`` tokens per chunk;
- ``dense``: ``loss_chunk=0``: float32 ``[2B * S, V]`` logits at once (what a
  log-softmax-gather over ``model(...).logits`` holds);
- ``precomputed``: the chunked step reading the reference log-probs from the batch, plus
  the one-off program that computes them (``jmem.losses.precompute_reference``).

Configs: ``small`` (2 layers, hidden 256, vocabulary 32,000, 2 pairs x 1,024 tokens per
answer; compiles in seconds) and, with ``--8b``, Llama-3.1-8B shapes, LoRA r=16, 2 pairs x
4,096 tokens per answer (compiles in minutes on 2 cores). Prints a table and writes
``benchmarks/results/preference_memory.json``.

    python benchmarks/preference_memory.py          # small
    python benchmarks/preference_memory.py --8b     # small and Llama-3.1-8B
    JAX_PLATFORMS=cpu python benchmarks/preference_memory.py --8b-only --target h100_sxm
        # Llama-3.1-8B, XLA:GPU compile for h100_sxm (no GPU):
        # benchmarks/results/preference_memory_8b_h100.json

Liger Kernel's published figure (theirs, not measured here): ORPO loss memory 15.9 GB
chunked against 62.5 GB for the PyTorch loss, batch 16, 4,096 tokens, vocabulary 128k, on
an A100 (Liger Kernel README / arXiv:2410.10989); it counts the loss only, these rows the
whole compiled step.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp

import jmem
from jmem.models import llama
from jmem.models import preference

CONFIGS = {
    "small": dict(
        model=llama.LlamaConfig(
            vocab_size=32000,
            hidden_size=256,
            intermediate_size=688,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            max_seq_len=8192,
        ),
        pairs=2,
        seq=1024,
        rank=8,
        chunk=256,
    ),
    "llama3_1_8b": dict(
        model=llama.get_config("llama3_1_8b"), pairs=2, seq=4096, rank=16, chunk=2048
    ),
}


def _abstract_qlora(cfg: llama.LlamaConfig, rank: int):
    frozen = jax.eval_shape(
        lambda: jmem.qlora.quantize_params(llama.abstract_params(cfg, jnp.bfloat16))
    )
    targets = r"layers/.*_proj/kernel"
    adapters = jax.eval_shape(
        lambda k: jmem.lora.init(k, frozen, rank=rank, alpha=2 * rank, modules=targets),
        jax.random.key(0),
    )
    return frozen, adapters


def _batch(pairs: int, seq: int, precomputed: bool) -> dict:
    tokens = jax.ShapeDtypeStruct((pairs, 2, seq), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens, "completion_mask": tokens}
    if precomputed:
        batch["ref_logps"] = jax.ShapeDtypeStruct((pairs, 2), jnp.float32)
    return batch


def measure_step(name: str, variant: str, target: str | None = None) -> dict:
    """Compiles one DPO step of ``CONFIGS[name]`` for ``target`` (a ``jmem.targets`` name;
    None: the running backend) and returns its bytes."""
    spec = CONFIGS[name]
    chunk = 0 if variant == "dense" else spec["chunk"]
    cfg = llama.get_config(spec["model"])
    rows = (2 * spec["pairs"], spec["seq"])  # chosen and rejected: one forward pass
    levers = jmem.resolve_levers(
        jmem.Levers(loss_chunk=chunk, remat="full"), cfg, rows, target, dtype=jnp.bfloat16
    )
    fn = functools.partial(preference.sequence_logprobs, config=cfg, levers=levers)
    reference = "precomputed" if variant == "precomputed" else "adapters_off"
    loss = jmem.losses.preference_loss(fn, "dpo", reference=reference, beta=0.1)
    step = jmem.train_step(
        loss,
        jmem.adamw_8bit(5e-5, mask=jmem.decay_mask),
        precision="p=bf16,c=bf16,o=f32",
        levers=levers,
        has_aux=True,
    )
    frozen, adapters = _abstract_qlora(cfg, spec["rank"])
    state = step.abstract_state(adapters, frozen=frozen)
    t0 = time.time()
    batch = _batch(spec["pairs"], spec["seq"], variant == "precomputed")
    report = step.measure(state, batch, target=target)
    row = {
        "config": name,
        "variant": variant,
        "target": report.target,
        "attention": levers.attention,
        "pairs": spec["pairs"],
        "tokens_per_answer": spec["seq"],
        "vocab": cfg.vocab_size,
        "loss_chunk": chunk,
        "temp_bytes": report.temp_bytes,
        "peak_bytes": report.peak_bytes,
        "argument_bytes": report.argument_bytes,
        "compile_s": round(time.time() - t0, 1),
    }
    if variant == "precomputed":
        pre = jax.jit(lambda q, b: jmem.losses.precompute_reference(fn, q, b))
        once = jmem.measure(pre, frozen, _batch(spec["pairs"], spec["seq"], False), target=target)
        row["precompute_temp_bytes"] = once.temp_bytes
        row["precompute_peak_bytes"] = once.peak_bytes
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--8b", dest="big", action="store_true", help="add Llama-3.1-8B")
    parser.add_argument(
        "--target",
        default=None,
        help="compile for this jmem.targets name (h100_sxm: XLA:GPU's deviceless compile, "
        "no GPU; pip install 'jmem[gpu-plan]', run with JAX_PLATFORMS=cpu); unset: this machine",
    )
    parser.add_argument("--8b-only", dest="big_only", action="store_true", help="skip small")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.target:
        reason = jmem.targets.unavailable_reason(args.target)
        if reason:
            parser.error(f"--target {args.target}: {reason}")
    rows = []
    if not args.big_only:
        rows += [measure_step("small", v, args.target) for v in ("chunked", "dense", "precomputed")]
    if args.big or args.big_only:
        rows += [measure_step("llama3_1_8b", v, args.target) for v in ("chunked", "dense")]
    fmt = jmem.MemoryReport.format_bytes
    print(f"{'config':<12} {'variant':<12} {'temp':>12} {'peak':>12} {'compile':>8}")
    for r in rows:
        print(
            f"{r['config']:<12} {r['variant']:<12} {fmt(r['temp_bytes']):>12} "
            f"{fmt(r['peak_bytes']):>12} {r['compile_s']:>7.0f}s"
        )
        if "precompute_temp_bytes" in r:
            print(f"{'':<12} {'(precompute)':<12} {fmt(r['precompute_temp_bytes']):>12}")
    os.makedirs(args.out, exist_ok=True)
    target = args.target or "this machine"
    record = {
        "backend": jax.default_backend(),
        "target": target,
        "compiler": "XLA:GPU compile for h100_sxm, no GPU"
        if args.target == "h100_sxm"
        else f"compile for {target}",
        "jax": jax.__version__,
        "rows": rows,
        "liger_published": {
            "what": "ORPO loss memory, chunked vs PyTorch, batch 16, 4096 tokens, 128k vocab, "
            "A100 (Liger Kernel README; theirs, not measured here)",
            "chunked_gb": 15.9,
            "dense_gb": 62.5,
        },
    }
    name = "preference_memory"
    if args.big_only:
        name += "_8b"
    if args.target:
        name += "_" + args.target.split("_")[0]
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
