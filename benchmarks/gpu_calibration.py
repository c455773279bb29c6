"""The planner against XLA:GPU's buffer assignment: compiles of the job's step for a target.

Each point is ``jmem finetune --config MODEL --seq-len S --batch-size B --lora-rank R
--remat REMAT --dry-run --target h100_sxm`` (the job's defaults otherwise: NF4 base, bf16,
8-bit AdamW, loss and token chunks, attention resolved for the target: cuDNN), compiled on
this CPU machine by XLA:GPU (deviceless; no GPU, not autotuned). Every compile is cached in
``benchmarks/results/gpu_compile/compiles.json`` (keyed by its flags) as soon as it is done,
so a point is never compiled twice; ``calibration.json`` is the calibration table that
``tests/test_planner.py`` checks ``planner.estimate(..., target="h100_sxm")`` against.

    JAX_PLATFORMS=cpu python benchmarks/gpu_calibration.py            # the calibration grid
    JAX_PLATFORMS=cpu python benchmarks/gpu_calibration.py --point llama3_1_8b:65536:full

8B compiles take one to several minutes of CPU each and about 10 GB of RAM at 128k.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time

RESULTS = os.path.join(os.path.dirname(__file__), "results", "gpu_compile")
CACHE = os.path.join(RESULTS, "compiles.json")
CALIBRATION = os.path.join(RESULTS, "calibration.json")
TARGET = "h100_sxm"
LABEL = "XLA:GPU compile for h100_sxm, no GPU"

#: The calibration grid: Llama-3.1-8B QLoRA r=32, batch 1; ``full`` and ``offload_inputs``
#: at every length of ``SEQS``, every remat policy at ``POLICY_SEQS``.
MODEL, RANK = "llama3_1_8b", 32
SEQS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
REMATS = ("full", "offload_inputs")
POLICIES = ("none", "dots", "selective", "full", "offload", "offload_inputs")
POLICY_SEQS = (4096, 16384, 49152)


def key(flags: dict) -> str:
    """The cache key of one compile: its flags, sorted."""
    return ";".join(f"{k}={flags[k]}" for k in sorted(flags))


def load(path: str = CACHE) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def save(data: dict, path: str = CACHE) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def compile_point(flags: dict, target: str = TARGET) -> dict:
    """The job's dry run for ``target`` with ``flags`` (``jmem finetune`` option names);
    the compiled record's bytes, the levers and the seconds it took."""
    from jmem import finetune  # noqa: PLC0415

    t0 = time.time()
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        config = finetune.FinetuneConfig.from_flat(
            **flags, dry_run=True, no_check_advice=True, target=target, out=out
        )
        record = finetune.run(config)
    c = record["compiled"]
    fields = (
        "argument_bytes",
        "output_bytes",
        "alias_bytes",
        "temp_bytes",
        "peak_bytes",
        "host_peak_bytes",
        "host_argument_bytes",
        "host_temp_bytes",
    )
    return {
        **{k: int(c.get(k) or 0) for k in fields},
        "planner_cpu_total": int(record["estimate"]["total"]),
        "levers": record["levers"],
        "target": target,
        "compile_s": round(time.time() - t0, 1),
    }


def cached(flags: dict, target: str = TARGET, *, cache: dict | None = None) -> dict:
    """``compile_point`` through the cache (written after every new compile)."""
    cache = load() if cache is None else cache
    k = f"{target}|{key(flags)}"
    if k not in cache:
        print(f"compiling {k} ...", flush=True)
        cache[k] = {"flags": flags, **compile_point(flags, target)}
        save(cache)
        print(
            f"  peak {cache[k]['peak_bytes'] / 2**30:.2f} GiB, host "
            f"{cache[k]['host_peak_bytes'] / 2**30:.2f} GiB, {cache[k]['compile_s']} s",
            flush=True,
        )
    return cache[k]


def job_flags(model: str, seq: int, remat: str, rank: int = RANK, batch: int = 1, **extra):
    return dict(config=model, seq_len=seq, batch_size=batch, lora_rank=rank, remat=remat, **extra)


