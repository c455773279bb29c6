"""QLoRA step speed: jmem vs Hugging Face PEFT + bitsandbytes, alternated in one process.

The same training step on both sides, with the same shapes (default: the ``tiny`` Llama,
hidden 256, intermediate 688, 4 layers, 8 heads / 4 KV heads, vocab 256; batch 16 x seq
128):

* jmem: the step of the fine-tuning job (``jmem.finetune.build``, with the compute dtype
  chosen here so that float32 can be timed too; ``examples/qlora_7b.py`` runs it): NF4 base with double quantization
  (``qlora.quantize_params``), LoRA r=8 alpha=16 on all seven projections
  (``jmem.lora.init``), ``clip_by_global_norm(1.0)`` + ``jmem.adamw_8bit`` (the job's
  warmup-cosine schedule to ``lr``), remat of every
  layer (``remat="full"``), compute dtype ``--dtypes``, through ``jmem.train_step``;
  timed as the example's loop does: ``compiled(state, batch)`` then ``float(loss)``.
* peer: ``transformers.LlamaForCausalLM`` with the same config (SDPA attention), every
  projection a bitsandbytes ``Linear4bit`` (NF4, double quantization, compute dtype =
  the dtype), PEFT LoRA r=8 alpha=16 on the seven projections (adapters float32, as PEFT
  keeps them), gradient checkpointing per decoder layer (non-reentrant), gradient
  clipping to 1.0 and ``bnb.optim.AdamW8bit`` (8-bit states for tensors of >= 4096
  elements, as jmem's ``min_quantized_size``); ``loss.item()`` ends the step. The
  frozen non-quantized weights (embedding, norms, head) are kept in the dtype, as jmem
  keeps them; ``--peer-prepare`` calls PEFT's ``prepare_model_for_kbit_training``
  instead (norms, embedding and head upcast to float32, the usual QLoRA notebook recipe).

Both compute the mean next-token cross-entropy of the same ``[B, S]`` token batch (logits
in float32). Rounds alternate the contenders, each running ``--steps`` steps after one
untimed step (which absorbs the switch between the two runtimes' thread pools); the
figure is the median step time over all rounds, and the ratio is jmem tok/s over peer
tok/s (> 1: jmem faster). Per-round ratios are printed too, to show the spread.

On a GPU the jmem side runs on the GPU and the peer on CUDA when PyTorch has it
(``--skip-torch`` to time jmem only). Prints a table and writes
``benchmarks/results/peer_qlora.json``.

Run: ``python benchmarks/peer_qlora.py [--quick] [--rounds 7] [--steps 6] [--batch 16]
[--seq 128] [--dtypes float32,bfloat16] [--config tiny] [--skip-torch]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

# On a GPU both runtimes share the device: JAX must not reserve 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jmem import finetune  # noqa: E402
from jmem.models import llama  # noqa: E402

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _batch(cfg, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """``[batch, seq + 1]`` int32 tokens; inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq + 1), np.int32)


class JmemStep:
    """The QLoRA train step of the fine-tuning job (``jmem.finetune.build``), compiled once."""

    name = "jmem"

    def __init__(self, cfg, dtype: str, tokens: np.ndarray, *, rank=8, lr=1e-3, remat="full"):
        dt = DTYPES[dtype]
        config = finetune.FinetuneConfig(
            steps=100,
            lr=lr,
            lora_rank=rank,
            lora_alpha=2.0 * rank,
            lora_targets=TARGETS,
            remat=remat,
        )
        step, *_ = finetune.build(config, cfg, compute_dtype=dt)
        self.state = finetune.init_state(config, cfg, step, dt, None, None)[0]
        self.batch = {
            "inputs": jnp.asarray(tokens[:, :-1]),
            "targets": jnp.asarray(tokens[:, 1:]),
        }
        t0 = time.perf_counter()
        self.compiled = step.jitted.lower(self.state, self.batch).compile()
        self.compile_s = time.perf_counter() - t0
        self.device = jax.devices()[0].device_kind

    def __call__(self) -> float:
        self.state, metrics = self.compiled(self.state, self.batch)
        return float(metrics["loss"])


class PeerStep:
    """transformers Llama + bitsandbytes NF4 ``Linear4bit`` + PEFT LoRA + bnb AdamW8bit."""

    name = "peft+bnb"

    def __init__(self, cfg, dtype: str, tokens: np.ndarray, *, rank=8, lr=1e-3, prepare=False):
        import bitsandbytes as bnb  # noqa: PLC0415
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415
        from peft import LoraConfig  # noqa: PLC0415
        from peft import get_peft_model  # noqa: PLC0415
        from peft import prepare_model_for_kbit_training  # noqa: PLC0415

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        hf_cfg = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=max(cfg.max_seq_len, tokens.shape[1]),
            tie_word_embeddings=cfg.tie_embeddings,
        )
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as d:
            transformers.LlamaForCausalLM(hf_cfg).to(tdt).save_pretrained(d)
            qcfg = transformers.BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=tdt,
            )
            model = transformers.LlamaForCausalLM.from_pretrained(
                d, quantization_config=qcfg, dtype=tdt, device_map=dev
            )
        q = model.model.layers[0].self_attn.q_proj
        if not isinstance(q, bnb.nn.Linear4bit) or not q.weight.quant_state.nested:
            raise RuntimeError(f"expected NF4 double-quant Linear4bit, got {type(q).__name__}")
        if prepare:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model = get_peft_model(
            model,
            LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJ), lora_dropout=0.0),
        )
        model.train()
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = bnb.optim.AdamW8bit(self.params, lr=lr, weight_decay=0.0)
        self.inputs = torch.from_numpy(tokens[:, :-1].astype(np.int64)).to(dev)
        self.targets = torch.from_numpy(tokens[:, 1:].astype(np.int64)).to(dev)
        self.device = torch.cuda.get_device_name() if dev == "cuda" else platform.processor()
        self.compile_s = 0.0
        self.optimizer_name = "bitsandbytes.optim.AdamW8bit"
        self.attn = model.config._attn_implementation

    def __call__(self) -> float:
        torch = self.torch
        logits = self.model(input_ids=self.inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), self.targets.reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip() or None
    except OSError:
        return None


