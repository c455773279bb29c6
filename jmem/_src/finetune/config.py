"""The fine-tuning job's options: ``FinetuneConfig``, nested frozen groups (``model``,
``data``, ``execution``, ``training``, ``run``, ``output``, ``devices``) whose fields declare
their flags (help, checking type, choices), so that the command line (``jmem finetune``,
``examples/qlora_7b.py``), config files (YAML or TOML, nested the same way; read by
``config_file``) and Python are checked by the same code, as levanter's ``TrainLmConfig``
(draccus) generates its command line and config files from nested dataclasses; and the
rules that combine options. Importing this module does not import JAX."""

from __future__ import annotations

import argparse
import dataclasses
import re
import warnings
from typing import Any
from typing import Mapping

from jmem._src import cli
from jmem._src import lora_modules
from jmem._src.cli import option
from jmem._src.finetune.full_finetuning import check_full_finetuning
from jmem._src.names import ATTENTION_NAMES
from jmem._src.names import COMPILE_TARGET_NAMES as TARGET_NAMES
from jmem._src.names import CONTEXT_STRATEGY_NAMES
from jmem._src.names import MODEL_NAMES
from jmem._src.names import OPTIMIZER_NAMES
from jmem._src.names import REMAT_NAMES
from jmem._src.planner.offload import Offload

#: Default ``--lora-targets``: every projection of every layer (the QLoRA paper's).
ALL_PROJECTIONS = lora_modules.ALL

HOST_ALLOCATORS = ("auto", "huge-pages", "retain", "system")
#: ``jmem.Levers``' defaults for the long-sequence levers (attention, loss_chunk, token_chunk).
LONG_CONTEXT_DEFAULTS = ("auto", 2048, 2048)
#: ``--objective``: supervised fine-tuning, a preference loss, or GRPO on rewards of
#: sampled completions (``jmem.losses``).
OBJECTIVE_NAMES = ("sft", "dpo", "orpo", "simpo", "grpo")
#: The preference objectives (pairs of chosen and rejected answers).
PREFERENCE_OBJECTIVES = ("dpo", "orpo", "simpo")
#: ``--beta`` unset, by objective: TRL's ``DPOConfig``/``ORPOConfig`` 0.1, SimPO's paper 2.0,
#: TRL's ``GRPOConfig`` 0.0 (no KL term, no reference).
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0, "grpo": 0.0}
#: ``--loss-type`` by objective, its default first (TRL's ``DPOConfig``, ``GRPOConfig``).
LOSS_TYPES = {"dpo": ("sigmoid", "ipo"), "grpo": ("dapo", "grpo", "bnpo", "dr_grpo")}
#: ``--scale-rewards`` (TRL's ``scale_rewards``; ``jmem.losses.group_advantages``).
SCALE_REWARDS = ("group", "batch", "none")
#: ``--simpo-gamma`` unset: the SimPO paper's target margin (gamma / beta = 0.5 at beta 2).
DEFAULT_SIMPO_GAMMA = 1.0
#: argparse type of ``--label-smoothing``: the probability that a label is flipped.
smoothing = cli.number(float, lambda v: 0 <= v < 0.5, "a probability in [0, 0.5)")
finite_float = cli.number(float, lambda v: v == v and abs(v) != float("inf"), "a finite number")
#: argparse types of ``--num-generations`` (a group needs two) and ``--top-p``.
group_size = cli.int_at_least(2, "an integer >= 2 (a group of completions)")
nucleus = cli.number(float, lambda v: 0 < v <= 1, "a probability in (0, 1]")
#: argparse type of ``--beta``: 0 turns GRPO's KL term off; the preference losses need > 0.
beta_value = cli.number(
    float, lambda v: v >= 0 and v != float("inf"), "a number >= 0 (positive for dpo, orpo, simpo)"
)


