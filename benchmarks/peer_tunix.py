"""QLoRA step speed and compiled memory: jmem vs Tunix + qwix, alternated in one process.

The same training step on both sides, with the same shapes (default: the ``tiny`` Llama,
hidden 256, intermediate 688, 4 layers, 8 heads / 4 KV heads, head dim 32, vocab 256;
batch 16 x seq 128), both in JAX, both compiled once with ``jax.jit`` (state donated):

* jmem: the fine-tuning job's step builder (``jmem._src.finetune.build.build`` with
  ``optimizer="adamw"``: ``clip_by_global_norm(1.0)`` + float32 ``optax.adamw``, the job's
  warmup-cosine schedule, precision ``p=f32,c=<dtype>``, through ``jmem.train_step``), its
  state built from the public API: NF4 base *without* double quantization
  (``jmem.qlora.quantize_params(..., double_quant=False)``, blocks of 64), LoRA r=8
  alpha=16 on the seven projections (``jmem.lora.init``, float32 adapters). The job itself
  always double-quantizes and defaults to 8-bit AdamW (``benchmarks/peer_qlora.py``); the
  comparison with Tunix is at NF4 without double quantization and float32 Adam on both
  sides, which is what runs here.
* Tunix: ``tunix.models.llama3.model.Llama3`` built with the same config (its
  ``ModelConfig``: embed 256, hidden 688, 4 layers, 8 / 4 heads, head dim 32, vocab 256,
  same norm eps, untied head), weights redrawn normal(0, 0.02) as jmem's ``llama.init``
  (Tunix initializes its MLP kernels to zero), cast to the compute dtype; QLoRA by
  ``qwix.apply_lora_to_model`` with ``qwix.LoraProvider`` rules on the seven projections:
  ``weight_qtype="nf4"`` (4-bit NormalFloat codes stored as ``uint4``, one absmax scale
  per tile in the weight's dtype, no double quantization: qwix 0.1.8 has no option for it),
  LoRA r=8 alpha=16. qwix tiles along the weight's
  innermost *contraction* axis, which the tile must divide: tiles of 64 for q/k/v/gate/up
  (contraction 256), 32 for o_proj (its innermost contraction axis is the head dim), 43
  for down_proj (688 = 16 x 43); jmem's blocks are 64 consecutive elements of the
  row-major ``[in, out]`` kernel. The step is Tunix's ``PeftTrainer._train_step`` made
  functional: the LoRA params (``nnx.LoRAParam``, float32 master copies, cast to the
  compute dtype inside the loss as jmem's precision policy does) are split from the model
  with ``nnx.split``, ``jax.value_and_grad`` of the loss, then the same optax chain and
  schedule as jmem's side. Remat per layer: ``ModelConfig(remat_config=RematConfig.DECODER)``
  (``nnx.remat`` of each decoder layer); ``--remat none``: ``RematConfig.NONE``.

Both compute the mean next-token cross-entropy of the same ``[B, S]`` token batch (inputs
``tokens[:, :-1]``, targets ``tokens[:, 1:]``, logits cast to float32, causal mask). What
differs, besides the tiling above: jmem scans its stacked layers (``lax.scan``), Tunix
unrolls a Python loop over layer modules; Tunix's attention is its own
(``einsum('BTHGD,BSHD->BHGTS')``, ``where`` mask, float32 softmax), and its RoPE always
uses theta 1e6 (``apply_rope``'s default; ``ModelConfig.rope_theta`` is not passed on),
jmem the config's 1e4; Tunix's logits leave the head in the compute dtype before the
float32 cast (jmem's head accumulates in float32); jmem's step also skips an update whose
gradients are not finite (a ``cond``) and tracks a step counter. Both sides start from
random weights of the same distribution but different draws, so first losses agree only
roughly (both ~ln(vocab)).

Rounds alternate the contenders (as ``benchmarks/peer_qlora.py``): each runs ``--steps``
steps after one untimed step; the figure is the median step time over all rounds, the
ratio jmem tok/s over Tunix tok/s (> 1: jmem faster), with per-round ratios to show the
spread. Also the compiled memory of each step (``memory_analysis()``: temp, argument,
output and aliased bytes; peak = argument + output - alias + temp). Settings: ``--remat
layer,none`` (per-layer remat on both sides, none on either) x ``--dtypes
float32,bfloat16``. Prints a markdown table and writes ``benchmarks/results/peer_tunix.json``
(versions, CPU model and flags, load average, commit).

Needs the ``tunix`` extra (``pip install -e ".[tunix]"``: google-tunix, qwix), which pins
the versions this script was written against.

Run: ``python benchmarks/peer_tunix.py [--quick] [--rounds 7] [--steps 6] [--batch 16]
[--seq 128] [--dtypes float32,bfloat16] [--remat layer,none] [--config tiny]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from peer_qlora import DTYPES  # benchmarks/peer_qlora.py (this script's folder)
from peer_qlora import HOST_ALLOCATOR_HELP
from peer_qlora import HOST_ALLOCATORS
from peer_qlora import TARGETS
from peer_qlora import JmemStep
from peer_qlora import _batch
from peer_qlora import _commit
from peer_qlora import _time_block
from peer_qlora import cpu_info
from peer_qlora import host_allocator

import jmem
from jmem import qlora
from jmem._src.finetune.build import build
from jmem._src.finetune.config import FinetuneConfig
from jmem.models import llama

try:
    import qwix
    from flax import nnx
    from tunix.models.llama3 import model as tunix_llama
except ImportError as e:  # the optional extra
    qwix = nnx = tunix_llama = None
    TUNIX_MISSING = f"{type(e).__name__}: {e}"
else:
    TUNIX_MISSING = None

EXTRA_HINT = 'install the extra: pip install -e ".[tunix]" (google-tunix and qwix)'
#: ``--remat`` settings: (jmem's policy, Tunix's ``RematConfig`` name).
REMAT = {"layer": ("full", "DECODER"), "none": ("none", "NONE")}
TILE = 64  # jmem's NF4 block size; qwix's tile is the divisor of the axis closest to it


class JmemEqualStep(JmemStep):
    """jmem's QLoRA step at the Tunix side's settings: the job's step builder with float32
    AdamW, the NF4 base quantized without double quantization (public API)."""

    def __init__(self, cfg, dtype: str, tokens: np.ndarray, *, rank=8, lr=1e-3, remat="full"):
        dt = DTYPES[dtype]
        config = FinetuneConfig.from_flat(
            steps=100,
            lr=lr,
            lora_rank=rank,
            lora_alpha=2.0 * rank,
            lora_targets=TARGETS,
            remat=remat,
            optimizer="adamw",
        )
        step, _, _, self.schedule = build(config, cfg, compute_dtype=dt)
        make = lambda k: qlora.quantize_params(llama.init(k, cfg, dt), double_quant=False)
        frozen = jax.jit(make)(jax.random.key(config.run.seed))
        adapters = jmem.lora.init(
            jax.random.key(config.run.seed + 1),
            frozen,
            rank=rank,
            alpha=2.0 * rank,
            modules=TARGETS,
        )
        self._compile(step, step.init(adapters, frozen=frozen), tokens)


def qwix_tile(n: int, target: int = TILE) -> int:
    """The divisor of ``n`` closest to ``target`` (the smaller on a tie): qwix's
    ``tile_size`` must divide the contraction axis it tiles."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), d))