def _time_block(run, steps: int) -> list[float]:
    run()  # untimed: the other runtime's threads were busy a moment ago
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def compare(cfg, dtype: str, args) -> dict:
    """Builds both steps for ``dtype``, warms them up and times them in alternated rounds."""
    tokens = _batch(cfg, args.batch, args.seq)
    runs = [JmemStep(cfg, dtype, tokens, remat=args.remat)]
    peer_error = None
    if not args.skip_torch:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runs.append(PeerStep(cfg, dtype, tokens, prepare=args.peer_prepare))
        except Exception as e:  # noqa: BLE001 - report why the peer is missing, keep jmem's
            peer_error = f"{type(e).__name__}: {e}"
            print(f"peer not run for {dtype}: {peer_error}", file=sys.stderr)
    first_loss = {r.name: r() for r in runs}  # also warms up
    for _ in range(args.warmup):
        for r in runs:
            r()
    times = {r.name: [] for r in runs}
    per_round = []
    for i in range(args.rounds):
        order = runs if i % 2 == 0 else runs[::-1]
        med = {}
        for r in order:
            t = _time_block(r, args.steps)
            times[r.name] += t
            med[r.name] = statistics.median(t)
        per_round.append(med)
    tokens_per_step = args.batch * args.seq
    row = {
        "dtype": dtype,
        "first_loss": first_loss,
        "compile_s": {r.name: r.compile_s for r in runs},
        "device": {r.name: r.device for r in runs},
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "tok_per_s": {k: tokens_per_step / statistics.median(v) for k, v in times.items()},
        "step_times_s": times,
        "peer_error": peer_error,
    }
    if len(runs) == 2:
        row["ratio"] = row["tok_per_s"]["jmem"] / row["tok_per_s"]["peft+bnb"]
        row["round_ratios"] = [m["peft+bnb"] / m["jmem"] for m in per_round]
        row["peer_attention"] = runs[1].attn
        row["peer_optimizer"] = runs[1].optimizer_name
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(llama.CONFIGS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per contender per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    ap.add_argument("--remat", default="full", help="jmem remat policy (the peer: per layer)")
    ap.add_argument("--peer-prepare", action="store_true", help="prepare_model_for_kbit_training")
    ap.add_argument("--skip-torch", action="store_true", help="time jmem only")
    ap.add_argument("--quick", action="store_true", help="2 rounds x 3 steps, 1 warm-up step")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "peer_qlora.json")
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 1
    cfg = llama.get_config(args.config)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        ap.error(f"unknown dtype(s) {bad}; choose from {sorted(DTYPES)}")
    rows = [compare(cfg, d, args) for d in dtypes]

    print(
        f"\nQLoRA step, {args.config} Llama, batch {args.batch} x seq {args.seq}, "
        f"NF4 double-quant, LoRA r=8 x 7 projections, 8-bit AdamW, remat per layer; "
        f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs; medians of "
        f"{args.rounds} alternated rounds x {args.steps} steps\n"
    )
    print(
        "| compute dtype | jmem tok/s | PEFT + bnb tok/s | ratio (jmem / peer) | per-round ratios |"
    )
    print("|---|---:|---:|---:|---|")
    for r in rows:
        tps = r["tok_per_s"]
        peer = tps.get("peft+bnb")
        print(
            f"| {r['dtype']} | {tps['jmem']:,.0f} | "
            + (f"{peer:,.0f} | {r['ratio']:.2f} | " if peer else "- | - | ")
            + " ".join(f"{x:.2f}" for x in r.get("round_ratios", []))
            + " |"
        )
    meta = {
        "config": args.config,
        "model": {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_layers")},
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "steps": args.steps,
        "remat": args.remat,
        "peer_prepare_model_for_kbit_training": args.peer_prepare,
        "backend": jax.devices()[0].platform,
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "jax": jax.__version__,
        "machine": platform.machine(),
        "jmem_commit": _commit(),
    }
    try:
        import bitsandbytes  # noqa: PLC0415
        import peft  # noqa: PLC0415
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415

        meta |= {
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "bitsandbytes": bitsandbytes.__version__,
        }
    except ImportError:
        pass
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=2)
    print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