def mesh_spec(text: str) -> str:
    """argparse type: ``data=N,fsdp=M,expert=E,context=C`` (any may be left out; sizes >= 1)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    sizes = {}
    for part in parts:
        m = re.fullmatch(r"(data|fsdp|expert|context)=([0-9]+)", part)
        if not m or int(m[2]) < 1 or m[1] in sizes:
            raise argparse.ArgumentTypeError(
                "expected data=N,fsdp=M,expert=E,context=C (positive sizes, each axis once), "
                f"got {text!r}"
            )
        sizes[m[1]] = int(m[2])
    if not sizes:
        raise argparse.ArgumentTypeError(f"expected data=N,fsdp=M,expert=E,context=C, got {text!r}")
    return ",".join(f"{k}={v}" for k, v in sizes.items())


#: ``--offload`` parts, in their canonical order.
OFFLOAD_PARTS = ("optimizer", "params")


def offload_spec(text: str) -> str:
    """argparse type: ``optimizer``, ``params``, ``optimizer,params`` (any order) or
    ``none``, as the canonical comma-joined string."""
    parts = {p.strip() for p in str(text).split(",") if p.strip()}
    if parts == {"none"}:
        return "none"
    if not parts or parts - set(OFFLOAD_PARTS):
        raise argparse.ArgumentTypeError(
            f"expected optimizer, params, optimizer,params or none (true or false in a "
            f"config file: optimizer or none), got {text!r}"
        )
    return ",".join(p for p in OFFLOAD_PARTS if p in parts)


def offload_of(levers) -> Offload:
    """The levers group's offload rungs as the planner's and the job's one value: ``--offload``
    (``optimizer``, ``params``), with ``--offload-dir`` the disk rung for the state."""
    parts = levers.offload.split(",")
    state = "optimizer" if "optimizer" in parts else "none"
    state = "disk" if levers.offload_dir is not None else state
    return Offload(state, "params" in parts)


class _Group:
    """A group's fields are checked (and converted) on construction."""

    def __post_init__(self):
        cli.check_fields(self)


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Group):
    """The model: a named shape or a Hugging Face checkpoint, and its tokenizer."""

    config: str | None = option(
        None,
        "model shape; unset: llama2_7b on GPU, tiny on CPU",
        choices=MODEL_NAMES,
        exclusive="model",
    )
    checkpoint: str | None = option(
        None, "Hugging Face checkpoint directory (config.json + *.safetensors)", exclusive="model"
    )
    tokenizer: str | None = option(
        None,
        "'byte' (UTF-8 bytes, vocabulary 256) or a directory with tokenizer.json; "
        "unset: the checkpoint's own, else byte",
    )


@dataclasses.dataclass(frozen=True)
class DataConfig(_Group):
    """The data: text or examples, the held-out split, and the shape of a batch."""

    data: str | None = option(
        None,
        ".txt (one text) or .jsonl (examples: text, prompt/completion, Alpaca or chat "
        "messages; loss on the responses only); default: pydoc_data.topics (CPython docs)",
    )
    eval_split: float = option(
        0.05,
        "fraction of the data held out for evaluation (0: no evaluation); at least one "
        "row or example is held out when the data allows, else evaluation is skipped",
        check=cli.fraction,
    )
    eval_every: int | None = option(
        None,
        "steps between evaluations (and one before the first update); unset: "
        "max(steps // 10, min(steps, 10))",
        check=cli.positive_int,
    )
    eval_batches: int = option(4, "held-out batches per evaluation", check=cli.positive_int)
    seq_len: int | None = option(
        None, "tokens per sequence; unset: 128 small, 2048 large", check=cli.positive_int
    )
    batch_size: int | None = option(
        None, "sequences per step; unset: 16 small, 1 large", check=cli.positive_int
    )


