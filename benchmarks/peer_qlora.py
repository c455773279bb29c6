"""QLoRA step speed: jmem vs Hugging Face PEFT + bitsandbytes, at equal settings.

The same training step on both sides, with the same shapes (default: the ``tiny`` Llama,
hidden 256, intermediate 688, 4 layers, 8 heads / 4 KV heads, vocab 256; batch 16 x seq
128):

* jmem: the step of the fine-tuning job (``jmem._src.finetune.build.build``, with the compute dtype
  chosen here so that float32 can be timed too; ``examples/qlora_7b.py`` runs it): NF4
  base with double quantization (``qlora.quantize_params``), LoRA r=8 alpha=16 on all
  seven projections (``jmem.lora.init``), ``clip_by_global_norm(1.0)`` +
  ``jmem.adamw_8bit`` (the job's warmup-cosine schedule to ``lr``), compute dtype
  ``--dtypes``, through ``jmem.train_step``; timed as the job's loop does:
  ``compiled(state, batch)`` then ``float(loss)``.
* peer: ``transformers.LlamaForCausalLM`` with the same config (SDPA attention), every
  projection a bitsandbytes ``Linear4bit`` (NF4, double quantization, compute dtype =
  the dtype), PEFT LoRA r=8 alpha=16 on the seven projections (adapters float32, as PEFT
  keeps them), gradient clipping to 1.0 and ``bnb.optim.AdamW8bit`` (8-bit states for
  tensors of >= 4096 elements, as jmem's ``min_quantized_size``); ``loss.item()`` ends
  the step. The frozen non-quantized weights (embedding, norms, head) are kept in the
  dtype, as jmem keeps them; ``--peer-prepare`` calls PEFT's
  ``prepare_model_for_kbit_training`` instead (the usual QLoRA notebook recipe).

``--settings`` (default both): ``remat`` = jmem ``remat="full"`` against the peer's
gradient checkpointing per decoder layer (non-reentrant); ``none`` = no remat on either
side (``gradient_checkpointing_disable()``). Both compute the mean next-token
cross-entropy of the same ``[B, S]`` token batch (logits in float32).

Timing: every contender (both sides, every setting) is built in one process and the rounds
alternate them, the order reversed every other round, each running ``--steps`` steps after
one untimed step (which absorbs the switch between the two runtimes' thread pools); the
figure is the median step time over all rounds, the ratio jmem tok/s over peer tok/s (> 1:
jmem faster), with the per-round ratios. Then ``--isolated-rounds`` rounds with each side
in a fresh process of its own (one runtime's threads cannot slow the other's).
``--host-allocator`` (default ``huge-pages``, the fine-tuning job's CPU default) sets the
host allocator for the whole process and every worker, so both sides always run under the
same one: ``huge-pages`` restarts the process once with glibc's ``glibc.malloc.hugetlb=1``
(``jmem.host.restart_with_huge_pages``), ``retain`` calls
``jmem.host.retain_host_allocations()``, ``system`` keeps glibc's defaults
(docs/performance.md).

On a GPU the jmem side runs on the GPU and the peer on CUDA when PyTorch has it
(``--skip-torch`` to time jmem only). Prints a table and writes
``benchmarks/results/peer_qlora.json`` (with the CPU model and its speed-relevant flags).

Run: ``python benchmarks/peer_qlora.py [--quick] [--rounds 7] [--steps 6] [--batch 16]
[--seq 128] [--dtypes float32,bfloat16] [--settings remat,none] [--isolated-rounds 2]
[--config tiny] [--skip-torch]``.
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

import jmem  # noqa: E402
from jmem._src import host_allocator as host_allocator_lib  # noqa: E402
from jmem._src.finetune.build import build  # noqa: E402
from jmem._src.finetune.config import FinetuneConfig  # noqa: E402
from jmem._src.finetune.loop import init_state  # noqa: E402
from jmem.models import llama  # noqa: E402

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _batch(cfg, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """``[batch, seq + 1]`` int32 tokens; inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq + 1), np.int32)


