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
(`--debug` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmem
from jmem import Checkpointer
from jmem import DynamicLossScale
from jmem import MemoryReport
from jmem import NoOpLossScale
from jmem import adamw_4bit
from jmem import adamw_8bit
from jmem import data as jdata
from jmem import lora as jlora
from jmem import nf4
from jmem import planner
from jmem import qlora
from jmem.models import export
from jmem.models import hf
from jmem.models import llama

OPTIMIZERS = {"adamw_8bit": adamw_8bit, "adamw_4bit": adamw_4bit, "adamw": optax.adamw}

#: Unset sizes: "small" for `tiny` and for any training run on a CPU, "large" on a GPU and
#: for --dry-run plans of a bigger model. The sequence length is capped at the model's.
DEFAULTS = {
    "small": {"steps": 200, "batch_size": 16, "seq_len": 128},
    "large": {"steps": 20, "batch_size": 1, "seq_len": 2048},
}

#: Flags that must match the run in --out for --resume (they shape the state or the data).
RESUME_FLAGS = (
    "config",
    "checkpoint",
    "data",
    "tokenizer",
    "seq_len",
    "batch_size",
    "grad_accum",
    "optimizer",
    "precision",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "eval_split",
    "seed",
)

format_bytes = MemoryReport.format_bytes


class CliError(Exception):
    """A bad input: ``main`` prints ``error: <message>`` on one line and exits with status 2."""


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line, ``error: ...``, exit status 2."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def _number(kind, ok, what):
    """An argparse type: ``kind(text)`` that satisfies ``ok``, else a message naming ``what``."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
nonnegative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: v > 0 and math.isfinite(v), "a positive number")
fraction = _number(float, lambda v: 0 <= v < 1, "a fraction in [0, 1)")


def regex(text):
    """An argparse type: a valid regular expression."""
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid regex ({e})") from None
    return text


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


@contextlib.contextmanager
def user_input(what: str, errors=(OSError, ValueError)):
    """Turns ``errors`` raised while reading ``what`` (a flag and its value) into a CliError."""
    try:
        yield
    except errors as e:
        raise CliError(f"{what}: {_one_line(e)}") from e


def _add_model_and_data_flags(p):
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--config",
        choices=sorted(llama.CONFIGS),
        help="model shape; unset: llama2_7b on GPU, tiny on CPU",
    )
    which.add_argument(
        "--checkpoint", help="Hugging Face checkpoint directory (config.json + *.safetensors)"
    )
    p.add_argument(
        "--tokenizer",
        help="'byte' (UTF-8 bytes, vocabulary 256) or a directory with tokenizer.json; "
        "unset: the checkpoint's own, else byte",
    )
    p.add_argument(
        "--data",
        help=".txt (one text) or .jsonl (examples: text, prompt/completion, Alpaca or chat "
        "messages; loss on the responses only); default: pydoc_data.topics (CPython docs)",
    )
    p.add_argument(
        "--eval-split",
        type=fraction,
        default=0.05,
        help="fraction of the data held out for evaluation (0: no evaluation)",
    )
    p.add_argument(
        "--eval-every", type=positive_int, help="steps between evaluations; unset: steps / 10"
    )
    p.add_argument(
        "--eval-batches", type=positive_int, default=4, help="held-out batches per evaluation"
    )


def _add_training_flags(p):
    p.add_argument("--steps", type=positive_int, help="optimizer steps; unset: 200 small, 20 large")
    p.add_argument(
        "--batch-size", type=positive_int, help="sequences per step; unset: 16 small, 1 large"
    )
    p.add_argument(
        "--seq-len", type=positive_int, help="tokens per sequence; unset: 128 small, 2048 large"
    )
    p.add_argument("--grad-accum", type=positive_int, default=1, help="microbatches per step")
    p.add_argument(
        "--remat", default="full", choices=list(jmem.REMAT_POLICIES), help="remat policy"
    )
    p.add_argument(
        "--optimizer", default="adamw_8bit", choices=sorted(OPTIMIZERS), help="optimizer"
    )
    p.add_argument(
        "--lr",
        type=positive_float,
        help="peak learning rate; unset: 3e-3 for tiny (random init), 2e-4 otherwise",
    )
    p.add_argument(
        "--weight-decay",
        type=_number(float, lambda v: v >= 0, "a number >= 0"),
        default=0.0,
        help="decoupled weight decay on the adapter matrices (jmem.decay_mask)",
    )
    p.add_argument("--lora-rank", type=positive_int, default=8, help="LoRA rank r")
    p.add_argument("--lora-alpha", type=positive_float, help="LoRA alpha; unset: 2 * rank")
    p.add_argument(
        "--lora-targets",
        type=regex,
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
    p.add_argument("--seed", type=nonnegative_int, default=0)


def _add_run_flags(p):
    p.add_argument("--out", default="runs/qlora_7b", help="output directory")
    p.add_argument("--save-every", type=positive_int, default=100, help="steps between checkpoints")
    p.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept")
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last checkpoint"
    )
    again.add_argument(
        "--overwrite", action="store_true", help="replace the run in --out (its checkpoints too)"
    )
    p.add_argument(
        "--export-merged",
        metavar="DIR",
        help="after training, write the base with the adapters merged in as a Hugging Face "
        "checkpoint (the NF4 base dequantized, so its quantization error stays); the adapters "
        "alone are always written to --out/adapter in PEFT format",
    )
    p.add_argument(
        "--sample-prompt",
        metavar="TEXT",
        help="print a greedy continuation of TEXT before and after training",
    )
    p.add_argument("--sample-tokens", type=positive_int, default=32, help="tokens in each sample")
    p.add_argument(
        "--dry-run", action="store_true", help="compile only; print memory report and estimate"
    )
    p.add_argument(
        "--no-progress", action="store_true", help="plain log lines instead of a progress bar"
    )
    p.add_argument("--debug", action="store_true", help="a traceback instead of a one-line error")


def parse_args(argv=None):
    """Flags, each checked for its type and range (sizes and counts are positive integers);
    unset sizes stay None until ``resolve_defaults`` knows the model and the device."""
    p = _Parser(
        prog="qlora_7b.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_and_data_flags(p)
    _add_training_flags(p)
    _add_run_flags(p)
    args = p.parse_args(argv)
    if args.batch_size is not None and args.batch_size % args.grad_accum:
        p.error(
            f"--batch-size {args.batch_size} must be divisible by --grad-accum {args.grad_accum}"
        )
    return args


def model_config(args) -> llama.LlamaConfig:
    """The model's shape: from ``--checkpoint``'s config.json, else ``--config`` (whose
    default depends on the device)."""
    if args.checkpoint is not None:
        if not os.path.isdir(args.checkpoint):
            raise CliError(
                f"--checkpoint {args.checkpoint}: no such directory; pass a Hugging Face "
                "checkpoint directory (config.json + *.safetensors)"
            )
        with user_input(f"--checkpoint {args.checkpoint}", (OSError, ValueError, KeyError)):
            return hf.load_config(args.checkpoint)
    if args.config is None:
        args.config = "llama2_7b" if jax.default_backend() == "gpu" else "tiny"
        if args.config == "tiny":
            print(
                "No GPU found: training the `tiny` config on CPU "
                "(use --config llama2_7b --dry-run to plan the 7B run).",
                flush=True,
            )
    return llama.get_config(args.config)


def resolve_defaults(args, cfg, *, on_gpu: bool) -> list[str]:
    """Fills unset sizes (``is None``, never ``or``): CPU-sized for `tiny` and for training
    on a CPU, 7B-sized on a GPU and for dry-run plans; the sequence length is capped at the
    model's ``max_seq_len``. Returns notes to print once every input is checked."""
    notes = []
    small = args.config == "tiny" or not (on_gpu or args.dry_run)
    d = DEFAULTS["small" if small else "large"]
    unset = [k for k in ("steps", "batch_size", "seq_len") if getattr(args, k) is None]
    for k in unset:
        setattr(args, k, min(d[k], cfg.max_seq_len) if k == "seq_len" else d[k])
    if args.lr is None:
        args.lr = 3e-3 if args.config == "tiny" else 2e-4
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_rank
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 10)
    if args.batch_size % args.grad_accum:
        raise CliError(
            f"--grad-accum {args.grad_accum} does not divide the default --batch-size "
            f"{args.batch_size}; pass a --batch-size that it divides"
        )
    if unset and not on_gpu and not args.dry_run:
        notes.append(
            "CPU-sized defaults: "
            + ", ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in unset)
        )
    if args.seq_len > cfg.max_seq_len:
        notes.append(
            f"note: --seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}; "
            "positions past it were never trained."
        )
    return notes


