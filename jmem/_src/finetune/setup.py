"""Before anything is read or compiled: the model's shape, sizes for the model and the
device, the LoRA targets, the tokenizer and the outputs, each checked with a one-line error
naming its flag."""

from __future__ import annotations

import os

import jax

import jmem
from jmem import data as jdata
from jmem import lora as jlora
from jmem._src import lora_modules
from jmem._src.cli import CliError
from jmem._src.cli import flag as cli_flag
from jmem._src.cli import one_line
from jmem._src.cli import user_input
from jmem._src.finetune.config import DEFAULT_BETA
from jmem._src.finetune.config import DEFAULT_SIMPO_GAMMA
from jmem._src.finetune.config import LOSS_TYPES
from jmem._src.finetune.config import offload_of
from jmem._src.offload import disk
from jmem.models import export
from jmem.models import hf
from jmem.models import llama

#: Unset sizes: "small" for `tiny` and for any training run on a CPU, "large" on a GPU and
#: for --dry-run plans of a bigger model. The sequence length is capped at the model's.
#: The CPU-sized presets (random init, byte-level vocabulary): the small defaults and the
#: random-init learning rate on any device.
CPU_SIZED = ("tiny", "tiny_moe")

DEFAULTS = {
    "small": {"steps": 200, "batch_size": 16, "seq_len": 128},
    "large": {"steps": 20, "batch_size": 1, "seq_len": 2048},
}


def model_config(config) -> llama.LlamaConfig:
    """The model (its identity only): its shape from ``--checkpoint``'s config.json, else
    ``--config`` (whose default depends on the device). How it runs is ``job_levers``."""
    return _model_shape(config.model)


def job_levers(config) -> jmem.Levers:
    """The run's execution settings as one ``jmem.Levers``: the execution group's
    ``--remat``, ``--attention``, ``--loss-chunk``, ``--token-chunk`` and ``--offload
    params`` (resolved per batch and target by ``build``). The one conversion from the job
    config to ``Levers``: the job, its dry run and ``jmem estimate`` use it."""
    levers = config.execution
    return jmem.Levers(
        remat=levers.remat,
        attention=levers.attention,
        loss_chunk=levers.loss_chunk,
        token_chunk=levers.token_chunk,
        offload_params=offload_of(levers).params,
        context_strategy=levers.context_strategy,
    )


def default_model() -> str:
    """``--config`` unset: ``llama2_7b`` on a GPU, ``tiny`` elsewhere."""
    return "llama2_7b" if jax.default_backend() == "gpu" else "tiny"


def _model_shape(model) -> llama.LlamaConfig:
    """The model's shape: from ``--checkpoint``'s config.json, else ``--config``."""
    if model.checkpoint is not None:
        if not os.path.isdir(model.checkpoint):
            raise CliError(
                f"--checkpoint {model.checkpoint}: no such directory; pass a Hugging Face "
                "checkpoint directory (config.json + *.safetensors)"
            )
        with user_input(f"--checkpoint {model.checkpoint}", (OSError, ValueError, KeyError)):
            return hf.load_config(model.checkpoint)
    return llama.get_config(model.config or default_model())