class JmemStep:
    """The QLoRA train step of the fine-tuning job (``jmem._src.finetune.build.build``), compiled once."""

    name = "jmem"

    def __init__(self, cfg, dtype: str, tokens: np.ndarray, *, rank=8, lr=1e-3, remat="full"):
        dt = DTYPES[dtype]
        config = FinetuneConfig.from_flat(
            steps=100,
            lr=lr,
            lora_rank=rank,
            lora_alpha=2.0 * rank,
            lora_targets=TARGETS,
            remat=remat,
        )
        step, *_ = build(config, cfg, compute_dtype=dt)
        self._compile(step, init_state(config, cfg, step, dt, None, None)[0], tokens)

    def _compile(self, step, state, tokens: np.ndarray) -> None:
        """Keeps ``state`` and the ``[B, S + 1]`` token batch, and compiles ``step`` once."""
        self.state = state
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

    def __init__(
        self, cfg, dtype: str, tokens: np.ndarray, *, rank=8, lr=1e-3, prepare=False, remat=True
    ):
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
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=remat)
        if remat:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            model.gradient_checkpointing_disable()
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


#: ``--settings``: (jmem remat policy, peer gradient checkpointing per decoder layer).
SETTINGS = {"remat": ("full", True), "none": ("none", False)}
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_info() -> dict:
    """The CPU model, the instruction-set flags that matter for speed, and the core count."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpu_flags": [f for f in SPEED_FLAGS if f in flags],
        "cpu_count": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


#: ``--host-allocator`` choices (the same for every benchmark that imports them).
HOST_ALLOCATORS = ("huge-pages", "retain", "system")
HOST_ALLOCATOR_HELP = (
    "huge-pages (default): glibc's glibc.malloc.hugetlb=1 for the whole process and its "
    "workers, both sides (jmem.host.restart_with_huge_pages restarts the process once to set "
    "it; the fine-tuning job's default on CPU); retain: jmem.host.retain_host_allocations(), "
    "both sides; "
    "system: glibc's defaults"
)


def host_allocator(choice: str, restart: bool) -> dict:
    """Applies ``choice`` to this process before JAX starts (``huge-pages`` restarts it when
    ``restart``, i.e. run from the command line; its workers inherit the environment);
    returns what is in effect, for the JSON."""
    if choice == "huge-pages":
        status = jmem.host.restart_with_huge_pages(restart=restart, respect_env=False)
    elif choice == "retain":
        status = jmem.host.retain_host_allocations(respect_env=False)
    else:
        status = None
    if status is not None and not status.applied:
        print(f"host allocator unchanged: {status.reason}", file=sys.stderr)
    return {
        "huge_pages": host_allocator_lib.huge_pages_active(),
        "retained": host_allocator_lib.retained(),
    }


def _time_block(run, steps: int) -> list[float]:
    run()  # untimed: the other runtime's threads were busy a moment ago
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def _make(side: str, cfg, dtype: str, tokens, setting: str, args):
    """The ``side`` ("jmem" or "peft+bnb") step for ``setting`` (a ``SETTINGS`` key)."""
    policy, checkpointing = SETTINGS[setting]
    if side == "jmem":
        return JmemStep(cfg, dtype, tokens, remat=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeerStep(cfg, dtype, tokens, prepare=args.peer_prepare, remat=checkpointing)


def _contenders(cfg, dtype: str, args) -> tuple[dict, dict]:
    """``{(side, setting): step}`` for every setting and side that could be built, and
    ``{setting: why the peer is missing}``."""
    tokens = _batch(cfg, args.batch, args.seq)
    runs, errors = {}, {}
    for setting in args.settings:
        runs["jmem", setting] = _make("jmem", cfg, dtype, tokens, setting, args)
        if args.skip_torch:
            continue
        try:
            runs["peft+bnb", setting] = _make("peft+bnb", cfg, dtype, tokens, setting, args)
        except Exception as e:  # noqa: BLE001 - report why the peer is missing, keep jmem's
            errors[setting] = f"{type(e).__name__}: {e}"
            print(f"peer not run for {dtype}/{setting}: {errors[setting]}", file=sys.stderr)
    return runs, errors


def _row(dtype, setting, mode, times, per_round, args, **extra) -> dict:
    """One table row: tok/s per side from the median step times, the ratio jmem / peer."""
    tokens_per_step = args.batch * args.seq
    row = {
        "dtype": dtype,
        "setting": setting,
        "mode": mode,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "tok_per_s": {k: tokens_per_step / statistics.median(v) for k, v in times.items()},
        "step_times_s": times,
        **extra,
    }
    if len(times) == 2:
        row["ratio"] = row["tok_per_s"]["jmem"] / row["tok_per_s"]["peft+bnb"]
        row["round_ratios"] = [m["peft+bnb"] / m["jmem"] for m in per_round]
    return row


def compare(cfg, dtype: str, args) -> list[dict]:
    """Builds every contender for ``dtype`` (both sides, every setting) in this process and
    times them in alternated rounds (the order reversed every other round)."""
    runs, errors = _contenders(cfg, dtype, args)
    first_loss = {f"{s}/{k}": r() for (s, k), r in runs.items()}  # also warms up
    for _ in range(args.warmup):
        for r in runs.values():
            r()
    times = {key: [] for key in runs}
    per_round = []
    keys = list(runs)
    for i in range(args.rounds):
        med = {}
        for key in keys if i % 2 == 0 else keys[::-1]:
            t = _time_block(runs[key], args.steps)
            times[key] += t
            med[key] = statistics.median(t)
        per_round.append(med)
    rows = []
    for setting in args.settings:
        sides = [s for s in ("jmem", "peft+bnb") if (s, setting) in runs]
        row = _row(
            dtype,
            setting,
            "in-process",
            {s: times[s, setting] for s in sides},
            [{s: m[s, setting] for s in sides} for m in per_round],
            args,
            first_loss={s: first_loss[f"{s}/{setting}"] for s in sides},
            compile_s={s: runs[s, setting].compile_s for s in sides},
            device={s: runs[s, setting].device for s in sides},
            peer_error=errors.get(setting),
        )
        if sides[-1] == "peft+bnb":
            row["peer_attention"] = runs["peft+bnb", setting].attn
            row["peer_optimizer"] = runs["peft+bnb", setting].optimizer_name
        rows.append(row)
    return rows


def _worker(args) -> None:
    """``--worker SIDE``: times one contender alone in this process; prints JSON last."""
    cfg = llama.get_config(args.config)
    tokens = _batch(cfg, args.batch, args.seq)
    run = _make(args.worker, cfg, args.dtypes[0], tokens, args.settings[0], args)
    first = run()
    for _ in range(args.warmup):
        run()
    times = _time_block(run, args.steps)
    print(json.dumps({"first_loss": first, "times": times, "compile_s": run.compile_s}))


def isolated(cfg, dtype: str, setting: str, args) -> dict:
    """Each side in a process of its own (one runtime's threads cannot slow the other's),
    ``--isolated-rounds`` alternated rounds of one fresh process per side."""
    sides = ["jmem"] if args.skip_torch else ["jmem", "peft+bnb"]
    times, per_round = {s: [] for s in sides}, []
    for i in range(args.isolated_rounds):
        med = {}
        for side in sides if i % 2 == 0 else sides[::-1]:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", side]
            cmd += ["--dtypes", dtype, "--settings", setting, "--config", args.config]
            cmd += ["--batch", str(args.batch), "--seq", str(args.seq)]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += ["--peer-prepare"] if args.peer_prepare else []
            cmd += ["--host-allocator", args.host_allocator]
            out = subprocess.run(cmd, capture_output=True, text=True)  # inherits the tunable
            if out.returncode:
                raise RuntimeError(f"{side} worker failed:\n{out.stderr[-2000:]}")
            t = json.loads(out.stdout.strip().splitlines()[-1])["times"]
            times[side] += t
            med[side] = statistics.median(t)
        per_round.append(med)
    return _row(dtype, setting, "own process", times, per_round, args)


def none_over_full(rows: list[dict]) -> dict:
    """Per dtype and side: the ``none`` setting's tok/s over the ``remat`` one (in-process)."""
    out = {}
    for r in rows:
        if r["setting"] != "none" or r["mode"] != "in-process":
            continue
        base = [
            x
            for x in rows
            if x["dtype"] == r["dtype"] and x["setting"] == "remat" and x["mode"] == "in-process"
        ]
        if not base:
            continue
        base = base[0]
        out[r["dtype"]] = {s: r["tok_per_s"][s] / base["tok_per_s"][s] for s in r["tok_per_s"]}
    return out