@dataclasses.dataclass(frozen=True)
class ExecutionConfig(_Group):
    """How the step executes (memory against speed), not what it computes: remat,
    attention, chunks, precision, offload, accumulation."""

    remat: str = option("full", "remat policy", choices=REMAT_NAMES)
    attention: str = option(
        LONG_CONTEXT_DEFAULTS[0],
        "attention implementation (auto: cuDNN on GPU where it can run, else dense up to "
        "1024 keys and blockwise beyond; jmem.ops.attention)",
        choices=ATTENTION_NAMES,
    )
    loss_chunk: int = option(
        LONG_CONTEXT_DEFAULTS[1],
        "tokens per chunk of the cross-entropy (no [B, S, V] logits); 0: unchunked",
        check=cli.nonnegative_int,
    )
    token_chunk: int = option(
        LONG_CONTEXT_DEFAULTS[2],
        "tokens per chunk of each layer's token-local parts: norms, projections, RoPE, "
        "MLP (tiled; no float32 [S, hidden] temporaries); 0: whole (formerly --mlp-chunk)",
        check=cli.nonnegative_int,
        aliases=("mlp_chunk",),
    )
    context_strategy: str = option(
        "auto",
        "with --mesh context=C: attention across the shards of a sequence: all_gather "
        "(K/V gathered, one collective per layer), ring (K/V shards passed around, two per "
        "device at most), ulysses (all-to-all heads for sequence; head counts must be "
        "multiples of C) or auto (ulysses where the head counts allow and the sequence has "
        "at least 65536 tokens, else all_gather); docs/sharding.md",
        choices=("auto", *CONTEXT_STRATEGY_NAMES),
    )
    precision: str = option(
        "bf16", "compute dtype; fp16 turns on dynamic loss scaling", choices=("bf16", "fp16")
    )
    offload: str = option(
        "none",
        "what lives in pinned_host memory: optimizer (its state and masters), params (the "
        "weights, streamed to the device layer by layer: the frozen base, or with --lora-rank "
        "0 the trained params, which need optimizer,params; on a mesh each device streams its "
        "FSDP shard), optimizer,params, or none; "
        "bare --offload (or true in a config file): optimizer",
        check=offload_spec,
        const="optimizer",
        metavar="WHAT",
    )
    offload_dir: str | None = option(
        None,
        "optimizer state on disk under PATH (NVMe rung; streamed leaf by leaf each step; "
        "checkpoints stay the source of truth)",
        metavar="PATH",
    )
    pcie_gbps: float = option(
        25.0,
        "host<->device GB/s for the dry run's transfer time (PCIe 4.0 x16, effective)",
        check=cli.positive_float,
    )
    disk_gbps: float = option(
        3.0,
        "disk GB/s for the dry run's transfer time (NVMe, sequential)",
        check=cli.positive_float,
    )
    grad_accum: int = option(1, "microbatches per step", check=cli.positive_int)


@dataclasses.dataclass(frozen=True)
class TrainingConfig(_Group):
    """What is trained, and how long: the objective, the optimizer, its schedule, the LoRA
    adapters."""

    objective: str = option(
        "sft",
        "sft: next-token loss on the data (text or examples); dpo, orpo, simpo: a preference "
        "loss on prompt/chosen/rejected pairs (jmem.losses; DPO's reference is the base with "
        "the adapters off); grpo: GRPO on the rewards (--reward) of completions sampled from "
        "the prompts of --data",
        choices=OBJECTIVE_NAMES,
    )
    beta: float | None = option(
        None,
        "DPO's KL inverse temperature (IPO's tau), ORPO's lambda, SimPO's reward scale, "
        "GRPO's KL weight (> 0: a KL term to the base with the adapters off); unset: 0.1 "
        "(dpo, orpo), 2.0 (simpo), 0.0 (grpo)",
        check=beta_value,
    )
    loss_type: str | None = option(
        None,
        "dpo: sigmoid (DPO) or ipo (IPO, length-normalised); grpo: dapo (a token mean over "
        "the batch), grpo (each completion's token mean), bnpo, dr_grpo (a constant "
        "normaliser); unset: sigmoid (dpo), dapo (grpo)",
        choices=tuple(dict.fromkeys(n for names in LOSS_TYPES.values() for n in names)),
    )
    label_smoothing: float = option(
        0.0,
        "dpo (sigmoid) and simpo: the assumed probability that a preference label is flipped "
        "(conservative DPO)",
        check=smoothing,
    )
    simpo_gamma: float | None = option(
        None, "simpo: the target reward margin; unset: 1.0", check=finite_float
    )
    steps: int | None = option(
        None, "optimizer steps; unset: 200 small, 20 large", check=cli.positive_int
    )
    optimizer: str = option("adamw_8bit", "optimizer", choices=OPTIMIZER_NAMES)
    lr: float | None = option(
        None,
        "peak learning rate; unset: 3e-3 for tiny and tiny_moe (random init), 2e-4 otherwise",
        check=cli.positive_float,
    )
    weight_decay: float = option(
        0.0,
        "decoupled weight decay on the trained matrices (jmem.decay_mask): the adapters, or "
        "with --lora-rank 0 the projections and the head (never norms or embeddings)",
        check=cli.nonnegative_float,
    )
    lora_rank: int = option(
        8,
        "LoRA rank r; 0: full fine-tuning (every weight trained in bf16 with fp32 masters, "
        "no NF4 base, no adapters)",
        check=cli.nonnegative_int,
    )
    lora_alpha: float | None = option(None, "LoRA alpha; unset: 2 * rank", check=cli.positive_float)
    lora_dropout: float = option(
        0.0,
        "dropout on the adapters' input in training (PEFT's lora_dropout); a key per "
        "step and microbatch from --seed, none at evaluation",
        check=cli.fraction,
    )
    lora_targets: str = option(
        ALL_PROJECTIONS,
        "the weights LoRA adapts: module names as PEFT's target_modules (q_proj,v_proj, as "
        "the QLoRA seed table), all (every projection) or a regex matched in full against "
        "weight paths (.*(q_proj|v_proj).*)",
        check=lora_modules.parse,
    )
    nonfinite_patience: int = option(
        10,
        "a non-finite loss stops the run at once; under --precision fp16 (dynamic loss "
        "scaling, where a step skipped for non-finite gradients is normal while the scale "
        "calibrates) this many skipped steps in a row stop it",
        check=cli.positive_int,
    )


