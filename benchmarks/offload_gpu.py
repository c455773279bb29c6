"""Device peak bytes and step time with and without host-offloaded optimizer state.

Model: jmem's reference Llama ("llama_1b", ~1.1B params, on GPU; "tiny" on CPU), bf16
params, ``jmem.mixed_precision(optax.adamw)`` (fp32 masters + fp32 Adam
moments = 12 bytes/param of optimizer state), step jitted with the state donated.
Variants: ``baseline`` (state in device memory), ``offload``
(``jmem.offload(...)``, state in ``pinned_host``) and, with ``--leaf-by-leaf``,
``leaf_by_leaf`` (``offload(..., leaf_by_leaf=True)``: the update runs one parameter leaf
at a time, so about two leaves' state is on the device at once instead of up to all of it).

Each variant runs in its own subprocess, because ``peak_bytes_in_use`` is a process-wide
high-water mark that cannot be reset. Reported per variant: device bytes in use between
steps, device peak over init + compile + steps, XLA's compiled memory analysis (device
and host argument/temp bytes) and the median step time. Expected on GPU: the peak drops
by about the state bytes (12 B/param) when the step's peak is in forward/backward.

Usage (one command; ~3-4 min on an H200, mostly compilation):
    python benchmarks/offload_gpu.py               # llama_1b on GPU, tiny on CPU
    python benchmarks/offload_gpu.py --config tiny --steps 3
    python benchmarks/offload_gpu.py --leaf-by-leaf   # adds the leaf-by-leaf variant
On CPU memory kinds are emulated: the numbers show that the code runs, savings are not
measurable (``memory_stats()`` is unavailable and host == device memory).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax import

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "offload_gpu.json"
GiB = 2**30


def _tree_bytes(tree):
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def run_variant(variant, config_name, batch, seq, steps):
    """Runs one variant in this process; returns a dict of measurements."""
    import jax
    import jax.numpy as jnp
    import optax

    from jmem import offload
    from jmem._src import master_weights
    from jmem.models import llama

    device = jax.devices()[0]
    config = llama.get_config(config_name)
    params = llama.init(jax.random.key(0), config, dtype=jnp.bfloat16)
    opt = master_weights.mixed_precision(optax.adamw(1e-4, weight_decay=0.1))
    if variant in ("offload", "leaf_by_leaf"):
        opt = offload(opt, leaf_by_leaf=variant == "leaf_by_leaf")
    state = opt.init(params)

    def step(state, params, batch):
        loss, grads = jax.value_and_grad(llama.loss_fn)(params, batch, config)
        updates, state = opt.update(grads, state, params)
        return state, optax.apply_updates(params, updates), loss

    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, config.vocab_size)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    jitted = jax.jit(step, donate_argnums=(0, 1))
    compiled = jitted.lower(state, params, data).compile()
    mem = compiled.memory_analysis()
    analysis = {
        k: int(getattr(mem, k))
        for k in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
            "host_argument_size_in_bytes",
            "host_output_size_in_bytes",
            "host_temp_size_in_bytes",
        )
        if mem is not None and hasattr(mem, k)
    }

    stats0 = device.memory_stats()
    times, losses = [], []
    for _ in range(steps + 1):  # first step after compile is a warm-up
        t0 = time.perf_counter()
        state, params, loss = compiled(state, params, data)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    stats = device.memory_stats()
    kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state)})
    return {
        "variant": variant,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "config": config_name,
        "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
        "param_bytes": _tree_bytes(params),
        "state_bytes": _tree_bytes(state),
        "state_memory_kinds": kinds,
        "bytes_in_use_between_steps": (stats0 or {}).get("bytes_in_use"),
        "peak_bytes_in_use": (stats or {}).get("peak_bytes_in_use"),
        "compiled_memory_analysis": analysis,
        "step_time_s_median": statistics.median(times[1:]),
        "step_times_s": times[1:],
        "losses": losses,
    }


def _fmt_gib(x):
    return "n/a" if x is None else f"{x / GiB:8.2f}"


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=None, help="llama config (default: llama_1b on GPU/TPU, tiny on CPU)"
    )
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--leaf-by-leaf", action="store_true", help="also run offload(..., leaf_by_leaf=True)"
    )
    parser.add_argument(
        "--single", choices=["baseline", "offload", "leaf_by_leaf"], help=argparse.SUPPRESS
    )
    args = parser.parse_args()

    if args.single:
        out = run_variant(args.single, args.config, args.batch, args.seq, args.steps)
        print("RESULT_JSON " + json.dumps(out))
        return

    import jax

    platform = jax.devices()[0].platform
    on_cpu = platform == "cpu"
    config = args.config or ("tiny" if on_cpu else "llama_1b")
    batch = args.batch or (2 if on_cpu else 4)
    seq = args.seq or (32 if on_cpu else 512)
    steps = args.steps or (3 if on_cpu else 10)

    results = {}
    variants = ("baseline", "offload") + (("leaf_by_leaf",) if args.leaf_by_leaf else ())
    for variant in variants:
        cmd = [
            sys.executable,
            __file__,
            "--single",
            variant,
            "--config",
            config,
            "--batch",
            str(batch),
            "--seq",
            str(seq),
            "--steps",
            str(steps),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT_JSON ")]
        if proc.returncode or not line:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"variant {variant} failed (rc={proc.returncode})")
        results[variant] = json.loads(line[0][len("RESULT_JSON ") :])

    base, off = results["baseline"], results["offload"]
    summary = {
        "state_bytes": base["state_bytes"],
        "step_time_ratio_offload_over_baseline": off["step_time_s_median"]
        / base["step_time_s_median"],
        "losses_equal": base["losses"] == off["losses"],
    }
    if base["peak_bytes_in_use"] is not None and off["peak_bytes_in_use"] is not None:
        drop = base["peak_bytes_in_use"] - off["peak_bytes_in_use"]
        summary["peak_drop_bytes"] = drop
        summary["peak_drop_over_state_bytes"] = drop / base["state_bytes"]
    if "leaf_by_leaf" in results:
        lbl = results["leaf_by_leaf"]
        summary["losses_equal_leaf_by_leaf"] = base["losses"] == lbl["losses"]
        summary["step_time_ratio_leaf_by_leaf_over_baseline"] = (
            lbl["step_time_s_median"] / base["step_time_s_median"]
        )
        if base["peak_bytes_in_use"] is not None and lbl["peak_bytes_in_use"] is not None:
            summary["peak_drop_leaf_by_leaf_bytes"] = (
                base["peak_bytes_in_use"] - lbl["peak_bytes_in_use"]
            )
    if base["bytes_in_use_between_steps"] is not None:
        summary["between_steps_drop_bytes"] = (
            base["bytes_in_use_between_steps"] - off["bytes_in_use_between_steps"]
        )

    print(
        f"\n{config} on {base['device_kind']} ({platform}): {base['num_params'] / 1e9:.3f}B "
        f"params, bf16 params + fp32 masters/Adam state, batch {batch} x seq {seq}, "
        f"median of {steps} steps"
    )
    print(
        f"{'variant':<12} {'state kind':<12} {'state GiB':>9} {'in use GiB':>10} "
        f"{'peak GiB':>9} {'XLA temp GiB':>12} {'host arg GiB':>12} {'step ms':>9}"
    )
    for r in results.values():
        a = r["compiled_memory_analysis"]
        print(
            f"{r['variant']:<12} {','.join(r['state_memory_kinds']):<12} "
            f"{r['state_bytes'] / GiB:9.2f} {_fmt_gib(r['bytes_in_use_between_steps']):>10} "
            f"{_fmt_gib(r['peak_bytes_in_use']):>9} {_fmt_gib(a.get('temp_size_in_bytes')):>12} "
            f"{_fmt_gib(a.get('host_argument_size_in_bytes')):>12} "
            f"{r['step_time_s_median'] * 1e3:9.1f}"
        )
    print(
        f"step time ratio offload/baseline: "
        f"{summary['step_time_ratio_offload_over_baseline']:.2f}x; "
        f"losses bitwise equal: {summary['losses_equal']}"
    )
    if "peak_drop_bytes" in summary:
        print(
            f"peak drop: {summary['peak_drop_bytes'] / GiB:.2f} GiB = "
            f"{summary['peak_drop_over_state_bytes']:.2f} x state bytes"
        )
    if "peak_drop_leaf_by_leaf_bytes" in summary:
        print(f"peak drop, leaf by leaf: {summary['peak_drop_leaf_by_leaf_bytes'] / GiB:.2f} GiB")
    if "leaf_by_leaf" in results:
        print(
            f"leaf by leaf: step time ratio "
            f"{summary['step_time_ratio_leaf_by_leaf_over_baseline']:.2f}x; losses bitwise "
            f"equal: {summary['losses_equal_leaf_by_leaf']}"
        )
    if on_cpu:
        summary["note"] = (
            "CPU run: memory kinds are emulated (host and device memory are the "
            "same RAM, memory_stats() is unavailable); savings are not "
            "measurable on CPU, only that offload runs and matches bitwise."
        )
        print(summary["note"])

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "config": config,
                "batch": batch,
                "seq": seq,
                "steps": steps,
                "platform": platform,
                "summary": summary,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
