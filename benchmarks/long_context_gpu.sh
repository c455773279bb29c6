#!/usr/bin/env bash
# GPU check for long context: the longest sequence of a Llama-3.1-8B QLoRA r=32
# train step (NF4 base, 8-bit AdamW, batch 1) whose compiled device peak fits a 24 GB and an
# 80 GB budget, with remat "full" and "offload_inputs" (each layer's input in pinned_host),
# then a few real steps at that length: measured peak (memory_stats) and tokens/s.
# Random NF4 weights (no download). Confirms (or corrects) the planner's CPU-calibrated
# figures: python -m jmem estimate --model llama3_1_8b --quant nf4 --lora-rank 32
#   --lora-targets all --optimizer adamw_8bit --memory 24GB --max-seq
# Usage: bash benchmarks/long_context_gpu.sh [budgets in GB, default "24 80"]
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - "${@:-24 80}" <<'PY'
import json, os, sys, time
import jax, jax.numpy as jnp
import jmem
from jmem.models import llama

assert jax.default_backend() == "gpu", "needs a GPU: " + jax.default_backend()
budgets = [float(b) * 1e9 for b in " ".join(sys.argv[1:]).split()]
cfg = llama.get_config("llama3_1_8b")
frozen = jax.jit(lambda k: jmem.qlora.quantize_params(llama.init(k, cfg, jnp.bfloat16)))(
    jax.random.key(0))
adapters = jmem.lora.init(jax.random.key(1), frozen, rank=32, alpha=64.0,
                          modules=r"layers/.*_proj/kernel")

def step_for(remat):
    loss = lambda a, b, *, frozen: jmem.qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg))(
        frozen, a, b)
    return jmem.train_step(loss, jmem.adamw_8bit(1e-4), precision="p=f32,c=bf16,o=f32",
                           remat=remat)

def batch(seq, abstract):
    if abstract:
        return {k: jax.ShapeDtypeStruct((1, seq), jnp.int32) for k in ("inputs", "targets")}
    t = jax.random.randint(jax.random.key(seq), (1, seq + 1), 0, cfg.vocab_size, jnp.int32)
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}

def compiled_peak(step, state, seq):
    return step.measure(state, batch(seq, True)).peak_bytes

rows = []
for remat in ("full", "offload_inputs"):
    step = step_for(remat)
    state = step.init(adapters, frozen=frozen)
    abstract = step.abstract_state(adapters, frozen=frozen)
    for budget in budgets:
        lo, hi = 0, 1 << 20  # tokens, multiples of 4096
        while hi - lo > 4096:
            mid = (lo + hi) // 2 // 4096 * 4096
            try:
                ok = compiled_peak(step, abstract, mid) <= budget
            except Exception as e:  # an allocation the compiler refuses counts as no fit
                print(f"  {remat} {mid}: {type(e).__name__}")
                ok = False
            lo, hi = (mid, hi) if ok else (lo, mid)
        row = {"remat": remat, "budget_bytes": budget, "max_seq": lo}
        if lo:
            for d in jax.local_devices():
                d.memory_stats()  # touch
            b = batch(lo, False)
            state, _ = step(state, b)  # compile + warm-up
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            for _ in range(3):
                state, metrics = step(state, b)
            jax.block_until_ready(state)
            dt = (time.perf_counter() - t0) / 3
            stats = jax.local_devices()[0].memory_stats() or {}
            row.update(tokens_per_s=lo / dt, step_s=dt, peak_bytes_in_use=stats.get("peak_bytes_in_use"))
        print(row, flush=True)
        rows.append(row)
os.makedirs("benchmarks/results", exist_ok=True)
with open("benchmarks/results/long_context_gpu.json", "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=2)
print("wrote benchmarks/results/long_context_gpu.json")
PY