@dataclasses.dataclass(frozen=True)
class GrpoConfig(_Group):
    """--objective grpo: the rewards, the rollout (G sampled completions per prompt) and
    the clipped surrogate loss (TRL's GRPOConfig names and defaults)."""

    reward: tuple[str, ...] = option(
        (),
        "a reward function, FILE.py:FUNC, module:FUNC or a built-in name; repeat the flag "
        "for several (their weighted sum is the reward)",
        many="append",
        metavar="SPEC",
    )
    reward_weights: tuple[float, ...] | None = option(
        None,
        "one weight per --reward, in their order (W1,W2,...); unset: 1 each",
        check=finite_float,
        many="comma",
        metavar="W1,W2",
    )
    num_generations: int = option(
        8,
        "completions sampled per prompt G (a group); --batch-size counts completions and "
        "must be a multiple of G",
        check=group_size,
    )
    max_prompt_len: int = option(
        512,
        "prompt tokens (longer prompts keep their last tokens, with a note)",
        check=cli.positive_int,
    )
    max_completion_len: int = option(
        256, "tokens sampled per completion at most", check=cli.positive_int
    )
    generation_batch: int | None = option(
        None,
        "completions per rollout micro-batch (the KV cache holds this many rows); a "
        "divisor of --batch-size; unset: the whole batch",
        check=cli.positive_int,
    )
    temperature: float = option(1.0, "sampling temperature", check=cli.positive_float)
    top_p: float = option(1.0, "nucleus sampling: the probability mass kept", check=nucleus)
    top_k: int = option(
        0, "sampling keeps the k most likely tokens (0: all)", check=cli.nonnegative_int
    )
    epsilon: float = option(
        0.2, "the clip range of the probability ratio (>= 1 - epsilon)", check=cli.nonnegative_float
    )
    epsilon_high: float | None = option(
        None,
        "the upper clip range (ratio <= 1 + epsilon_high; DAPO's clip-higher, e.g. 0.28); "
        "unset: --epsilon",
        check=cli.nonnegative_float,
    )
    scale_rewards: str = option(
        "group",
        "advantages: each reward minus its group's mean, divided by the group's (group) or "
        "the batch's (batch) standard deviation, or not divided (none, Dr. GRPO)",
        choices=SCALE_REWARDS,
    )
    num_iterations: int = option(
        1,
        "optimizer updates per rollout (mu); above 1 the old log-probs are recomputed once "
        "before the first update",
        check=cli.positive_int,
    )