def _planner(model: str, seq: int, remat: str, rank: int, target: str, attention=None) -> int:
    """``planner.estimate``'s device total for the job's step (its defaults: NF4, all seven
    projections, 8-bit AdamW, bf16, ``jmem.Levers()`` resolved for ``target``, with
    ``attention`` when the compile was given one)."""
    import jmem  # noqa: PLC0415
    from jmem import planner  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    levers = jmem.Levers(remat=remat, **({"attention": attention} if attention else {}))
    return planner.estimate(
        llama.get_config(model),
        param_dtype="bf16",
        optimizer="adamw_8bit",
        lora={"rank": rank, "targets": list(llama.LINEAR_NAMES)},
        quantization="nf4",
        levers=levers,
        seq_len=seq,
        target=target,
    ).total


#: Every family at 4,096 tokens (QLoRA r=8, full remat; small presets and the 7B class):
#: the terms fitted on 8B checked on other shapes, tied embeddings and attention paths.
FAMILIES = (
    "tiny",
    "llama_1b",
    "llama3_2_1b",
    "llama2_7b",
    "mistral_7b",
    "qwen3_0_6b",
    "qwen2_5_7b",
    "gemma2_2b",
    "gemma3_1b",
    "gemma3_4b",
    "phi3_mini",
    "olmo2_7b",
)


#: Every remat policy on the 7B-9B presets of other families (QLoRA r=32): 4,096 and
#: 16,384 tokens for the device-saving policies, 4,096 for the offloading ones.
FAMILY_POLICIES = ("qwen2_5_7b", "mistral_7b", "gemma2_9b", "phi3_mini")
#: The 8B policies with blockwise attention instead of cuDNN (``--attention blockwise``).
BLOCKWISE = ("none", "dots")


def _row(model: str, seq: int, remat: str, rank: int, attention: str | None = None) -> dict:
    """One calibration row: the compile (cached) and the planner's totals for both
    compilers; ``attention``: the ``--attention`` flag, when given (``attention_flag``)."""
    extra = {"attention": attention} if attention else {}
    r = cached(job_flags(model, seq, remat, rank, **extra))
    skip = ("flags", "planner_cpu_total", "levers")
    return {
        "model": model,
        "lora_rank": rank,
        "batch_size": 1,
        "seq_len": seq,
        "remat": remat,
        **{k: v for k, v in r.items() if k not in skip},
        "attention": r["levers"]["attention"]["value"],
        **({"attention_flag": attention} if attention else {}),
        "planner_gpu_total": _planner(model, seq, remat, rank, TARGET, attention),
        "planner_cpu_total": _planner(model, seq, remat, rank, "cpu", attention),
    }


def _policy_rows() -> list[dict]:
    """Every remat policy: 8B at ``POLICY_SEQS`` (the ``full``/``offload_inputs`` points
    of ``SEQS`` are in the main grid), 8B with blockwise attention at 16k, and the other
    families (``FAMILY_POLICIES``)."""
    rows = [
        _row(MODEL, seq, remat, RANK)
        for remat in POLICIES
        for seq in POLICY_SEQS
        if not (remat in REMATS and seq in SEQS)
    ]
    rows += [_row(MODEL, 16384, remat, RANK, "blockwise") for remat in BLOCKWISE]
    for m in FAMILY_POLICIES:
        rows += [_row(m, s, r, RANK) for s in (4096, 16384) for r in POLICIES[:4]]
        rows += [_row(m, 4096, r, RANK) for r in POLICIES[4:]]
    return rows