def check_lora_targets(args, cfg) -> None:
    """Fails fast (before any weight is read) when ``--lora-targets`` matches no matrix."""
    with user_input(f"--lora-targets {args.lora_targets!r}"):
        jax.eval_shape(
            lambda: jlora.init(
                jax.random.key(0),
                llama.abstract_params(cfg),
                rank=args.lora_rank,
                alpha=args.lora_alpha,
                targets=args.lora_targets,
            )
        )


def make_tokenizer(args, cfg):
    """``--tokenizer``: 'byte', a directory with tokenizer.json, or (unset) the checkpoint's."""
    given = args.tokenizer is not None
    args.tokenizer = args.tokenizer if given else (args.checkpoint or "byte")
    from_ckpt = not given and args.checkpoint is not None
    flag = f"--checkpoint {args.checkpoint}" if from_ckpt else f"--tokenizer {args.tokenizer}"
    if args.tokenizer == "byte":
        tok = jdata.ByteTokenizer()
    elif not os.path.isdir(args.tokenizer):
        raise CliError(f"{flag}: no such directory; pass 'byte' or a directory with tokenizer.json")
    elif not os.path.exists(os.path.join(args.tokenizer, "tokenizer.json")):
        byte = " or --tokenizer byte (UTF-8 bytes, vocabulary 256)" if cfg.vocab_size >= 256 else ""
        raise CliError(
            f"{flag} has no tokenizer.json; pass --tokenizer DIR (a directory with the "
            f"model's tokenizer.json){byte}"
        )
    else:
        with user_input(flag, Exception):  # tokenizers raises plain Exception
            tok = jdata.HFTokenizer(args.tokenizer)
    if tok.vocab_size > cfg.vocab_size:
        model = f"--checkpoint {args.checkpoint}" if args.checkpoint else f"--config {args.config}"
        raise CliError(
            f"{flag}: its {tok.vocab_size} tokens exceed the vocabulary of the model "
            f"({model}: {cfg.vocab_size}); pass the model's own tokenizer with --tokenizer DIR"
        )
    if args.checkpoint and args.tokenizer == "byte":
        print("note: byte tokens with a pretrained checkpoint do not match its vocabulary.")
    return tok


