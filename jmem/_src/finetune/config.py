"""The fine-tuning job's options: one dataclass (``FinetuneConfig``), the flags that set it
(``jmem finetune``, ``examples/qlora_7b.py``) and a config file (YAML or TOML) that flags
override, as torchtune's ``tune run`` and axolotl's ``config.yml`` do. Every value, from a
flag, a file or Python, is checked by the same argparse type."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib

from jmem._src import cli
from jmem._src.attention import IMPLEMENTATIONS
from jmem._src.finetune.build import OPTIMIZERS
from jmem._src.finetune.mesh import mesh_spec
from jmem._src.levers import Levers
from jmem._src.remat import REMAT_POLICIES
from jmem.models import llama

#: Default ``--lora-targets``: the seven projections of every layer (the QLoRA paper's).
ALL_PROJECTIONS = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*"


@dataclasses.dataclass
class FinetuneConfig:
    """Every option of the QLoRA fine-tuning job, named as its flag (``lora_rank`` is
    ``--lora-rank``); ``None`` means "sized for the model and the device" and is filled in
    by ``resolve_defaults``. See ``jmem finetune --help`` for each one."""

    # model and data
    config: str | None = None
    checkpoint: str | None = None
    tokenizer: str | None = None
    data: str | None = None
    eval_split: float = 0.05
    eval_every: int | None = None
    eval_batches: int = 4
    # training
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    grad_accum: int = 1
    remat: str = "full"
    optimizer: str = "adamw_8bit"
    lr: float | None = None
    weight_decay: float = 0.0
    lora_rank: int = 8
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: str = ALL_PROJECTIONS
    precision: str = "bf16"
    offload: bool = False
    attention: str = Levers.attention
    loss_chunk: int = Levers.loss_chunk
    mlp_chunk: int = Levers.token_chunk
    seed: int = 0
    host_allocator: str = "auto"
    # run
    out: str = "runs/qlora_7b"
    save_every: int = 100
    keep: int = 2
    resume: bool = False
    overwrite: bool = False
    export_merged: str | None = None
    sample_prompt: str | None = None
    sample_tokens: int = 32
    dry_run: bool = False
    no_progress: bool = False
    debug: bool = False
    # devices and hosts
    mesh: str | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


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
        type=cli.fraction,
        help="fraction of the data held out for evaluation (0: no evaluation); at least one "
        "row or example is held out when the data allows, else evaluation is skipped",
    )
    p.add_argument(
        "--eval-every", type=cli.positive_int, help="steps between evaluations; unset: steps / 10"
    )
    p.add_argument("--eval-batches", type=cli.positive_int, help="held-out batches per evaluation")


def _add_training_flags(p):
    p.add_argument(
        "--steps", type=cli.positive_int, help="optimizer steps; unset: 200 small, 20 large"
    )
    p.add_argument(
        "--batch-size", type=cli.positive_int, help="sequences per step; unset: 16 small, 1 large"
    )
    p.add_argument(
        "--seq-len", type=cli.positive_int, help="tokens per sequence; unset: 128 small, 2048 large"
    )
    p.add_argument("--grad-accum", type=cli.positive_int, help="microbatches per step")
    p.add_argument("--remat", choices=list(REMAT_POLICIES), help="remat policy")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="optimizer")
    p.add_argument(
        "--lr",
        type=cli.positive_float,
        help="peak learning rate; unset: 3e-3 for tiny (random init), 2e-4 otherwise",
    )
    p.add_argument(
        "--weight-decay",
        type=cli.nonnegative_float,
        help="decoupled weight decay on the adapter matrices (jmem.decay_mask)",
    )
    p.add_argument("--lora-rank", type=cli.positive_int, help="LoRA rank r")
    p.add_argument("--lora-alpha", type=cli.positive_float, help="LoRA alpha; unset: 2 * rank")
    p.add_argument(
        "--lora-dropout",
        type=cli.fraction,
        help="dropout on the adapters' input in training (PEFT's lora_dropout); a key per "
        "step and microbatch from --seed, none at evaluation",
    )
    p.add_argument(
        "--lora-targets",
        type=cli.regex,
        help="regex over weight paths (e.g. '.*(q_proj|v_proj).*' as in the QLoRA seed table)",
    )
    p.add_argument(
        "--precision",
        choices=["bf16", "fp16"],
        help="compute dtype; fp16 turns on dynamic loss scaling",
    )
    p.add_argument("--offload", action="store_true", help="optimizer state in pinned_host memory")
    p.add_argument(
        "--host-allocator",
        choices=["auto", "huge-pages", "retain", "system"],
        help="huge-pages: glibc's glibc.malloc.hugetlb=1 tunable (the command line restarts "
        "its process once to set it), so XLA:CPU's per-step temporaries sit in 2 MiB "
        "transparent huge pages (measured 1.28x faster with full remat, 1.45x without); "
        "retain: jmem.host.retain_host_allocations(), freed memory stays mapped (slower "
        "than huge pages with two cores); system: the C library's settings; auto "
        "(default): huge-pages unless a GPU/TPU plugin is installed. finetune.run() from "
        "Python changes none of them, it only reports",
    )
    p.add_argument(
        "--attention",
        choices=list(IMPLEMENTATIONS),
        help="attention implementation (auto: cuDNN on GPU where it can run, else dense up to "
        "1024 keys and blockwise beyond; jmem.ops.attention)",
    )
    p.add_argument(
        "--loss-chunk",
        type=cli.nonnegative_int,
        help="tokens per chunk of the cross-entropy (no [B, S, V] logits); 0: unchunked",
    )
    p.add_argument(
        "--mlp-chunk",
        type=cli.nonnegative_int,
        help="tokens per chunk of each layer's token-local parts: norms, projections, RoPE, "
        "MLP (tiled; no float32 [S, hidden] temporaries); 0: whole",
    )
    p.add_argument("--seed", type=cli.nonnegative_int)


def _add_run_flags(p):
    p.add_argument("--out", help="output directory")
    p.add_argument("--save-every", type=cli.positive_int, help="steps between checkpoints")
    p.add_argument("--keep", type=cli.positive_int, help="checkpoints kept")
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
    p.add_argument("--sample-tokens", type=cli.positive_int, help="tokens in each sample")
    p.add_argument(
        "--dry-run", action="store_true", help="compile only; print memory report and estimate"
    )
    p.add_argument(
        "--no-progress", action="store_true", help="plain log lines instead of a progress bar"
    )
    p.add_argument("--debug", action="store_true", help="a traceback instead of a one-line error")


def _add_device_flags(p):
    p.add_argument(
        "--mesh",
        type=mesh_spec,
        help="devices as data=N,fsdp=M (jmem.sharding: the NF4 base, optimizer state and batch "
        "split over fsdp, adapters replicated; data: replicas); unset: FSDP over every device",
    )
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="multi-process run: process 0's address for jax.distributed.initialize "
        "(unset: auto-detected under SLURM, or a single process)",
    )
    p.add_argument("--num-processes", type=cli.positive_int, help="processes of the run")
    p.add_argument("--process-id", type=cli.nonnegative_int, help="this process's index")


def add_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every ``FinetuneConfig`` option as a flag (defaults from the dataclass) and
    ``--config-file``; returns ``p``."""
    p.add_argument(
        "--config-file",
        metavar="FILE",
        help="a YAML (.yaml/.yml) or TOML (.toml) file of options named as the flags "
        "(lora_rank: 16 or lora-rank: 16); flags given on the command line override it",
    )
    _add_model_and_data_flags(p)
    _add_training_flags(p)
    _add_run_flags(p)
    _add_device_flags(p)
    p.set_defaults(**dataclasses.asdict(FinetuneConfig()))
    return p