@dataclasses.dataclass(frozen=True)
class RunConfig(_Group):
    """The run: its directory, checkpoints, seed, and how this invocation behaves."""

    out: str = option("runs/qlora_7b", "output directory")
    save_every: int = option(100, "steps between checkpoints", check=cli.positive_int)
    keep: int = option(2, "checkpoints kept", check=cli.positive_int)
    resume: bool = option(
        False,
        "continue the run in --out from its last checkpoint",
        switch=True,
        exclusive="again",
        cli_only=True,
    )
    overwrite: bool = option(
        False,
        "replace the run in --out (its checkpoints too) and a merged checkpoint in --export-merged",
        switch=True,
        exclusive="again",
        cli_only=True,
    )
    seed: int = option(0, None, check=cli.nonnegative_int)
    dry_run: bool = option(
        False, "compile only; print memory report and estimate", switch=True, cli_only=True
    )
    memory: int | None = option(
        None,
        "device memory for --dry-run's verdict (24GB, 80GiB, bytes; unset: 24 GiB); a 2 GB "
        "reserve is kept free, as jmem estimate --memory does",
        check=cli.memory(False),
        metavar="SIZE",
    )
    host_memory: int = option(
        128 * 2**30,
        "host memory for --dry-run's advice (24GB, 128GiB, bytes; default 128 GiB, a "
        "typical workstation's): a lever whose host bytes exceed it is labelled so",
        check=cli.memory(False),
        metavar="SIZE",
    )
    no_check_advice: bool = option(
        False,
        "--dry-run: name the levers for smaller cards from the planner alone (planner-only), "
        "without compiling each for the target (at most 3 compiles, the default)",
        switch=True,
        cli_only=True,
    )
    no_progress: bool = option(False, "plain log lines instead of a progress bar", switch=True)
    debug: bool = option(
        False,
        "a traceback instead of a one-line error; XLA's own log lines shown",
        switch=True,
        cli_only=True,
    )
    host_allocator: str = option(
        "auto",
        "huge-pages: glibc's glibc.malloc.hugetlb=1 tunable (the command line restarts "
        "its process once to set it), so XLA:CPU's per-step temporaries sit in 2 MiB "
        "transparent huge pages (measured 1.28x faster with full remat, 1.45x without); "
        "retain: jmem.host.retain_host_allocations(), freed memory stays mapped (slower "
        "than huge pages with two cores); system: the C library's settings; auto "
        "(default): huge-pages unless a GPU/TPU plugin is installed. finetune.run() from "
        "Python changes none of them, it only reports",
        choices=HOST_ALLOCATORS,
    )


@dataclasses.dataclass(frozen=True)
class OutputConfig(_Group):
    """What a run writes besides --out: a merged checkpoint, samples. The adapters are
    always written to --out/adapter in PEFT format."""

    export_merged: str | None = option(
        None,
        "after training, write the base with the adapters merged in as a Hugging Face "
        "checkpoint (the NF4 base dequantized, so its quantization error stays); the adapters "
        "alone are always written to --out/adapter in PEFT format",
        metavar="DIR",
    )
    sample_prompt: str | None = option(
        None, "print a greedy continuation of TEXT before and after training", metavar="TEXT"
    )
    sample_tokens: int = option(32, "tokens in each sample", check=cli.positive_int)


@dataclasses.dataclass(frozen=True)
class DevicesConfig(_Group):
    """The devices and processes of the run (jmem.sharding, jax.distributed)."""

    mesh: str | None = option(
        None,
        "devices as data=N,fsdp=M,expert=E,context=C (jmem.sharding: the NF4 base, optimizer "
        "state and batch split over fsdp, adapters replicated; data: replicas; expert: a "
        "mixture of experts' experts split over E devices, the batch too; context: each "
        "sequence split over C devices); unset: FSDP over every device",
        check=mesh_spec,
    )
    coordinator: str | None = option(
        None,
        "multi-process run: process 0's address for jax.distributed.initialize "
        "(unset: auto-detected under SLURM, or a single process)",
        metavar="HOST:PORT",
    )
    num_processes: int | None = option(None, "processes of the run", check=cli.positive_int)
    process_id: int | None = option(None, "this process's index", check=cli.nonnegative_int)
    target: str | None = option(
        None,
        "with --dry-run: compile for this machine instead of the one running (a GPU target "
        "is XLA:GPU's deviceless compile, no GPU needed: pip install 'jmem[gpu-plan]'; "
        "--mesh data=N,fsdp=M then counts the target's devices); see jmem.targets",
        choices=TARGET_NAMES,
    )