def load_datasets(args, tok):
    """``(train, eval or None)`` from ``--data``: a .jsonl file of examples (text,
    prompt/completion, Alpaca or chat messages; loss on the responses only), else text (a
    .txt file or the default corpus) as one token stream. ``--eval-split`` is held out."""
    if args.data is not None and not os.path.isfile(args.data):
        raise CliError(f"--data {args.data}: no such file; pass a .txt or .jsonl file")
    if args.data is not None and args.data.endswith(".jsonl"):
        return _example_datasets(args, tok)
    flag = f"--data {args.data}" if args.data else "the default corpus"
    with user_input(flag):
        text = jdata.load_text(args.data)
    if not text.strip():
        raise CliError(f"{flag}: the file holds no text; pass a non-empty .txt or .jsonl file")
    tokens = tok.encode(text)
    n_eval = int(len(tokens) * args.eval_split)
    need = args.batch_size * (args.seq_len + 1)
    if len(tokens) - n_eval < need:
        raise CliError(
            f"{flag}: {len(tokens) - n_eval:,} training tokens, fewer than one batch of "
            f"--batch-size {args.batch_size} x (--seq-len {args.seq_len} + 1) = {need:,}; "
            "pass more text or smaller --batch-size/--seq-len"
        )
    if args.eval_split and n_eval < need:
        raise CliError(
            f"--eval-split {args.eval_split}: holds out {n_eval:,} tokens, fewer than one "
            f"batch ({need:,}); raise it, pass smaller sizes, or --eval-split 0 for no evaluation"
        )
    cut = len(tokens) - n_eval  # the tail is held out: no window straddles the two
    train = jdata.PackedDataset(tokens[:cut], args.seq_len, args.batch_size, seed=args.seed)
    held = None
    if n_eval:
        held = jdata.PackedDataset(tokens[cut:], args.seq_len, args.batch_size, seed=args.seed)
    return train, held