def _print_table(rows: list[dict], speedup: dict, args) -> None:
    print(
        f"\nQLoRA step, {args.config} Llama, batch {args.batch} x seq {args.seq}, NF4 "
        f"double-quant, LoRA r=8 x 7 projections, 8-bit AdamW; {jax.devices()[0].platform}, "
        f"{cpu_info()['cpu_model']}, {os.cpu_count()} CPUs, host allocator "
        f"{args.host_allocator}; medians ({args.rounds} alternated "
        f"rounds x {args.steps} steps in one process; {args.isolated_rounds} rounds of "
        "own processes)\n"
    )
    print("| setting | dtype | timed | jmem tok/s | PEFT + bnb tok/s | jmem / peer | per round |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in rows:
        tps = r["tok_per_s"]
        peer = tps.get("peft+bnb")
        print(
            f"| {r['setting']} | {r['dtype']} | {r['mode']} | {tps['jmem']:,.0f} | "
            + (f"{peer:,.0f} | {r['ratio']:.2f} | " if peer else "- | - | ")
            + " ".join(f"{x:.2f}" for x in r.get("round_ratios", []))
            + " |"
        )
    for dtype, v in speedup.items():
        print(
            f"\n{dtype}: no remat over per-layer remat: "
            + ", ".join(f"{k} {x:.2f}x" for k, x in v.items())
        )


def _parser():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(llama.CONFIGS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument(
        "--settings",
        default="remat,none",
        help="comma-separated: remat (per layer, both sides), none (no remat, both sides)",
    )
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per contender per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    ap.add_argument(
        "--isolated-rounds", type=int, default=2, help="rounds with each side in its own process"
    )
    ap.add_argument("--peer-prepare", action="store_true", help="prepare_model_for_kbit_training")
    ap.add_argument(
        "--host-allocator", choices=HOST_ALLOCATORS, default="huge-pages", help=HOST_ALLOCATOR_HELP
    )
    ap.add_argument("--skip-torch", action="store_true", help="time jmem only")
    ap.add_argument("--quick", action="store_true", help="2 rounds x 3 steps, 1 warm-up step")
    ap.add_argument("--worker", choices=["jmem", "peft+bnb"], help=argparse.SUPPRESS)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "peer_qlora.json")
    )
    return ap