def resolve_defaults(config, cfg, *, on_gpu: bool):
    """``(resolved, notes)``: a new config with every unset option filled (``is None``,
    never ``or``; ``config`` is not changed): the model name (``default_model``), the
    tokenizer (the checkpoint's, else ``byte``), sizes CPU-sized for `tiny` and for training
    on a CPU, 7B-sized on a GPU and for dry-run plans (the sequence length capped at the
    model's ``max_seq_len``), ``lr``, ``lora_alpha``, ``eval_every`` and a preference
    or GRPO objective's ``beta`` and ``loss_type`` (and SimPO's ``simpo_gamma``); notes to
    print
    once every input is checked.

    Raises:
      CliError: for a ``--grad-accum`` that does not divide the default ``--batch-size``.
    """
    model, run, t = config.model, config.run, config.training
    set_ = {}
    if model.config is None and model.checkpoint is None:
        set_["config"] = default_model()
        if set_["config"] == "tiny":
            print(
                "No GPU found: training the `tiny` config on CPU "
                "(use --config llama2_7b --dry-run to plan the 7B run).",
                flush=True,
            )
    if model.tokenizer is None:
        set_["tokenizer"] = model.checkpoint or "byte"
    name = set_.get("config", model.config)
    d = DEFAULTS["small" if name in CPU_SIZED or not (on_gpu or run.dry_run) else "large"]
    sizes = {"steps": t.steps, "batch_size": config.data.batch_size, "seq_len": config.data.seq_len}
    unset = [k for k, v in sizes.items() if v is None]
    for k in unset:
        set_[k] = sizes[k] = min(d[k], cfg.max_seq_len) if k == "seq_len" else d[k]
    if t.objective == "grpo":  # whole groups; a sequence is the prompt and its completion
        g = config.grpo
        if "batch_size" in unset:
            set_["batch_size"] = sizes["batch_size"] = g.num_generations * max(
                1, d["batch_size"] // g.num_generations
            )
        set_["seq_len"] = sizes["seq_len"] = g.max_prompt_len + g.max_completion_len
        unset = [k for k in unset if k != "seq_len"]  # not a CPU-sized default
    if t.lr is None:
        set_["lr"] = 3e-3 if name in CPU_SIZED else 2e-4
    if t.lora_alpha is None and t.lora_rank:  # --lora-rank 0: no adapters, no alpha
        set_["lora_alpha"] = 2.0 * t.lora_rank
    if t.objective != "sft" and t.beta is None:
        set_["beta"] = DEFAULT_BETA[t.objective]
    if t.objective in LOSS_TYPES and t.loss_type is None:
        set_["loss_type"] = LOSS_TYPES[t.objective][0]
    if t.objective == "simpo" and t.simpo_gamma is None:
        set_["simpo_gamma"] = DEFAULT_SIMPO_GAMMA
    if config.data.eval_every is None:
        set_["eval_every"] = default_eval_every(sizes["steps"])
    if sizes["batch_size"] % config.execution.grad_accum:
        raise CliError(
            f"--grad-accum {config.execution.grad_accum} does not divide the default --batch-size "
            f"{sizes['batch_size']}; pass a --batch-size that it divides"
        )
    notes = []
    if unset and not on_gpu and not run.dry_run:
        notes.append("CPU-sized defaults: " + ", ".join(f"{cli_flag(k)} {sizes[k]}" for k in unset))
    offload = offload_in_effect(config, cfg, sizes["batch_size"], sizes["seq_len"])
    notes += [n for n in (offload, offload_note(config)) if n]
    if sizes["seq_len"] > cfg.max_seq_len:
        notes.append(
            f"note: --seq-len {sizes['seq_len']} exceeds the model's max_seq_len "
            f"{cfg.max_seq_len}; positions past it were never trained."
        )
    return config.replace(**set_), notes