def calibration(seqs=SEQS, remats=REMATS) -> dict:
    """Compiles (or reads) the grid and writes ``calibration.json``: one row per point with
    the compiled device peak and host bytes, and the planner's totals with XLA:GPU's terms
    (``target="h100_sxm"``) and with XLA:CPU's (``target="cpu"``). ``points``: 8B with
    ``full`` and ``offload_inputs`` at ``seqs``; ``policies``: every remat policy
    (``_policy_rows``); ``families``: the presets at 4k with full remat."""
    rows = [_row(MODEL, seq, remat, RANK) for remat in remats for seq in seqs]
    policies = _policy_rows()
    families = [_row(m, 4096, "full", 8) for m in FAMILIES]
    families.append(_row("qwen3_0_6b", 32768, "full", 8))  # one small preset at 32k
    out = {
        "label": LABEL,
        "target": TARGET,
        "job": "jmem finetune --dry-run --target h100_sxm (NF4, bf16, adamw_8bit, "
        "loss/token chunks and attention resolved for the target)",
        "points": rows,
        "policies": policies,
        "families": families,
    }
    save(out, CALIBRATION)
    return out


HEADLINES = os.path.join(RESULTS, "headlines.json")
#: ``jmem estimate --target --max-seq``'s granularity and fit rule (``compiled_plan``).
MULTIPLE = 8192


def _fits(flags: dict, memory: int, reserve: int) -> tuple[bool, dict]:
    r = cached(flags)
    return r["peak_bytes"] + reserve <= memory, r