def _example_datasets(args, tok):
    """Examples packed into rows (``jmem.data.pack_examples``); a seeded shuffle of the
    examples, then the last ``--eval-split`` of them held out."""
    flag = f"--data {args.data}"
    with user_input(flag):
        examples = jdata.load_examples(args.data)
    order = np.random.default_rng([args.seed, len(examples)]).permutation(len(examples))
    examples = [examples[i] for i in order]
    n_eval = int(len(examples) * args.eval_split)
    if args.eval_split and n_eval == 0:
        raise CliError(
            f"--eval-split {args.eval_split}: holds out none of the {len(examples)} examples; "
            "raise it, or pass --eval-split 0 for no evaluation"
        )
    cut = len(examples) - n_eval
    with user_input(flag):
        train = jdata.PackedDataset.from_examples(
            examples[:cut], tok, args.seq_len, args.batch_size, seed=args.seed
        )
    held = None
    if n_eval:
        what = f"--eval-split {args.eval_split} (held-out examples of {args.data})"
        try:
            held = jdata.PackedDataset.from_examples(
                examples[cut:], tok, args.seq_len, args.batch_size, seed=args.seed
            )
        except ValueError as e:
            raise CliError(
                f"{what}: {_one_line(e)} Or raise --eval-split, or pass --eval-split 0 "
                "for no evaluation."
            ) from e
    return train, held


def flags(args) -> dict:
    """The run's flags as resolved (defaults filled in), for run.json and summary.json."""
    skip = ("resume", "overwrite", "debug", "no_progress", "dry_run")
    return {k: v for k, v in vars(args).items() if k not in skip}


def _checkpoint_steps(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def prepare_out(args) -> int | None:
    """Checks ``--out`` against ``--resume``/``--overwrite``; returns the step to resume
    from (None for a new run). A new run never mixes with another run's checkpoints."""
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise CliError(f"--out {out} is a file; pass a directory")
    merged = args.export_merged
    if merged and os.path.exists(merged) and (not os.path.isdir(merged) or os.listdir(merged)):
        raise CliError(f"--export-merged {merged} exists and is not empty; pass a new directory")
    ckpt_dir = os.path.join(out, "checkpoints")
    steps = _checkpoint_steps(ckpt_dir)
    record = os.path.join(out, "run.json")
    if args.resume:
        if not steps:
            raise CliError(
                f"--resume: no checkpoint in {ckpt_dir}; run without --resume to start a run"
            )
        _check_same_run(args, record)
        return steps[-1]
    previous = steps or os.path.exists(record) or os.path.exists(os.path.join(out, "summary.json"))
    if previous and not args.overwrite:
        at = f" (checkpoints at steps {steps})" if steps else ""
        raise CliError(
            f"--out {out} already holds a run{at}; pass --resume to continue it, "
            "--overwrite to replace it, or another --out"
        )
    if previous:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        shutil.rmtree(os.path.join(out, "adapter"), ignore_errors=True)
        for name in ("run.json", "summary.json", "loss.png"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out, name))
    return None


def _check_same_run(args, record: str) -> None:
    """--resume: the flags that shape the state and the data must match run.json's."""
    if not os.path.exists(record):
        return
    with open(record) as f:
        before = json.load(f)
    now = flags(args)
    diff = [
        f"--{k.replace('_', '-')} {now[k]} (was {before[k]})"
        for k in RESUME_FLAGS
        if k in before and before[k] != now.get(k)
    ]
    if diff:
        raise CliError(
            f"--resume: this run's flags differ from the run in --out {args.out}: "
            f"{', '.join(diff)}; pass the same flags, or --overwrite to start over"
        )
    if before.get("steps") != args.steps:
        print(
            f"note: --steps {args.steps} (was {before.get('steps')}): the learning-rate "
            f"schedule now decays over {args.steps} steps.",
            flush=True,
        )


def build(args, cfg):
    """The train step, the loss, the compute dtype and the learning-rate schedule; shared by
    training and the dry run."""
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
    opt = OPTIMIZERS[args.optimizer](schedule, weight_decay=args.weight_decay, mask=jmem.decay_mask)
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
    return step, loss_fn, dtype, schedule