def default_eval_every(steps: int) -> int:
    """``--eval-every`` unset: ``max(steps // 10, min(steps, 10))``: about ten evaluations
    in a long run (every 20 steps of 200), never more often than every 10 steps, and a run
    of 10 steps or fewer is evaluated before its first update and after its last only
    (``--steps 4``: at steps 0 and 4, not every step)."""
    return max(steps // 10, min(steps, 10), 1)


def layer_input_bytes(config, cfg, batch_size=None, seq_len=None) -> int:
    """Bytes per step that ``--remat offload``/``offload_inputs`` moves between host and
    device for the layer inputs: each layer's input (``rows x seq_len x hidden`` at the
    2-byte compute dtype) goes to pinned host memory in the forward pass and back for the
    backward, so ``2 x 2 x L x rows x seq_len x hidden`` over the whole batch (``rows``:
    ``--batch-size`` sequences, two per preference pair); 0 under any other remat.
    ``--remat offload`` also offloads selective's residuals (the planner's
    ``activations`` transfer in the dry run counts those too). ``batch_size``/``seq_len``:
    the run's values where the config leaves them unset."""
    if not config.execution.remat.startswith("offload"):
        return 0
    rows = (batch_size or config.data.batch_size) * (
        1 if config.training.objective in ("sft", "grpo") else 2
    )
    tokens = rows * (seq_len or config.data.seq_len)
    return 2 * 2 * cfg.num_layers * tokens * cfg.hidden_size


def offload_record(config, cfg=None, batch_size=None, seq_len=None) -> dict:
    """Where each offloadable ledger lives in this run (``summary.json``'s ``offload``):
    ``optimizer_state`` (with the fp32 masters) ``device``/``host``/``disk``, ``params``
    ``device``/``host``, ``layer_inputs`` ``device``/``host`` (``--remat offload*``); with
    the model's shape ``cfg``, ``layer_inputs_bytes_per_step`` too (``layer_input_bytes``,
    bytes host<->device per step)."""
    off = offload_of(config.execution)
    state = {"none": "device", "optimizer": "host", "disk": "disk"}.get(off.state, "host")
    remat = config.execution.remat
    record = {
        "optimizer_state": state,
        "params": "host" if off.params else "device",
        "layer_inputs": "host" if remat.startswith("offload") else "device",
        "offload_dir": config.execution.offload_dir,
    }
    if cfg is not None:
        record["layer_inputs_bytes_per_step"] = layer_input_bytes(config, cfg, batch_size, seq_len)
    return record


def offload_in_effect(config, cfg=None, batch_size=None, seq_len=None) -> str | None:
    """The line naming every offload in effect (None without one); with the model's shape
    ``cfg``, the layer inputs' bytes per step (``layer_input_bytes``, GB = 1e9 B)."""
    r = offload_record(config, cfg, batch_size, seq_len)
    parts = []
    if r["optimizer_state"] == "disk":
        parts.append(f"optimizer state and masters on disk under {r['offload_dir']}")
    elif r["optimizer_state"] == "host":
        parts.append("optimizer state and masters in host memory")
    if r["params"] == "host":
        what = "trained params" if not config.training.lora_rank else "frozen base"
        parts.append(f"{what} in host memory, streamed a layer at a time")
    if r["layer_inputs"] == "host":
        moved = r.get("layer_inputs_bytes_per_step")
        per_step = "" if moved is None else f", {moved / 1e9:.3g} GB host<->device per step"
        parts.append(f"layer inputs in host memory (--remat {config.execution.remat}{per_step})")
    return "offload: " + "; ".join(parts) if parts else None


def offload_note(config) -> str | None:
    """The note for host offload (``--offload``, ``--remat offload*``) measured by XLA:CPU,
    where host and device are one memory: the compiled figures count offloaded buffers
    (and their copies) as device bytes, so offload cannot show a saving there."""
    levers = config.execution
    if not (levers.offload != "none" or levers.remat.startswith("offload")):
        return None
    if config.devices.target is not None or jax.default_backend() != "cpu":
        return None
    what = f"--offload {levers.offload}" if levers.offload != "none" else f"--remat {levers.remat}"
    return (
        f"note: {what} moves buffers to host memory, which is the device's own memory on "
        "CPU: XLA:CPU's memory figures cannot show the saving (they may even grow by the "
        "copies); see it with --dry-run --target h100_sxm (an XLA:GPU compile, no GPU)."
    )


def check_lora_targets(config, cfg) -> None:
    """Fails fast (before any weight is read) when ``--lora-targets`` selects no weight or
    names a module the model lacks: one line with the model's module names and the
    accepted forms (``lora_modules.FORMS``)."""
    t = config.training
    if not t.lora_rank:  # full fine-tuning: no adapters
        return
    try:
        jax.eval_shape(
            lambda: jlora.init(
                jax.random.key(0),
                llama.abstract_params(cfg),
                rank=t.lora_rank,
                alpha=t.lora_alpha,
                modules=lora_modules.modules(t.lora_targets),
            )
        )
    except ValueError as e:
        raise CliError(
            f"--lora-targets {t.lora_targets!r}: {one_line(e).rstrip('.')}; {lora_modules.FORMS}"
        ) from e


def make_tokenizer(config, cfg):
    """The tokenizer of a resolved config (``resolve_defaults``): ``--tokenizer`` 'byte' or
    a directory with tokenizer.json (unset: the checkpoint's).

    Raises:
      CliError: naming the flag, for a missing directory or tokenizer.json, or a tokenizer
        larger than the model's vocabulary.
    """
    model = config.model
    path = model.tokenizer
    from_ckpt = model.checkpoint is not None and path == model.checkpoint
    flag = f"--checkpoint {model.checkpoint}" if from_ckpt else f"--tokenizer {path}"
    if path == "byte":
        tok = jdata.ByteTokenizer()
    elif not os.path.isdir(path):
        raise CliError(f"{flag}: no such directory; pass 'byte' or a directory with tokenizer.json")
    elif not os.path.exists(os.path.join(path, "tokenizer.json")):
        byte = " or --tokenizer byte (UTF-8 bytes, vocabulary 256)" if cfg.vocab_size >= 256 else ""
        raise CliError(
            f"{flag} has no tokenizer.json; pass --tokenizer DIR (a directory with the "
            f"model's tokenizer.json){byte}"
        )
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):  # a bad one named
            if os.path.exists(os.path.join(path, name)):
                with user_input(flag):
                    hf.read_json(os.path.join(path, name))
        with user_input(flag, Exception):  # tokenizers raises plain Exception
            tok = jdata.HFTokenizer(path)
    if tok.vocab_size > cfg.vocab_size:
        which = (
            f"--checkpoint {model.checkpoint}" if model.checkpoint else f"--config {model.config}"
        )
        raise CliError(
            f"{flag}: its {tok.vocab_size} tokens exceed the vocabulary of the model "
            f"({which}: {cfg.vocab_size}); pass the model's own tokenizer with --tokenizer DIR"
        )
    if model.checkpoint and path == "byte":
        print("note: byte tokens with a pretrained checkpoint do not match its vocabulary.")
    return tok


def check_offload_dir(config) -> None:
    """Fails before any line is printed for an ``--offload-dir`` that cannot hold files (a
    missing parent, a file, not writable): one line naming it. Its free space is checked
    once the state's bytes are known (``build.offload_dir_input``)."""
    path = config.execution.offload_dir
    if path is None:
        return
    try:
        disk.check_directory(path, 0, arg="--offload-dir", create=False)
    except ValueError as e:
        raise CliError(one_line(e)) from e


def check_outputs(config, cfg, tok) -> None:
    """Fails before training for what would fail after it: a model --export-merged cannot
    write, a --sample-prompt with no tokens."""
    out = config.output
    if out.export_merged:
        with user_input(f"--export-merged {out.export_merged}"):
            export.hf_config(cfg)
    if out.sample_prompt is not None and not len(tok.encode(out.sample_prompt)):
        raise CliError("--sample-prompt: the text has no tokens; pass a non-empty prompt")