def longest(model: str, remat: str, memory: int, guess: int, reserve: int, rank=RANK) -> dict:
    """The longest multiple of ``MULTIPLE`` tokens whose compiled device peak plus
    ``reserve`` fits ``memory`` (``jmem estimate --target h100_sxm --max-seq``'s rule and
    answer, assuming the peak grows with the length), searched from ``guess`` (the
    calibrated planner's answer) one multiple at a time: two or three compiles when the
    planner is right."""
    k = max(1, guess // MULTIPLE)
    ok, r = _fits(job_flags(model, k * MULTIPLE, remat, rank), memory, reserve)
    step = 1 if ok else -1
    best = r if ok else None
    while k + step >= 1:
        ok2, r2 = _fits(job_flags(model, (k + step) * MULTIPLE, remat, rank), memory, reserve)
        if step > 0 and not ok2:
            return {"seq_len": k * MULTIPLE, "over": (k + 1) * MULTIPLE, **_bytes(best)}
        if step < 0 and ok2:
            return {"seq_len": (k - 1) * MULTIPLE, "over": k * MULTIPLE, **_bytes(r2)}
        best, k = (r2 if ok2 else best), k + step
    return {"seq_len": 0}


def _bytes(r: dict) -> dict:
    return {k: r[k] for k in ("peak_bytes", "host_peak_bytes", "argument_bytes", "temp_bytes")}


def max_seq_headlines(guesses: dict | None = None) -> dict:
    """8B QLoRA r=32: the longest sequence in 24 GiB and 80 GiB, device-resident (full
    remat) and with the layer inputs offloaded, from the compiler (guesses from the
    planner calibrated to XLA:GPU, or ``guesses["80GiB/offload_inputs"]``: beyond 256k
    tokens the planner is under the compile, -15% at 1.2M tokens offloaded, and the
    search from its guess would take a compile per 8,192 tokens)."""
    from jmem import planner  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    cfg = llama.get_config(MODEL)
    job = dict(
        param_dtype="bf16",
        optimizer="adamw_8bit",
        quantization="nf4",
        lora={"rank": RANK, "targets": list(llama.LINEAR_NAMES)},
        target=TARGET,
    )
    out = {}
    for memory in ("24GiB", "80GiB"):
        mem = planner.parse_memory(memory)
        guess = planner.largest_seq_len_by_remat(mem, cfg, multiple_of=MULTIPLE, **job)
        for remat in ("full", "offload_inputs"):
            start = (guesses or {}).get(f"{memory}/{remat}", guess[remat])
            got = longest(MODEL, remat, mem, start, planner.DEFAULT_RESERVE)
            out[f"{memory}/{remat}"] = {"planner": guess[remat], **got}
            print(memory, remat, out[f"{memory}/{remat}"], flush=True)
    return out


#: The seeds' 24 GB table (largest full fine-tune with mixed-precision Adam, with 8-bit
#: Adam; QLoRA), planned for the GPU: 2,048 tokens, batch 1, full remat, the long-context
#: levers resolved for the target, 24e9 bytes and the planner's 2 GB reserve.
SEED_ROWS = {
    "mixed-precision Adam": dict(optimizer="adamw"),
    "8-bit Adam": dict(optimizer="adamw_8bit"),
    "QLoRA (NF4, 8-bit Adam, r=8 on all seven)": dict(
        optimizer="adamw_8bit", quantization="nf4", lora=(8, "all")
    ),
}


def seed_table() -> dict:
    """The seeds' 24 GB rows from ``planner.largest_model`` with activations computed
    (``activation_budget=None``) for XLA:GPU (``target="h100_sxm"``) and for XLA:CPU."""
    import jmem  # noqa: PLC0415
    from jmem import planner  # noqa: PLC0415

    out = {}
    for row, kw in SEED_ROWS.items():
        common = dict(
            activation_budget=None,
            param_dtype="bf16",
            seq_len=2048,
            batch_size=1,
            levers=jmem.Levers(remat="full"),
            **kw,
        )
        gpu = planner.largest_model("24GB", target=TARGET, **common)
        cpu = planner.largest_model("24GB", target="cpu", **common)
        out[row] = {"gpu_planner_params": gpu, "cpu_planner_params": cpu}
        print(row, out[row], flush=True)
    return out


def full_finetune_spot_check(model: str = "llama_1b", optimizer: str = "adamw") -> dict:
    """A compiled spot-check of the full fine-tune rows: ``model``'s full fine-tune step
    (bf16 params, float32 masters, ``optimizer``, full remat, 2,048 tokens) compiled for
    h100_sxm next to the planner's estimate for the target."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import jmem  # noqa: PLC0415
    from jmem import planner  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    cfg, seq = llama.get_config(model), 2048
    opt = {"adamw": optax.adamw(1e-4), "adamw_8bit": jmem.adamw_8bit(1e-4)}[optimizer]
    step = jmem.train_step(
        lambda p, b: llama.loss_fn(p, b, cfg, levers=jmem.Levers()),
        opt,
        precision="p=bf16,c=bf16,o=f32",
        master_weights=True,
        remat="full",
    )
    params = jax.eval_shape(lambda k: llama.init(k, cfg, jnp.bfloat16), jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((1, seq), jnp.int32) for k in ("inputs", "targets")}
    r = step.measure(step.abstract_state(params), batch, target=TARGET)
    est = planner.estimate(
        cfg,
        param_dtype="bf16",
        optimizer=optimizer,
        remat="full",
        seq_len=seq,
        levers=jmem.Levers(),
        target=TARGET,
    )
    out = {
        "model": model,
        "optimizer": optimizer,
        "seq_len": seq,
        "peak_bytes": r.peak_bytes,
        "argument_bytes": r.argument_bytes,
        "temp_bytes": r.temp_bytes,
        "planner_total": est.total,
        "planner_static": est.static,
    }
    print(out, flush=True)
    return out


def skip_nonfinite_probe(model: str = "qwen3_0_6b") -> dict:
    """Full fine-tune (bf16 params, float32 masters, AdamW, full remat, 2,048 tokens) of
    ``model`` for h100_sxm with and without ``skip_nonfinite`` (the builder's default
    selects between the new and the old state: bytes per parameter of the temporaries)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import jmem  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    cfg = llama.get_config(model)
    params = jax.eval_shape(lambda k: llama.init(k, cfg, jnp.bfloat16), jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(params))
    batch = {k: jax.ShapeDtypeStruct((1, 2048), jnp.int32) for k in ("inputs", "targets")}
    out = {"model": model, "params": n}
    for skip in (True, False):
        step = jmem.train_step(
            lambda p, b: llama.loss_fn(p, b, cfg, levers=jmem.Levers()),
            optax.adamw(1e-4, mask=jmem.decay_mask),
            precision="p=bf16,c=bf16,o=f32",
            master_weights=True,
            remat="full",
            skip_nonfinite=skip,
        )
        r = step.measure(step.abstract_state(params), batch, target=TARGET)
        out[f"skip_nonfinite={skip}"] = {
            "argument_bytes": r.argument_bytes,
            "temp_bytes": r.temp_bytes,
            "peak_bytes": r.peak_bytes,
            "temp_bytes_per_param": round(r.temp_bytes / n, 2),
        }
    print(out, flush=True)
    return out


def fsdp_8() -> dict:
    """Per-device memory of the 8B QLoRA r=32 job on 8 h100_sxm devices with FSDP (batch 8
    x 4,096 tokens, full remat), with and without the optimizer state offloaded."""
    out = {}
    for offload in (False, True):
        flags = job_flags(MODEL, 4096, "full", RANK, batch=8, mesh="fsdp=8", offload=offload)
        out["offload" if offload else "no offload"] = _bytes(cached(flags)) | {
            "host_argument_bytes": cached(flags)["host_argument_bytes"]
        }
        print(offload, out, flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--point",
        action="append",
        default=[],
        help="MODEL:SEQ:REMAT[:RANK[:FLAG=VALUE,...]] to compile (cached) instead "
        "of the grid (flags as jmem finetune's, e.g. loss_chunk=4096)",
    )
    p.add_argument(
        "--max-seq",
        action="store_true",
        help="the 8B QLoRA longest-sequence headlines (headlines.json)",
    )
    p.add_argument("--seeds", action="store_true", help="the seeds' 24 GB table (planner)")
    p.add_argument("--fsdp", action="store_true", help="8B QLoRA on 8 h100_sxm with FSDP")
    p.add_argument("--skip-probe", action="store_true", help="full fine-tune's skip_nonfinite")
    args = p.parse_args(argv)
    if args.skip_probe:
        data = load(HEADLINES)
        data["full_finetune_skip_nonfinite"] = skip_nonfinite_probe()
        save(data, HEADLINES)
        return
    if args.seeds or args.fsdp:
        data = load(HEADLINES)
        data.update(label=LABEL, target=TARGET)
        if args.seeds:
            data["seed_24gb"] = {
                "planner": seed_table(),
                "spot_checks": [
                    full_finetune_spot_check(optimizer=o) for o in ("adamw", "adamw_8bit")
                ],
            }
        if args.fsdp:
            data["fsdp_8"] = fsdp_8()
        save(data, HEADLINES)
        return
    if args.max_seq:
        data = load(HEADLINES)
        # the 80 GiB offloaded guess from the compiles at 262,144 and 1,228,800 tokens
        # (22.27 and 91.24 GiB: 80 GiB less the reserve at about 1.04M tokens)
        guesses = {"80GiB/offload_inputs": 127 * MULTIPLE}
        data.update(label=LABEL, target=TARGET, max_seq=max_seq_headlines(guesses))
        save(data, HEADLINES)
        return
    if args.point:
        for spec in args.point:
            model, seq, remat, *rest = spec.split(":")
            rank = int(rest[0]) if rest else RANK
            extra = dict(kv.split("=") for kv in rest[1].split(",")) if len(rest) > 1 else {}
            extra = {k: int(v) if v.isdigit() else v for k, v in extra.items()}
            r = cached(job_flags(model, int(seq), remat, rank, **extra))
            print(json.dumps({k: v for k, v in r.items() if k != "levers"}))
        return
    data = calibration()
    for row in data["points"] + data["policies"]:
        print(
            f"{row['remat']:>15} {row['seq_len']:>7}: device {row['peak_bytes'] / 2**30:6.2f}"
            f" GiB, host {row['host_peak_bytes'] / 2**30:6.2f} GiB, planner "
            f"{row['planner_gpu_total'] / 2**30:6.2f} GiB (XLA:CPU terms "
            f"{row['planner_cpu_total'] / 2**30:6.2f} GiB)"
        )


if __name__ == "__main__":
    main()