def make_parser(prog: str, description: str | None = None) -> cli.Parser:
    """The job's parser: one-line usage errors (status 2), defaults shown in --help."""
    p = cli.Parser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    return add_flags(p)


def _actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions if a.dest in _FIELDS}


_FIELDS = tuple(f.name for f in dataclasses.fields(FinetuneConfig))


def check_value(action: argparse.Action, key: str, value, where: str = ""):
    """``value`` checked (and converted) by the flag's own type and choices.

    Raises:
      CliError: ``"<where><key>: <what was wrong>"`` on one line.
    """
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise cli.CliError(f"{where}{key}: expected true or false, got {value!r}")
        return value
    if value is None:
        if action.default is not None:
            raise cli.CliError(f"{where}{key}: must be set (default {action.default!r})")
        return None
    if isinstance(value, (bool, list, dict)):
        raise cli.CliError(f"{where}{key}: expected a single value, got {value!r}")
    out = str(value)
    if action.type is not None:
        try:
            out = action.type(out)
        except argparse.ArgumentTypeError as e:
            raise cli.CliError(f"{where}{key}: {e}") from None
    if action.choices is not None and out not in action.choices:
        hint = cli.did_you_mean(out, list(action.choices))
        raise cli.CliError(f"{where}{key}: {out!r} is not one of {', '.join(action.choices)}{hint}")
    return out


