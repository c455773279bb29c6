"""QLoRA fine-tuning of a Llama-2-7B-shaped model with every jmem memory lever on.

    python examples/qlora_7b.py                       # CPU: trains `tiny` on real text
    python examples/qlora_7b.py --config llama2_7b --dry-run --seq-len 2048 --batch-size 1
    python examples/qlora_7b.py --checkpoint /path/to/Llama-2-7b-hf   # GPU, real weights

Levers: frozen base in NF4 with double quantization (jmem.nf4 / jmem.qlora), LoRA adapters
as their own pytree (jmem.lora), activation remat per layer (jmem.remat), bf16 compute
(fp16 with dynamic loss scaling by flag), 8-bit AdamW states (jmem.adamw_8bit), gradient
accumulation, optional host offload of the optimizer state — composed by jmem.train_step.

Default config: `llama2_7b` when a GPU is present, `tiny` on CPU; a `--checkpoint` takes
its shapes from its config.json. Unset sizes are CPU-sized on a CPU (and for `tiny`),
7B-sized on a GPU and for `--dry-run` plans. `--dry-run` compiles the step from abstract
shapes (nothing is allocated) and prints the compiled memory next to the planner's
estimate. A run holds out `--eval-split` of the data and reports its loss every
`--eval-every` steps; it writes `run.json` (its flags), a loss/eval/learning-rate plot,
`summary.json` and orbax checkpoints (every `--save-every` steps, last `--keep`) under
`--out`; `--resume` continues exactly where the last checkpoint left off, and an `--out`
that holds another run is refused unless `--resume` or `--overwrite` is given. `--data` takes
text (.txt) or instruction/chat examples (.jsonl, loss on the responses only). At the end
the adapters are written in PEFT format to `--out/adapter`; `--export-merged DIR` writes the
merged model as a Hugging Face checkpoint; `--sample-prompt TEXT` prints a greedy
continuation before and after training.

A bad input exits with status 2 and one line `error: ...` naming the flag or file
(`--debug` shows the traceback instead). The job lives in `jmem.finetune` (also
`jmem finetune`, which takes `--config-file` too); this script only calls it.
"""

from jmem import finetune


def main(argv=None, restart_with_huge_pages=False):
    """Runs the job with this script's flags (``jmem.finetune.main``; ``argv`` None: the
    command line); returns the summary. ``restart_with_huge_pages``: the script's entry
    point only (on CPU, restarts the process once, before JAX starts, with glibc's
    huge-page tunable GLIBC_TUNABLES=glibc.malloc.hugetlb=1; faster steps)."""
    return finetune.main(argv, prog="qlora_7b.py", restart_with_huge_pages=restart_with_huge_pages)


if __name__ == "__main__":
    main(restart_with_huge_pages=True)