#: The groups of ``FinetuneConfig``, in the order of ``--help``.
GROUPS = {
    "model": ModelConfig,
    "data": DataConfig,
    "execution": ExecutionConfig,
    "training": TrainingConfig,
    "run": RunConfig,
    "output": OutputConfig,
    "devices": DevicesConfig,
    "grpo": GrpoConfig,  # last: the groups by position keep their places
}
#: Former group names (a config file's key) -> their groups.
GROUP_ALIASES = {"levers": "execution"}
#: Option name (the flag's, ``lora_rank`` for ``--lora-rank``) -> its group's name.
GROUP_OF = {f.name: g for g, cls in GROUPS.items() for f in cli.options(cls)}
#: Deprecated option names -> their new names.
ALIASES = {
    a: f.name
    for cls in GROUPS.values()
    for f in cli.options(cls)
    for a in f.metadata["option"]["aliases"]
}
FIELDS = {f.name: f for cls in GROUPS.values() for f in cli.options(cls)}


@dataclasses.dataclass(frozen=True, init=False)
class FinetuneConfig:
    """Every option of the QLoRA fine-tuning job, in groups: ``model``, ``data``,
    ``execution``, ``training``, ``run``, ``output``, ``devices``, ``grpo``. A field is named as its
    flag (``training.lora_rank`` is ``--lora-rank``); ``None`` means "sized for the model and
    the device" (``run`` resolves it into a new value). Frozen: change it with ``replace``.

    ``FinetuneConfig(training=TrainingConfig(steps=20))``, or with the flags' names,
    ``FinetuneConfig.from_flat(steps=20)``; a group may be given as a dict of its fields.
    The flags' names as keywords (``FinetuneConfig(steps=20, data="a.txt")``) and
    ``levers=`` for ``execution=`` are deprecated: they work, with a ``DeprecationWarning``
    (a ``data=`` that is not a group or a mapping is the ``data`` option).

    Raises:
      CliError: (a ``ValueError``) naming the field, for a value its flag would refuse, for
        ``config`` and ``checkpoint`` (or ``resume`` and ``overwrite``) both set, or for a
        ``batch_size`` that ``grad_accum`` does not divide.
      TypeError: for a group of the wrong type, or an unknown keyword.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    devices: DevicesConfig = dataclasses.field(default_factory=DevicesConfig)
    grpo: GrpoConfig = dataclasses.field(default_factory=GrpoConfig)

    def __init__(self, *groups: Any, **kwargs: Any):
        if len(groups) > len(GROUPS):
            raise TypeError(f"FinetuneConfig takes at most {len(GROUPS)} groups by position")
        given = dict(zip(GROUPS, groups))
        flat = {}
        for key, value in kwargs.items():
            if key == "levers" and _is_group(value):
                _deprecated("FinetuneConfig(levers=...) is deprecated; pass execution=...")
                key = "execution"
            if key in GROUPS and _is_group(value):
                if key in given:
                    raise TypeError(f"FinetuneConfig: the {key} group is given twice")
                given[key] = value
            else:
                flat[key] = value
        for name, cls in GROUPS.items():
            value = given.get(name, cls())
            if isinstance(value, Mapping):
                value = cls(**value)
            elif not isinstance(value, cls):
                raise TypeError(
                    f"FinetuneConfig.{name}: expected a {cls.__name__} (or a dict of its "
                    f"fields), got {type(value).__name__}"
                )
            object.__setattr__(self, name, value)
        if flat:
            _deprecated(
                f"FinetuneConfig({', '.join(f'{k}=...' for k in flat)}) with the flags' names "
                "is deprecated; use FinetuneConfig.from_flat(...) or the nested groups "
                "(training=TrainingConfig(...))"
            )
            for name, kw in _by_group(flat).items():
                object.__setattr__(self, name, dataclasses.replace(getattr(self, name), **kw))
        check_combinations(self.flat(), lambda k: k)

    @property
    def levers(self) -> ExecutionConfig:
        """Deprecated: the ``execution`` group."""
        _deprecated("FinetuneConfig.levers is deprecated; use FinetuneConfig.execution")
        return self.execution

    @classmethod
    def from_flat(cls, **options: Any) -> FinetuneConfig:
        """A config from options named as the flags (``lora_rank=16``, ``remat="none"``);
        unset ones keep their defaults.

        Raises:
          TypeError: for an unknown name (with the closest one).
        """
        groups = _by_group(options)
        return cls(**{g: GROUPS[g](**groups.get(g, {})) for g in GROUPS})

    def flat(self) -> dict[str, Any]:
        """Every option by its flag's name (``{"lora_rank": 8, ...}``), group by group."""
        return {
            f.name: getattr(getattr(self, g), f.name)
            for g, cls in GROUPS.items()
            for f in cli.options(cls)
        }

    def replace(self, **options: Any) -> FinetuneConfig:
        """A copy with ``options`` (named as the flags) changed, checked as on construction."""
        changes = _by_group(options)
        return dataclasses.replace(
            self, **{g: dataclasses.replace(getattr(self, g), **kw) for g, kw in changes.items()}
        )