def validate(config: FinetuneConfig) -> FinetuneConfig:
    """A copy of ``config`` with every value checked as its flag would be.

    Raises:
      CliError: naming the field, for a bad value or for ``config`` and ``checkpoint`` (or
        ``resume`` and ``overwrite``) both set, or a ``batch_size`` that ``grad_accum``
        does not divide.
    """
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"expected a jmem.finetune.FinetuneConfig, got {type(config).__name__}")
    acts = _actions(make_parser("jmem finetune"))
    values = {k: check_value(acts[k], k, getattr(config, k)) for k in _FIELDS}
    config = FinetuneConfig(**values)
    _check_combinations(config, lambda k: k)
    return config


def _check_combinations(config: FinetuneConfig, name) -> None:
    for a, b in (("config", "checkpoint"), ("resume", "overwrite")):
        if getattr(config, a) and getattr(config, b):
            raise cli.CliError(f"{name(a)} and {name(b)} exclude each other; pass one of them")
    if config.batch_size is not None and config.batch_size % config.grad_accum:
        raise cli.CliError(
            f"{name('batch_size')} {config.batch_size} must be divisible by "
            f"{name('grad_accum')} {config.grad_accum}"
        )


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def read_config_file(path: str, p: argparse.ArgumentParser) -> dict:
    """The options in a YAML or TOML file, each checked by its flag's type.

    Raises:
      CliError: ``--config-file FILE: ...`` naming the key, for an unreadable file, an
        unknown key (with the closest name), or a bad value.
    """
    where = f"--config-file {path}: "
    if not os.path.isfile(path):
        raise cli.CliError(f"{where}no such file; pass a .yaml, .yml or .toml file")
    ext = os.path.splitext(path)[1].lower()
    with cli.user_input(f"--config-file {path}", (OSError, ValueError, ImportError)):
        if ext == ".toml":
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        elif ext in (".yaml", ".yml"):
            raw = _read_yaml(path)
        else:
            raise ValueError(f"unknown extension {ext!r}; pass a .yaml, .yml or .toml file")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise cli.CliError(f"{where}expected a mapping of option: value, got {type(raw).__name__}")
    acts = _actions(p)
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in acts or name in ("resume", "overwrite", "debug", "dry_run"):
            hint = cli.did_you_mean(name, [k for k in acts])
            raise cli.CliError(f"{where}unknown key {key!r}{hint}")
        values[name] = check_value(acts[name], str(key), value, where)
    _check_combinations(FinetuneConfig(**values), lambda k: f"{where}{k}")
    return values


def _read_yaml(path: str):
    try:
        import yaml  # noqa: PLC0415 (optional: the examples extra)
    except ImportError:
        raise ImportError("reading YAML needs PyYAML: pip install 'jmem[examples]'") from None
    with open(path) as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"not valid YAML ({cli.one_line(e)})") from None


def parse_args(argv=None, prog: str = "jmem finetune", description: str | None = None):
    """``FinetuneConfig`` from flags (and ``--config-file``, which flags override). Unset
    sizes stay None until ``resolve_defaults`` knows the model and the device. A bad flag
    or file exits with status 2 and one line ``error: ...``."""
    p = make_parser(prog, description)
    args = p.parse_args(argv)
    values = {k: getattr(args, k) for k in _FIELDS}
    if args.config_file is not None:
        probe = make_parser(prog, description)  # what the command line itself sets
        probe.set_defaults(**dict.fromkeys(_FIELDS))
        given = {k: v for k, v in vars(probe.parse_args(argv)).items() if v is not None}
        try:
            from_file = read_config_file(args.config_file, p)
        except cli.CliError as e:
            p.exit(2, f"error: {e}\n")
        if "config" in given or "checkpoint" in given:  # a flag picks the model
            from_file.pop("config", None), from_file.pop("checkpoint", None)
        values.update(from_file)
        values.update((k, v) for k, v in given.items() if k in _FIELDS)
    config = FinetuneConfig(**values)
    try:
        _check_combinations(config, _flag)
    except cli.CliError as e:
        p.error(str(e))
    return config