def _meta(cfg, args) -> dict:
    meta = {
        "config": args.config,
        "model": {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_layers")},
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "steps": args.steps,
        "isolated_rounds": args.isolated_rounds,
        "settings": {
            s: dict(zip(("jmem_remat", "peer_checkpointing"), SETTINGS[s])) for s in args.settings
        },
        "peer_prepare_model_for_kbit_training": args.peer_prepare,
        "host_allocator": args.host_allocator,
        "host_allocator_applied": args.host_allocator_applied,
        "backend": jax.devices()[0].platform,
        **cpu_info(),
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
    return meta


def main(argv=None):
    ap = _parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 1
        args.isolated_rounds = min(args.isolated_rounds, 1)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [d for d in args.dtypes if d not in DTYPES] + [
        s for s in args.settings if s not in SETTINGS
    ]
    if bad:
        ap.error(
            f"unknown dtype(s)/setting(s) {bad}; choose from {sorted(DTYPES)} / {sorted(SETTINGS)}"
        )
    if args.worker:
        args.host_allocator_applied = host_allocator(args.host_allocator, restart=False)
        return _worker(args)
    args.host_allocator_applied = host_allocator(args.host_allocator, restart=argv is None)
    cfg = llama.get_config(args.config)
    rows = [row for d in args.dtypes for row in compare(cfg, d, args)]
    rows += [
        isolated(cfg, d, s, args)
        for d in args.dtypes
        for s in args.settings
        if args.isolated_rounds
    ]
    speedup = none_over_full(rows)
    _print_table(rows, speedup, args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**_meta(cfg, args), "rows": rows, "none_over_remat": speedup}, f, indent=2)
    print(f"\nwrote {args.out}")
    return rows


if __name__ == "__main__":
    main()  # argv None: the command line, which huge pages may restart