def quantized_base(args, cfg, dtype, abstract: bool):
    """NF4 base params: from a checkpoint, or random (quantized on the device, in one jit)."""
    if args.checkpoint:
        if abstract:
            return jax.eval_shape(lambda: qlora.quantize_params(llama.abstract_params(cfg, dtype)))
        with user_input(f"--checkpoint {args.checkpoint}"):
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


def model_name(args) -> str:
    return args.config or os.path.basename(os.path.normpath(args.checkpoint))


def dry_run(args, cfg):
    step, _, dtype, _ = build(args, cfg)
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
        f"\n{model_name(args)}: {llama.num_params(cfg) / 1e9:.2f}B params, "
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
        "checkpoint": args.checkpoint,
        "model": dataclasses.asdict(cfg),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "compiled": dataclasses.asdict(report),
        "estimate": est.as_dict(),
        "nf4_bytes_per_param": q_bytes / q_count,
        "trainable_params": n_adapter,
        "args": flags(args),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dry_run.json"), "w") as f:
        json.dump(out, f, indent=2)
    return out


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


class Evaluator:
    """Loss over a fixed set of held-out batches (the first ``--eval-batches`` of the
    held-out split), with the adapters cast to the compute dtype as the train step does."""

    def __init__(self, step, loss_fn, held, n_batches: int):
        n = min(n_batches, held.batches_per_epoch)
        self.batches = [held.batch_at(jdata.Position(0, i * held.batch_size))[0] for i in range(n)]

        def eval_loss(params, frozen, batch):
            if step.precision is not None:
                params = step.precision.cast_to_compute(params)
            return loss_fn(params, batch, frozen=frozen)

        self._loss = jax.jit(eval_loss)

    def __call__(self, state) -> float:
        """The held-out loss: batch means weighted by their trained-on target tokens."""
        losses = [float(self._loss(state.params, state.frozen, b)) for b in self.batches]
        weights = [float(np.sum(b["mask"])) if "mask" in b else 1.0 for b in self.batches]
        return float(np.average(losses, weights=weights)) if sum(weights) else float("nan")


def _meta(args, pos, losses, evals) -> dict:
    return {
        "data": pos.to_dict(),
        "losses": losses,
        "eval_losses": evals,
        "seed": args.seed,
        "args": flags(args),
    }


def _init_state(args, cfg, step, dtype, ckpt, resume_step):
    """The train state (restored with ``--resume``), the data position and the histories."""
    frozen = quantized_base(args, cfg, dtype, abstract=False)
    adapters = jlora.init(
        jax.random.key(args.seed + 1),
        frozen,
        rank=args.lora_rank,
        alpha=args.lora_alpha,
        targets=args.lora_targets,
    )
    state = step.init(adapters, frozen=frozen)
    pos, losses, evals = jdata.Position(), [], []
    if resume_step is not None:
        state, meta = ckpt.restore(state)
        pos = jdata.Position.from_dict(meta["data"])
        losses = list(meta.get("losses", []))
        evals = [list(e) for e in meta.get("eval_losses", [])]
        print(f"Resumed at step {int(state.step)} (data epoch {pos.epoch}, index {pos.index}).")
    return state, pos, losses, evals, jlora.num_trainable(adapters)


class Progress:
    """A tqdm bar, or (``--no-progress``) a log line every 10 steps."""

    def __init__(self, args, start: int):
        self.bar = None
        if not args.no_progress:
            from tqdm.auto import tqdm  # noqa: PLC0415

            self.bar = tqdm(total=args.steps, initial=start, desc="qlora", dynamic_ncols=True)
        self.start = start

    def update(self, s, loss, evals, lr, tps, mem):
        ev = evals[-1][1] if evals else None
        if self.bar is not None:
            post = {"loss": f"{loss:.3f}"}
            if ev is not None:
                post["eval"] = f"{ev:.3f}"
            post.update(lr=f"{lr:.1e}", tok_s=f"{tps:,.0f}", mem=format_bytes(mem))
            self.bar.set_postfix(post)
            self.bar.update(1)
        elif (s + 1) % 10 == 0 or s == self.start or (evals and evals[-1][0] == s + 1):
            print(
                f"step {s + 1:5d}  loss {loss:.4f}"
                + (f"  eval {ev:.4f}" if ev is not None else "")
                + f"  lr {lr:.2e}  {tps:,.0f} tok/s  mem {format_bytes(mem)}",
                flush=True,
            )

    def close(self):
        if self.bar is not None:
            self.bar.close()


