"""QLoRA fine-tuning of a Llama-2-7B-shaped model with every jmem memory lever on.

    python examples/qlora_7b.py                       # CPU: trains `tiny` on real text
    python examples/qlora_7b.py --config llama2_7b --dry-run --seq-len 2048 --batch-size 1
    python examples/qlora_7b.py --checkpoint /path/to/Llama-2-7b-hf   # GPU, real weights

Levers: frozen base in NF4 with double quantization (jmem.nf4 / jmem.qlora), LoRA adapters
as their own pytree (jmem.lora), activation remat per layer (jmem.remat), bf16 compute
(fp16 with dynamic loss scaling by flag), 8-bit AdamW states (jmem.adamw_8bit), gradient
accumulation, optional host offload of the optimizer state — composed by jmem.train_step.

Default config: `llama2_7b` when a GPU is present, `tiny` on CPU. `--dry-run` compiles the
step from abstract shapes (nothing is allocated) and prints the compiled memory next to
the planner's estimate. A run writes a loss curve PNG, `summary.json` and orbax
checkpoints (every `--save-every` steps, last `--keep`) under `--out`; `--resume` continues
exactly where the last checkpoint left off.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmem
from jmem import Checkpointer
from jmem import DynamicLossScale
from jmem import NoOpLossScale
from jmem import adamw_4bit
from jmem import adamw_8bit
from jmem import data as jdata
from jmem import lora as jlora
from jmem import nf4
from jmem import planner
from jmem import qlora
from jmem._src.measure import format_bytes
from jmem._src.measure import report_from_compiled
from jmem.models import hf
from jmem.models import llama

OPTIMIZERS = {"adamw_8bit": adamw_8bit, "adamw_4bit": adamw_4bit, "adamw": optax.adamw}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--config",
        default=None,
        choices=sorted(llama.CONFIGS),
        help="model shape; unset: llama2_7b on GPU, tiny on CPU",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="Hugging Face checkpoint directory (config.json + *.safetensors)",
    )
    p.add_argument(
        "--data", default=None, help=".txt or .jsonl (text field); default: pydoc_data.topics"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps; unset: 200 for tiny, 20 otherwise"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per step; unset: 16 for tiny, 1 otherwise",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence; unset: 128 for tiny, 2048 otherwise",
    )
    p.add_argument("--grad-accum", type=int, default=1, help="microbatches per step")
    p.add_argument(
        "--remat", default="full", choices=list(jmem.REMAT_POLICIES), help="remat policy"
    )
    p.add_argument(
        "--optimizer", default="adamw_8bit", choices=sorted(OPTIMIZERS), help="optimizer"
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate; unset: 3e-3 for tiny, 2e-4 otherwise",
    )
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha; unset: 2 * rank")
    p.add_argument(
        "--lora-targets",
        default=r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*",
        help="regex over weight paths (e.g. '.*(q_proj|v_proj).*' as in the QLoRA seed table)",
    )
    p.add_argument(
        "--precision",
        default="bf16",
        choices=["bf16", "fp16"],
        help="compute dtype; fp16 turns on dynamic loss scaling",
    )
    p.add_argument("--offload", action="store_true", help="optimizer state in pinned_host memory")
    p.add_argument("--out", default="runs/qlora_7b", help="output directory")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --out"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dry-run", action="store_true", help="compile only; print memory report and estimate"
    )
    p.add_argument(
        "--no-progress", action="store_true", help="plain log lines instead of a progress bar"
    )
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if args.config is None and args.checkpoint is None:
        args.config = "llama2_7b" if on_gpu else "tiny"
        if not on_gpu:
            print(
                "No GPU found: training the `tiny` config on CPU "
                "(use --config llama2_7b --dry-run to plan the 7B run).",
                flush=True,
            )
    small = args.config == "tiny"
    args.steps = args.steps if args.steps is not None else (200 if small else 20)
    args.batch_size = args.batch_size or (16 if small else 1)
    args.seq_len = args.seq_len or (128 if small else 2048)
    args.lr = args.lr if args.lr is not None else (3e-3 if small else 2e-4)
    args.lora_alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    if args.batch_size % args.grad_accum:
        p.error(
            f"--batch-size {args.batch_size} must be divisible by --grad-accum {args.grad_accum}"
        )
    return args


def build(args, cfg):
    """The train step and the loss; shared by training and the dry run."""
    dtype = jnp.float16 if args.precision == "fp16" else jnp.bfloat16

    def loss_fn(adapters, batch, *, frozen):
        return qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg))(frozen, adapters, batch)

    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        args.lr,
        warmup_steps=max(1, args.steps // 20),
        decay_steps=max(2, args.steps),
        end_value=args.lr / 10,
    )
    opt = OPTIMIZERS[args.optimizer](schedule, weight_decay=0.0)
    opt = optax.chain(optax.clip_by_global_norm(1.0), opt)
    scale = DynamicLossScale(2.0**15, period=500) if dtype == jnp.float16 else NoOpLossScale()
    step = jmem.train_step(
        loss_fn,
        opt,
        precision=f"p=f32,c={jnp.dtype(dtype).name},o=f32",
        loss_scale=scale,
        remat=args.remat,
        microbatches=args.grad_accum,
        offload_optimizer=args.offload,
    )
    return step, dtype


def quantized_base(args, cfg, dtype, abstract: bool):
    """NF4 base params: from a checkpoint, or random (quantized on the device, in one jit)."""
    if args.checkpoint:
        if abstract:
            return jax.eval_shape(lambda: qlora.quantize_params(llama.abstract_params(cfg, dtype)))
        params, _ = hf.load_params(args.checkpoint, cfg, dtype=dtype, quantize="nf4")
        return params
    make = lambda k: qlora.quantize_params(llama.init(k, cfg, dtype))
    if abstract:
        return jax.eval_shape(make, jax.random.key(args.seed))
    return jax.jit(make)(jax.random.key(args.seed))


def base_bytes(frozen) -> tuple[int, int, int]:
    """(bytes of NF4 leaves, their parameter count, bytes of all frozen leaves)."""
    q = [
        x
        for x in jax.tree.leaves(frozen, is_leaf=lambda x: isinstance(x, nf4.NF4Array))
        if isinstance(x, nf4.NF4Array)
    ]
    nbytes = sum(jmem.tree.nbytes(x) for x in q)
    count = sum(math.prod(x.shape) for x in q)
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(frozen))
    return nbytes, count, total


def dry_run(args, cfg):
    step, dtype = build(args, cfg)
    frozen = quantized_base(args, cfg, dtype, abstract=True)
    adapters = jax.eval_shape(
        lambda k: jlora.init(
            k, frozen, rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets
        ),
        jax.random.key(0),
    )
    state = step.abstract_state(adapters, frozen=frozen)
    batch = {
        k: jax.ShapeDtypeStruct((args.batch_size, args.seq_len), jnp.int32)
        for k in ("inputs", "targets")
    }
    t0 = time.time()
    report = step.measure(state, batch)
    q_bytes, q_count, frozen_bytes = base_bytes(frozen)
    targets = [n for n in llama.LINEAR_NAMES if any(n in k for k in adapters)]
    est = planner.estimate(
        cfg,
        param_dtype=jnp.dtype(dtype).name,
        optimizer=args.optimizer,
        lora={"rank": args.lora_rank, "targets": targets},
        quantization="nf4",
        remat=args.remat,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
    )
    n_adapter = jlora.num_trainable(adapters)
    print(
        f"\n{args.config or 'checkpoint'}: {llama.num_params(cfg) / 1e9:.2f}B params, "
        f"LoRA r={args.lora_rank} on {targets}: {n_adapter / 1e6:.1f}M trainable; "
        f"compiled in {time.time() - t0:.0f}s (abstract shapes, nothing allocated)"
    )
    print(
        f"NF4 base: {format_bytes(q_bytes)} for {q_count / 1e9:.2f}B weights = "
        f"{q_bytes / q_count:.3f} bytes/param; all frozen leaves {format_bytes(frozen_bytes)}\n"
    )
    state_bytes = report.argument_bytes - sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)
    )
    rows = [
        (
            "params + state (arguments)",
            state_bytes,
            est.params + est.optimizer_state + est.master_weights,
        ),
        ("temporaries / grads+activations", report.temp_bytes, est.grads + est.activations),
        ("peak", report.peak_bytes, est.total),
    ]
    print(f"{'':34}{'compiled (jmem.measure)':>26}{'planner (estimate)':>26}")
    for name, a, b in rows:
        print(f"{name:34}{format_bytes(a):>26}{format_bytes(b):>26}")
    print(
        f"\nverdict: peak {format_bytes(report.peak_bytes)} "
        f"{'fits' if report.peak_bytes <= 24e9 else 'does not fit'} on a 24 GB card."
    )
    out = {
        "config": args.config,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "compiled": dataclasses_asdict(report),
        "estimate": est.as_dict(),
        "nf4_bytes_per_param": q_bytes / q_count,
        "trainable_params": n_adapter,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dry_run.json"), "w") as f:
        json.dump(out, f, indent=2)
    return out


def dataclasses_asdict(x):
    import dataclasses  # noqa: PLC0415

    return dataclasses.asdict(x)


#: Dense bf16 peak FLOP/s by device kind (vendor specs), for model FLOPs utilization.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def train_flops_per_token(cfg, seq_len: int, n_adapter: int) -> float:
    """Model FLOPs per trained token, excluding remat recomputation (the MFU convention of
    Chowdhery et al. 2022), for a frozen base: forward 2N plus input-gradient 2N over the
    base matmuls, 6 per adapter parameter, and attention 12 * L * H * S (scores and context,
    forward and backward; causal masking not discounted)."""
    n_matmul = llama.num_params(cfg) - (
        0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    )
    return 4.0 * n_matmul + 6.0 * n_adapter + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len


def peak_flops() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def device_memory() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def train(args, cfg):
    step, dtype = build(args, cfg)
    tok = jdata.HFTokenizer(args.checkpoint) if args.checkpoint else jdata.ByteTokenizer()
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"Tokenizer vocabulary {tok.vocab_size} exceeds the model's {cfg.vocab_size}."
        )
    ds = jdata.PackedDataset(
        tok.encode(jdata.load_text(args.data)), args.seq_len, args.batch_size, seed=args.seed
    )
    frozen = quantized_base(args, cfg, dtype, abstract=False)
    adapters = jlora.init(
        jax.random.key(args.seed + 1),
        frozen,
        rank=args.lora_rank,
        alpha=args.lora_alpha,
        targets=args.lora_targets,
    )
    state = step.init(adapters, frozen=frozen)
    ckpt = Checkpointer(
        os.path.join(os.path.abspath(args.out), "checkpoints"),
        save_every=args.save_every,
        keep=args.keep,
    )
    pos, losses = jdata.Position(), []
    if args.resume:
        state, meta = ckpt.restore(state)
        pos = jdata.Position.from_dict(meta["data"])
        losses = list(meta.get("losses", []))
        print(f"Resumed at step {int(state.step)} (data epoch {pos.epoch}, index {pos.index}).")
    start = int(state.step)
    if start >= args.steps:
        print(f"Nothing to do: the checkpoint is at step {start} >= --steps {args.steps}.")
    # Compile once; the same executable gives the memory report and runs every step.
    t0 = time.perf_counter()
    compiled = step.jitted.lower(state, ds.batch_at(pos)[0]).compile()
    compiled_peak = report_from_compiled(compiled).peak_bytes
    print(
        f"compiled the train step in {time.perf_counter() - t0:.1f}s; "
        f"compiled peak {format_bytes(compiled_peak)}",
        flush=True,
    )
    tokens_per_step = args.batch_size * args.seq_len
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(total=args.steps, initial=start, desc="qlora", dynamic_ncols=True)
    t_first, times, it = None, [], ds.iterate(pos)
    for s in range(start, args.steps):
        batch, next_pos = next(it)
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        loss = float(metrics["loss"])  # blocks until the step is done
        dt = time.perf_counter() - t0
        if t_first is None:
            t_first = dt  # first call: warm-up
        else:
            times.append(dt)
        losses.append(loss)
        pos = next_pos
        mem = device_memory() or compiled_peak
        tps = tokens_per_step / (np.median(times) if times else dt)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", mem=format_bytes(mem))
            bar.update(1)
        elif (s + 1) % 10 == 0 or s == start:
            print(
                f"step {s + 1:5d}  loss {loss:.4f}  {tps:,.0f} tok/s  mem {format_bytes(mem)}",
                flush=True,
            )
        ckpt.maybe_save(
            s + 1,
            state,
            {
                "data": pos.to_dict(),
                "losses": losses,
                "seed": args.seed,
                "args": {k: v for k, v in vars(args).items() if k != "resume"},
            },
        )
    if bar is not None:
        bar.close()
    if losses and args.steps > start and args.steps not in ckpt.all_steps():
        # Always keep the final state, whatever --save-every says.
        ckpt.save(
            args.steps,
            state,
            {
                "data": pos.to_dict(),
                "losses": losses,
                "seed": args.seed,
                "args": {k: v for k, v in vars(args).items() if k != "resume"},
            },
        )
    ckpt.close()
    summary = {
        "config": args.config,
        "steps": args.steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "tokens_per_s": tokens_per_step / float(np.median(times)) if times else None,
        "peak_bytes": device_memory() or compiled_peak,
        "peak_source": "device memory_stats" if device_memory() else "compiled (jmem.measure)",
        "trainable_params": jlora.num_trainable(adapters),
        "losses": losses,
        "device": jax.devices()[0].device_kind,
    }
    peak = peak_flops()
    if summary["tokens_per_s"] and peak:
        fpt = train_flops_per_token(cfg, args.seq_len, summary["trainable_params"])
        summary["mfu"] = summary["tokens_per_s"] * fpt / peak
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot_losses(losses, os.path.join(args.out, "loss.png"), f"QLoRA {args.config or 'checkpoint'}")
    if losses:
        print(
            f"\nfirst loss {losses[0]:.4f} -> last loss {losses[-1]:.4f} over {len(losses)} steps; "
            f"{summary['tokens_per_s'] or 0:,.0f} tokens/s; peak {format_bytes(summary['peak_bytes'])} "
            f"({summary['peak_source']}); curve: {os.path.join(args.out, 'loss.png')}"
            + (f"; MFU {summary['mfu']:.1%}" if "mfu" in summary else "")
        )
    return summary


def plot_losses(losses, path, title):
    if not losses:
        return
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(np.arange(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    cfg = hf.load_config(args.checkpoint) if args.checkpoint else llama.get_config(args.config)
    if args.dry_run:
        return dry_run(args, cfg)
    return train(args, cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
