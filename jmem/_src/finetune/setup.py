"""Before anything is read or compiled: the model's shape, sizes for the model and the
device, the LoRA targets, the tokenizer and the outputs, each checked with a one-line error
naming its flag."""

from __future__ import annotations

import os

import jax

import jmem
from jmem import data as jdata
from jmem import lora as jlora
from jmem._src.cli import CliError
from jmem._src.cli import user_input
from jmem.models import export
from jmem.models import hf
from jmem.models import llama

#: Unset sizes: "small" for `tiny` and for any training run on a CPU, "large" on a GPU and
#: for --dry-run plans of a bigger model. The sequence length is capped at the model's.
DEFAULTS = {
    "small": {"steps": 200, "batch_size": 16, "seq_len": 128},
    "large": {"steps": 20, "batch_size": 1, "seq_len": 2048},
}


def model_config(config) -> llama.LlamaConfig:
    """The model (its identity only): its shape from ``--checkpoint``'s config.json, else
    ``--config`` (whose default depends on the device). How it runs is ``job_levers``."""
    return _model_shape(config)


def job_levers(config) -> jmem.Levers:
    """The run's execution settings as one ``jmem.Levers``: ``--remat``, ``--attention``,
    ``--loss-chunk`` and ``--mlp-chunk`` (resolved per batch and target by ``build``)."""
    return jmem.Levers(
        remat=config.remat,
        attention=config.attention,
        loss_chunk=config.loss_chunk,
        token_chunk=config.mlp_chunk,
    )


def _model_shape(config) -> llama.LlamaConfig:
    """The model's shape: from ``--checkpoint``'s config.json, else ``--config``."""
    if config.checkpoint is not None:
        if not os.path.isdir(config.checkpoint):
            raise CliError(
                f"--checkpoint {config.checkpoint}: no such directory; pass a Hugging Face "
                "checkpoint directory (config.json + *.safetensors)"
            )
        with user_input(f"--checkpoint {config.checkpoint}", (OSError, ValueError, KeyError)):
            return hf.load_config(config.checkpoint)
    if config.config is None:
        config.config = "llama2_7b" if jax.default_backend() == "gpu" else "tiny"
        if config.config == "tiny":
            print(
                "No GPU found: training the `tiny` config on CPU "
                "(use --config llama2_7b --dry-run to plan the 7B run).",
                flush=True,
            )
    return llama.get_config(config.config)


def resolve_defaults(config, cfg, *, on_gpu: bool) -> list[str]:
    """Fills unset sizes (``is None``, never ``or``): CPU-sized for `tiny` and for training
    on a CPU, 7B-sized on a GPU and for dry-run plans; the sequence length is capped at the
    model's ``max_seq_len``. Returns notes to print once every input is checked."""
    notes = []
    small = config.config == "tiny" or not (on_gpu or config.dry_run)
    d = DEFAULTS["small" if small else "large"]
    unset = [k for k in ("steps", "batch_size", "seq_len") if getattr(config, k) is None]
    for k in unset:
        setattr(config, k, min(d[k], cfg.max_seq_len) if k == "seq_len" else d[k])
    if config.lr is None:
        config.lr = 3e-3 if config.config == "tiny" else 2e-4
    if config.lora_alpha is None:
        config.lora_alpha = 2.0 * config.lora_rank
    if config.eval_every is None:
        config.eval_every = max(1, config.steps // 10)
    if config.batch_size % config.grad_accum:
        raise CliError(
            f"--grad-accum {config.grad_accum} does not divide the default --batch-size "
            f"{config.batch_size}; pass a --batch-size that it divides"
        )
    if unset and not on_gpu and not config.dry_run:
        notes.append(
            "CPU-sized defaults: "
            + ", ".join(f"--{k.replace('_', '-')} {getattr(config, k)}" for k in unset)
        )
    if config.seq_len > cfg.max_seq_len:
        notes.append(
            f"note: --seq-len {config.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}; "
            "positions past it were never trained."
        )
    return notes


def check_lora_targets(config, cfg) -> None:
    """Fails fast (before any weight is read) when ``--lora-targets`` matches no matrix."""
    with user_input(f"--lora-targets {config.lora_targets!r}"):
        jax.eval_shape(
            lambda: jlora.init(
                jax.random.key(0),
                llama.abstract_params(cfg),
                rank=config.lora_rank,
                alpha=config.lora_alpha,
                targets=config.lora_targets,
            )
        )


def make_tokenizer(config, cfg):
    """``--tokenizer``: 'byte', a directory with tokenizer.json, or (unset) the checkpoint's."""
    given = config.tokenizer is not None
    config.tokenizer = config.tokenizer if given else (config.checkpoint or "byte")
    from_ckpt = not given and config.checkpoint is not None
    flag = f"--checkpoint {config.checkpoint}" if from_ckpt else f"--tokenizer {config.tokenizer}"
    if config.tokenizer == "byte":
        tok = jdata.ByteTokenizer()
    elif not os.path.isdir(config.tokenizer):
        raise CliError(f"{flag}: no such directory; pass 'byte' or a directory with tokenizer.json")
    elif not os.path.exists(os.path.join(config.tokenizer, "tokenizer.json")):
        byte = " or --tokenizer byte (UTF-8 bytes, vocabulary 256)" if cfg.vocab_size >= 256 else ""
        raise CliError(
            f"{flag} has no tokenizer.json; pass --tokenizer DIR (a directory with the "
            f"model's tokenizer.json){byte}"
        )
    else:
        with user_input(flag, Exception):  # tokenizers raises plain Exception
            tok = jdata.HFTokenizer(config.tokenizer)
    if tok.vocab_size > cfg.vocab_size:
        model = (
            f"--checkpoint {config.checkpoint}"
            if config.checkpoint
            else f"--config {config.config}"
        )
        raise CliError(
            f"{flag}: its {tok.vocab_size} tokens exceed the vocabulary of the model "
            f"({model}: {cfg.vocab_size}); pass the model's own tokenizer with --tokenizer DIR"
        )
    if config.checkpoint and config.tokenizer == "byte":
        print("note: byte tokens with a pretrained checkpoint do not match its vocabulary.")
    return tok


def check_outputs(config, cfg, tok) -> None:
    """Fails before training for what would fail after it: a model --export-merged cannot
    write, a --sample-prompt with no tokens."""
    if config.export_merged:
        with user_input(f"--export-merged {config.export_merged}"):
            export.hf_config(cfg)
    if config.sample_prompt is not None and not len(tok.encode(config.sample_prompt)):
        raise CliError("--sample-prompt: the text has no tokens; pass a non-empty prompt")