def train(args, cfg, tok, ds, held, resume_step):
    step, loss_fn, dtype, schedule = build(args, cfg)
    ckpt = Checkpointer(
        os.path.join(os.path.abspath(args.out), "checkpoints"),
        save_every=args.save_every,
        keep=args.keep,
    )
    state, pos, losses, evals, n_adapter = _init_state(args, cfg, step, dtype, ckpt, resume_step)
    evaluate = Evaluator(step, loss_fn, held, args.eval_batches) if held is not None else None
    start = int(state.step)
    # Compile once; the same executable gives the memory report and runs every step.
    t0 = time.perf_counter()
    compiled = step.jitted.lower(state, ds.batch_at(pos)[0]).compile()
    compiled_peak = MemoryReport.from_compiled(compiled).peak_bytes
    print(
        f"compiled the train step in {time.perf_counter() - t0:.1f}s; "
        f"compiled peak {format_bytes(compiled_peak)}",
        flush=True,
    )
    lrs = np.asarray(schedule(jnp.arange(args.steps)), np.float64).tolist()
    if evaluate is not None and start == 0:
        evals.append([0, evaluate(state)])
    sample = Sampler(args, cfg, tok, step) if args.sample_prompt is not None else None
    if sample is not None:
        sample(state, f"before (step {start})")
    tokens_per_step = args.batch_size * args.seq_len
    progress = Progress(args, start)
    times, it = [], ds.iterate(pos)
    for s in range(start, args.steps):
        batch, pos = next(it)
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        loss = float(metrics["loss"])  # blocks until the step is done
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if evaluate is not None and ((s + 1) % args.eval_every == 0 or s + 1 == args.steps):
            evals.append([s + 1, evaluate(state)])
        tps = tokens_per_step / np.median(times[1:] or times)  # the first call warms up
        progress.update(s, loss, evals, lrs[s], tps, device_memory() or compiled_peak)
        ckpt.maybe_save(s + 1, state, _meta(args, pos, losses, evals))
    progress.close()
    if args.steps not in ckpt.all_steps():
        ckpt.save(args.steps, state, _meta(args, pos, losses, evals))  # always keep the last
    ckpt.close()
    if sample is not None:
        sample(state, f"after (step {args.steps})")
    save_adapters(args, cfg, state)
    tps = tokens_per_step / float(np.median(times[1:])) if len(times) > 1 else None
    summary = finish(args, cfg, losses, evals, lrs, tps, n_adapter, compiled_peak)
    if sample is not None:
        summary["samples"] = sample.texts
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def check_outputs(args, cfg, tok) -> None:
    """Fails before training for what would fail after it: a model --export-merged cannot
    write, a --sample-prompt with no tokens."""
    if args.export_merged:
        with user_input(f"--export-merged {args.export_merged}"):
            export.hf_config(cfg)
    if args.sample_prompt is not None and not len(tok.encode(args.sample_prompt)):
        raise CliError("--sample-prompt: the text has no tokens; pass a non-empty prompt")


class Sampler:
    """``--sample-prompt``: the greedy continuation under the current adapters (NF4 base and
    adapters through ``jmem.qlora.apply``, as in training; ``jmem.models.llama.generate``)."""

    def __init__(self, args, cfg, tok, step):
        self.args, self.cfg, self.tok, self.step = args, cfg, tok, step
        self.prompt = jnp.asarray(tok.encode(args.sample_prompt), jnp.int32)[None]
        self.texts = {}

    def __call__(self, state, when: str) -> str:
        adapters = state.params
        if self.step.precision is not None:
            adapters = self.step.precision.cast_to_compute(adapters)
        out = llama.generate(
            state.frozen,
            self.prompt,
            self.cfg,
            max_new_tokens=self.args.sample_tokens,
            adapters=adapters,
            apply=qlora.apply,
        )
        text = self.tok.decode(np.asarray(out[0, self.prompt.shape[1] :]))
        self.texts[when] = text
        print(f"sample {when}: {self.args.sample_prompt!r} -> {text!r}", flush=True)
        return text