def _is_group(value: Any) -> bool:
    """Whether a keyword's value is a group (an instance of one, or a mapping of fields)."""
    return isinstance(value, (Mapping, *GROUPS.values()))


def _deprecated(message: str) -> None:
    warnings.warn(message, DeprecationWarning, stacklevel=3)


def _by_group(options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``options`` named as the flags, by group (deprecated names read as their new ones).

    Raises:
      TypeError: for an unknown name (with the closest one).
    """
    groups: dict[str, dict] = {}
    for name, value in options.items():
        groups.setdefault(_group_of(name), {})[ALIASES.get(name, name)] = value
    return groups


def _group_of(name: str) -> str:
    group = GROUP_OF.get(ALIASES.get(name, name))
    if group is None:
        hint = cli.did_you_mean(name, list(GROUP_OF))
        raise TypeError(f"FinetuneConfig has no option {name!r}{hint}")
    return group


def check_combinations(values: Mapping[str, Any], name) -> None:
    """Options that exclude each other, and ``batch_size`` divisible by ``grad_accum``
    (``values`` by option name; ``name(key)`` spells a key in the message).

    Raises:
      CliError: naming both options.
    """
    get = lambda k: values.get(k, FIELDS[k].default)
    for a, b in (("config", "checkpoint"), ("resume", "overwrite")):
        if get(a) and get(b):
            raise cli.CliError(f"{name(a)} and {name(b)} exclude each other; pass one of them")
    _check_objective(get, name)
    _check_offload(get, name)
    check_full_finetuning(get, name, lambda k: FIELDS[k].default)
    if get("batch_size") is not None and get("batch_size") % get("grad_accum"):
        raise cli.CliError(
            f"{name('batch_size')} {get('batch_size')} must be divisible by "
            f"{name('grad_accum')} {get('grad_accum')}"
        )


def _check_offload(get, name) -> None:
    """``--offload params`` needs a remat policy and excludes ``--offload-dir``."""
    if "params" not in get("offload").split(","):
        return
    if get("remat") == "none":
        raise cli.CliError(
            f"{name('offload')} params needs a remat policy ({name('remat')} full, the "
            "default): with --remat none every layer's device copy of its weights is kept "
            "for the backward pass"
        )
    if get("offload_dir") is not None:
        raise cli.CliError(
            f"{name('offload')} params and {name('offload_dir')} exclude each other (the "
            "optimizer state on disk and params streamed from host memory do not lower "
            f"together in JAX 0.10); use {name('offload')} optimizer,params instead"
        )


#: The loss options and the objectives that read them.
OBJECTIVE_OPTIONS = {
    "beta": (*PREFERENCE_OBJECTIVES, "grpo"),
    "loss_type": ("dpo", "grpo"),
    "label_smoothing": ("dpo", "simpo"),
    "simpo_gamma": ("simpo",),
    **{f.name: ("grpo",) for f in cli.options(GrpoConfig)},
}


def _check_objective(get, name) -> None:
    """A loss option given (not at its default) belongs to an objective that reads it."""
    objective = get("objective")
    for option_name, objectives in OBJECTIVE_OPTIONS.items():
        if objective in objectives or get(option_name) == FIELDS[option_name].default:
            continue
        raise cli.CliError(
            f"{name(option_name)} applies to {name('objective')} {'|'.join(objectives)}, "
            f"not {objective}; drop it or pass {name('objective')} {objectives[0]}"
        )
    loss_type = get("loss_type")
    if loss_type is not None and loss_type not in LOSS_TYPES[objective]:
        raise cli.CliError(
            f"{name('loss_type')} {loss_type} is not a loss of {name('objective')} "
            f"{objective}; pass one of {', '.join(LOSS_TYPES[objective])}"
        )
    if get("beta") == 0 and objective in PREFERENCE_OBJECTIVES:
        raise cli.CliError(f"{name('beta')} must be positive for {name('objective')} {objective}")
    if loss_type == "ipo" and get("label_smoothing"):
        raise cli.CliError(
            f"{name('label_smoothing')} applies to {name('loss_type')} sigmoid only; drop it "
            "for ipo"
        )
    if objective == "grpo":
        _check_grpo(get, name)


def _check_grpo(get, name) -> None:
    """GRPO's batch: completions in whole groups, rollout micro-batches that divide it, one
    weight per reward, a reward to train on (but for a dry run), and ``--seq-len`` unset
    or ``--max-prompt-len + --max-completion-len`` (what the job resolves it to)."""
    g, batch = get("num_generations"), get("batch_size")
    if batch is not None and batch % g:
        raise cli.CliError(
            f"{name('batch_size')} {batch} counts completions and must be a multiple of "
            f"{name('num_generations')} {g} (whole groups); pass e.g. {name('batch_size')} "
            f"{max(g, batch - batch % g)}"
        )
    gen = get("generation_batch")
    if gen is not None and batch is not None and batch % gen:
        raise cli.CliError(
            f"{name('generation_batch')} {gen} must divide {name('batch_size')} {batch}"
        )
    if (get("beta") or 0) > 0 and get("lora_rank") == 0:
        raise cli.CliError(
            f"{name('beta')} > 0 with {name('lora_rank')} 0: GRPO's reference is the base with "
            f"the adapters off, and full fine-tuning has none; drop {name('beta')} or train "
            "LoRA adapters"
        )
    if "params" in get("offload").split(","):
        raise cli.CliError(
            f"{name('offload')} params does not apply to {name('objective')} grpo yet: its "
            "log-prob pass and rollouts read the base on the device; keep the base there "
            f"(drop params from {name('offload')}) and lower memory with {name('remat')} "
            f"offload_inputs or a smaller {name('generation_batch')}"
        )
    rewards, weights = get("reward"), get("reward_weights")
    if weights is not None and len(weights) != len(rewards):
        raise cli.CliError(
            f"{name('reward_weights')} gives {len(weights)} weights for {len(rewards)} "
            f"{name('reward')} functions; give one weight per {name('reward')}"
        )
    if not rewards and not get("dry_run"):
        raise cli.CliError(
            f"{name('objective')} grpo needs a reward: pass {name('reward')} FILE.py:FUNC "
            "(or module:FUNC, or a built-in name), repeated for several"
        )
    seq_len = get("max_prompt_len") + get("max_completion_len")
    if get("seq_len") not in (None, seq_len):
        raise cli.CliError(
            f"{name('seq_len')} does not apply to {name('objective')} grpo: a sequence is "
            f"{name('max_prompt_len')} + {name('max_completion_len')} tokens ({seq_len}); "
            "drop it"
        )


def validate(config: FinetuneConfig) -> FinetuneConfig:
    """``config`` checked again, every value as its flag would be (a config is checked on
    construction; this catches one changed behind the dataclass's back).

    Raises:
      TypeError: for something other than a ``FinetuneConfig``.
      CliError: as ``FinetuneConfig``.
    """
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"expected a jmem.finetune.FinetuneConfig, got {type(config).__name__}")
    return FinetuneConfig.from_flat(**config.flat())


def __getattr__(name: str):
    if name == "LeversConfig":
        warnings.warn(
            "LeversConfig is deprecated; use ExecutionConfig", DeprecationWarning, stacklevel=2
        )
        return ExecutionConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
