#!/usr/bin/env bash
# GPU check for the main job: ~20 QLoRA steps of the Llama-2-7B config at seq 2048 on one
# GPU, printing peak device memory (memory_stats, preallocation off), tokens/s and MFU.
# Usage: bash benchmarks/qlora_7b_gpu.sh [extra examples/qlora_7b.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python -c "import jax; assert jax.default_backend() == 'gpu', 'needs a GPU: ' + jax.default_backend()"
python examples/qlora_7b.py --config llama2_7b --steps 20 --seq-len 2048 --batch-size 1 \
  --remat full --optimizer adamw_8bit --no-progress --save-every 1000 \
  --out benchmarks/results/qlora_7b_gpu "$@"
python - <<'PY'
import json
s = json.load(open("benchmarks/results/qlora_7b_gpu/summary.json"))
print(f"device {s['device']}: peak {s['peak_bytes'] / 2**30:.2f} GiB ({s['peak_source']}), "
      f"{s['tokens_per_s']:,.0f} tokens/s, MFU {s.get('mfu', float('nan')):.1%}, "
      f"loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}")
PY