def save_adapters(args, cfg, state) -> None:
    """The adapters in PEFT format in --out/adapter; with --export-merged, the merged model
    as a Hugging Face checkpoint (written tensor by tensor, jmem.models.hf.save_params)."""
    base = os.path.abspath(args.checkpoint) if args.checkpoint else None
    path = os.path.join(args.out, "adapter")
    try:
        hf.save_adapters(path, state.params, cfg, base_model_name_or_path=base)
        print(f"adapters (PEFT format): {path}", flush=True)
    except ValueError as e:  # e.g. targets PEFT's Llama has no module for (embeddings)
        print(f"note: adapters not written in PEFT format: {_one_line(e)}", flush=True)
    if args.export_merged:
        with user_input(f"--export-merged {args.export_merged}"):
            hf.save_params(args.export_merged, state.frozen, cfg, adapters=state.params)
        print(f"merged checkpoint (Hugging Face format): {args.export_merged}", flush=True)


def finish(args, cfg, losses, evals, lrs, tokens_per_s, n_adapter, compiled_peak):
    """summary.json, the plot and the closing line."""
    summary = {
        "config": args.config,
        "checkpoint": os.path.abspath(args.checkpoint) if args.checkpoint else None,
        "model": dataclasses.asdict(cfg),
        "data": os.path.abspath(args.data) if args.data else "pydoc_data.topics",
        "tokenizer": args.tokenizer,
        "args": flags(args),
        "steps": args.steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "eval_losses": evals,
        "last_eval_loss": evals[-1][1] if evals else None,
        "tokens_per_s": tokens_per_s,
        "peak_bytes": device_memory() or compiled_peak,
        "peak_source": "device memory_stats" if device_memory() else "compiled (jmem.measure)",
        "trainable_params": n_adapter,
        "losses": losses,
        "learning_rates": lrs,
        "device": jax.devices()[0].device_kind,
    }
    peak = peak_flops()
    if summary["tokens_per_s"] and peak:
        fpt = train_flops_per_token(cfg, args.seq_len, summary["trainable_params"])
        summary["mfu"] = summary["tokens_per_s"] * fpt / peak
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot = os.path.join(args.out, "loss.png")
    plot_losses(losses, evals, lrs, plot, f"QLoRA {model_name(args)}")
    ev = f"; eval loss {evals[-1][1]:.4f}" if evals else ""
    print(
        f"\nfirst loss {losses[0]:.4f} -> last loss {losses[-1]:.4f} over {len(losses)} "
        f"steps{ev}; {tokens_per_s or 0:,.0f} tokens/s; peak "
        f"{format_bytes(summary['peak_bytes'])} ({summary['peak_source']}); curve: {plot}"
        + (f"; MFU {summary['mfu']:.1%}" if "mfu" in summary else "")
    )
    return summary


def plot_losses(losses, evals, lrs, path, title):
    """Training loss per step, held-out loss at its steps, learning rate on a second axis;
    integer step ticks."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    steps = np.arange(1, len(losses) + 1)
    lines = ax.plot(steps, losses, label="train loss")
    if evals:
        e = np.asarray(evals, np.float64)
        lines += ax.plot(e[:, 0], e[:, 1], "o-", label="eval loss (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lines += lr_ax.plot(steps, lrs[: len(losses)], "--", color="gray", label="learning rate")
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args):
    """Checks every input (before any weight is read or step compiled), then plans or trains."""
    cfg = model_config(args)
    notes = resolve_defaults(args, cfg, on_gpu=jax.default_backend() == "gpu")
    check_lora_targets(args, cfg)
    if not args.dry_run:
        tok = make_tokenizer(args, cfg)
        ds, held = load_datasets(args, tok)
        check_outputs(args, cfg, tok)
        resume_step = prepare_out(args)
    for line in notes:
        print(line, flush=True)
    if args.dry_run:
        return dry_run(args, cfg)
    if resume_step is not None and resume_step >= args.steps:
        print(f"Nothing to do: the checkpoint is at step {resume_step} >= --steps {args.steps}.")
        path = os.path.join(args.out, "summary.json")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        return None
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(flags(args), f, indent=2)
    return train(args, cfg, tok, ds, held, resume_step)


def main(argv=None):
    """Runs the example; a bad input exits with status 2 and one line ``error: ...``."""
    args = parse_args(argv)
    try:
        return run(args)
    except CliError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1:])