def lora_provider(cfg, rank: int):
    """A ``qwix.LoraProvider``: NF4 weights and LoRA r=``rank`` on the seven projections, one
    rule per distinct tile size (see the module docstring)."""
    contraction = {  # the innermost contraction axis of each Tunix projection's weight
        "q_proj|k_proj|v_proj|gate_proj|up_proj": cfg.hidden_size,
        "o_proj": cfg.head_dim,
        "down_proj": cfg.intermediate_size,
    }
    by_tile = {}
    for names, n in contraction.items():
        by_tile.setdefault(qwix_tile(n), []).append(names)
    rules = [
        qwix.LoraRule(
            module_path=f".*({'|'.join(names)})",
            rank=rank,
            alpha=2.0 * rank,
            weight_qtype="nf4",
            tile_size=tile,
        )
        for tile, names in by_tile.items()
    ]
    return qwix.LoraProvider(rules), {"|".join(v): k for k, v in by_tile.items()}


def tunix_model(cfg, dt, remat: str, seq: int, rank: int):
    """Tunix's Llama 3 at ``cfg``'s shape, weights normal(0, 0.02) in ``dt``, QLoRA by qwix
    (LoRA rank ``rank``); ``remat`` names a ``RematConfig``, ``seq`` the sequence length of
    the call that creates the NF4 weights and the adapters. Returns the model and the tiles."""
    mc = tunix_llama.ModelConfig(
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta,
        norm_eps=cfg.rms_norm_eps,
        weight_tying=cfg.tie_embeddings,
        remat_config=tunix_llama.RematConfig[remat],
    )
    model = tunix_llama.Llama3(mc, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    redraw = lambda k, x: 0.02 * jax.random.normal(k, x.shape) if x.ndim > 1 else x
    leaves = [redraw(k, x).astype(dt) for k, x in zip(keys, leaves)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    provider, tiles = lora_provider(cfg, rank)
    tokens, positions, mask = _tunix_inputs(jnp.zeros((1, seq), jnp.int32))
    model = qwix.apply_lora_to_model(
        model, provider, tokens, positions, None, mask, rngs=nnx.Rngs(1)
    )
    return model, tiles


def _tunix_inputs(tokens):
    """Positions ``[B, S]`` and the causal mask ``[B, S, S]`` Tunix's model takes."""
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return tokens, positions, positions[:, :, None] >= positions[:, None, :]


class TunixStep:
    """Tunix ``Llama3`` + qwix NF4 QLoRA + optax, the ``PeftTrainer`` step made functional
    and compiled once with ``jax.jit`` (LoRA params and optimizer state donated)."""

    name = "tunix"

    def __init__(self, cfg, dtype: str, tokens: np.ndarray, schedule, *, rank=8, remat="DECODER"):
        dt = DTYPES[dtype]
        with warnings.catch_warnings():  # Tunix 0.1.7 and qwix 0.1.8 use APIs flax 0.12 deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            model, self.tiles = tunix_model(cfg, dt, remat, tokens.shape[1] - 1, rank)
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        lora = jax.tree.map(lambda x: x.astype(jnp.float32), lora)  # float32 master copies
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))

        def loss_fn(lora, rest, batch):
            # Variables born in this trace: nnx.remat updates the model's in place.
            lora, rest = jax.tree.map(lambda x: x.astype(dt), lora), jax.tree.map(jnp.asarray, rest)
            model = nnx.merge(graphdef, lora, rest)
            tokens, positions, mask = _tunix_inputs(batch["inputs"])
            logits, _ = model(tokens, positions, None, mask)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["targets"]
            ).mean()

        def step(state, rest, batch):
            lora, opt_state = state
            loss, grads = jax.value_and_grad(loss_fn)(lora, rest, batch)
            updates, opt_state = tx.update(grads, opt_state, lora)
            return (optax.apply_updates(lora, updates), opt_state), loss

        self.state = (lora, tx.init(lora))
        self.rest = rest
        self.batch = {
            "inputs": jnp.asarray(tokens[:, :-1]),
            "targets": jnp.asarray(tokens[:, 1:]),
        }
        t0 = time.perf_counter()
        jitted = jax.jit(step, donate_argnums=(0,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.compiled = jitted.lower(self.state, self.rest, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        self.device = jax.devices()[0].device_kind
        cls = next(c for c in type(model).__mro__ if c.__module__.startswith("tunix."))
        self.model_class = f"{cls.__module__}.{cls.__qualname__}"  # qwix wraps it in a subclass

    def __call__(self) -> float:
        self.state, loss = self.compiled(self.state, self.rest, self.batch)
        return float(loss)


def compiled_memory(compiled) -> dict:
    """Bytes of a compiled step (``memory_analysis()``): temp, argument, output, alias and
    the peak they imply (argument + output - alias + temp)."""
    m = compiled.memory_analysis()
    out = {
        k: int(getattr(m, f"{k}_size_in_bytes", 0)) for k in ("temp", "argument", "output", "alias")
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def versions() -> dict:
    """Versions of the packages on both sides."""
    out = {}
    for dist in ("jax", "jaxlib", "flax", "optax", "qwix", "google-tunix"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def compare(cfg, dtype: str, remat: str, args) -> dict:
    """Builds both steps for ``dtype`` and ``remat`` (a ``REMAT`` key), warms them up and
    times them in alternated rounds; also their compiled memory and first losses."""
    tokens = _batch(cfg, args.batch, args.seq)
    jmem_remat, tunix_remat = REMAT[remat]
    jmem_step = JmemEqualStep(cfg, dtype, tokens, remat=jmem_remat)
    runs = [jmem_step, TunixStep(cfg, dtype, tokens, jmem_step.schedule, remat=tunix_remat)]
    memory = {r.name: compiled_memory(r.compiled) for r in runs}
    first_loss = {r.name: r() for r in runs}  # also warms up
    for _ in range(args.warmup):
        for r in runs:
            r()
    times = {r.name: [] for r in runs}
    per_round = []
    for i in range(args.rounds):
        med = {}
        for r in runs if i % 2 == 0 else runs[::-1]:
            t = _time_block(r, args.steps)
            times[r.name] += t
            med[r.name] = statistics.median(t)
        per_round.append(med["tunix"] / med["jmem"])
    tps = {k: args.batch * args.seq / statistics.median(v) for k, v in times.items()}
    return {
        "remat": remat,
        "dtype": dtype,
        "first_loss": first_loss,
        "ln_vocab": math.log(cfg.vocab_size),
        "compile_s": {r.name: r.compile_s for r in runs},
        "memory_bytes": memory,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "tok_per_s": tps,
        "ratio": tps["jmem"] / tps["tunix"],
        "round_ratios": per_round,
        "step_times_s": times,
        "tunix_model": runs[1].model_class,
        "qwix_nf4_tiles": runs[1].tiles,
    }


def table(rows, args) -> str:
    """The markdown table of ``compare``'s rows."""
    mib = lambda b: f"{b / 2**20:,.1f}"
    lines = [
        f"QLoRA step, {args.config} Llama, batch {args.batch} x seq {args.seq}, NF4 (no double "
        "quant), LoRA r=8 x 7 projections, float32 AdamW; "
        f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs; medians of {args.rounds} "
        f"alternated rounds x {args.steps} steps; first losses of random-init models on "
        f"random tokens, ln(vocab) = {rows[0]['ln_vocab']:.3f}",
        "",
        "| remat | compute dtype | jmem tok/s | Tunix tok/s | jmem / Tunix | per-round ratios "
        "| temp MiB jmem / Tunix | argument MiB jmem / Tunix | first loss jmem / Tunix |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        tps, mem, fl = r["tok_per_s"], r["memory_bytes"], r["first_loss"]
        lines.append(
            f"| {r['remat']} | {r['dtype']} | {tps['jmem']:,.0f} | {tps['tunix']:,.0f} | "
            f"{r['ratio']:.2f} | {' '.join(f'{x:.2f}' for x in r['round_ratios'])} | "
            f"{mib(mem['jmem']['temp'])} / {mib(mem['tunix']['temp'])} | "
            f"{mib(mem['jmem']['argument'])} / {mib(mem['tunix']['argument'])} | "
            f"{fl['jmem']:.3f} / {fl['tunix']:.3f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    """The command line; ``--quick`` is 2 rounds x 3 steps and 1 warm-up step."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(llama.CONFIGS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument(
        "--remat",
        default="layer,none",
        help="comma-separated: layer (per-layer remat on "
        "both sides), none (no remat on either side)",
    )
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per contender per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    ap.add_argument("--quick", action="store_true", help="2 rounds x 3 steps, 1 warm-up step")
    ap.add_argument(
        "--host-allocator", choices=HOST_ALLOCATORS, default="huge-pages", help=HOST_ALLOCATOR_HELP
    )
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "peer_tunix.json")
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 1
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.remat = [r.strip() for r in args.remat.split(",") if r.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES] + [r for r in args.remat if r not in REMAT]
    if bad or not args.dtypes or not args.remat:
        ap.error(
            f"unknown or missing --dtypes/--remat value(s) {bad}; dtypes: {sorted(DTYPES)}, "
            f"remat: {sorted(REMAT)}"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    if TUNIX_MISSING is not None:
        sys.exit(f"peer_tunix.py needs Tunix and qwix ({TUNIX_MISSING}); {EXTRA_HINT}")
    applied = host_allocator(args.host_allocator, restart=argv is None)
    cfg = llama.get_config(args.config)
    rows = [compare(cfg, d, r, args) for r in args.remat for d in args.dtypes]
    print("\n" + table(rows, args))
    meta = {
        "config": args.config,
        "model": {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_layers")},
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "host_allocator": args.host_allocator,
        "host_allocator_applied": applied,
        "backend": jax.devices()[0].platform,
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "machine": platform.machine(),
        **cpu_info(),
        "versions": versions(),
        "jmem_commit": _commit(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=2)
    print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main()  # argv None: the command line, which huge pages may restart
