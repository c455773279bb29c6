"""The job's train step: QLoRA (NF4 base, LoRA adapters) or, with ``--lora-rank 0``, full
fine-tuning (16-bit params, fp32 masters); remat, bf16/fp16 compute, a warmup-cosine
schedule, clipping and the chosen optimizer, composed by ``jmem.train_step``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import optax

import jmem
from jmem import DynamicLossScale
from jmem import NoOpLossScale
from jmem import adamw_4bit
from jmem import adamw_8bit
from jmem import nf4
from jmem import qlora
from jmem._src.cli import CliError
from jmem._src.cli import one_line
from jmem._src.cli import user_input
from jmem._src.finetune.config import DEFAULT_BETA
from jmem._src.finetune.config import DEFAULT_SIMPO_GAMMA
from jmem._src.finetune.config import LOSS_TYPES
from jmem._src.finetune.config import offload_of
from jmem._src.finetune.grpo_step import abstract_batch as grpo_abstract_batch
from jmem._src.finetune.grpo_step import grpo_loss
from jmem._src.finetune.mesh import mesh_sizes
from jmem._src.finetune.setup import job_levers
from jmem._src.names import OPTIMIZER_NAMES
from jmem._src.names import check_implements
from jmem._src.offload.disk import DiskState
from jmem.models import hf
from jmem.models import llama
from jmem.models import preference

OPTIMIZERS = {"adamw_8bit": adamw_8bit, "adamw_4bit": adamw_4bit, "adamw": optax.adamw}
check_implements("the job's OPTIMIZERS", OPTIMIZER_NAMES, OPTIMIZERS)


def full_finetuning(config) -> bool:
    """``--lora-rank 0``: every weight trains (16-bit params, fp32 masters); no NF4 base,
    no adapters."""
    return config.training.lora_rank == 0


def _full_loss(cfg, lv):
    """``loss_fn(params, batch, *, frozen=None, dropout_key=None)``: the full fine-tuning
    loss (no frozen base, no adapters; the keywords are the QLoRA loss's, unused)."""

    def loss_fn(params, batch, *, frozen=None, dropout_key=None):
        del frozen, dropout_key
        return llama.loss_fn(params, batch, cfg, levers=lv)

    return loss_fn


def _loss(cfg, lv):
    """``loss_fn(adapters, batch, *, frozen, dropout_key=None)``: the QLoRA loss. With
    ``--lora-dropout`` the train step passes each step and microbatch its own
    ``dropout_key`` (from the key in ``TrainState.dropout_key``, see ``train_step``);
    evaluation passes none and applies no dropout."""

    def loss_fn(adapters, batch, *, frozen, dropout_key=None):
        fn = qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv))
        return fn(frozen, adapters, batch, lora_dropout_key=dropout_key)

    return loss_fn


def preference_hyperparams(config) -> dict:
    """The preference loss's keyword arguments (``jmem.losses``) from the training group:
    ``beta`` (unset: ``DEFAULT_BETA``), DPO's ``loss_type`` and ``label_smoothing``,
    SimPO's ``gamma`` (``--simpo-gamma``, unset: ``DEFAULT_SIMPO_GAMMA``) and
    ``label_smoothing``."""
    t = config.training
    hyper = {"beta": DEFAULT_BETA[t.objective] if t.beta is None else t.beta}
    if t.objective == "dpo":
        loss_type = LOSS_TYPES["dpo"][0] if t.loss_type is None else t.loss_type
        hyper.update(loss_type=loss_type, label_smoothing=t.label_smoothing)
    elif t.objective == "simpo":
        gamma = DEFAULT_SIMPO_GAMMA if t.simpo_gamma is None else t.simpo_gamma
        hyper.update(gamma=gamma, label_smoothing=t.label_smoothing)
    return hyper


def _preference_loss(config, cfg, lv):
    """``loss(adapters, batch, *, frozen, dropout_key=None) -> (loss, metrics)`` of a
    preference ``--objective`` over ``[B, 2, S]`` pairs: the chosen and rejected answers as
    ``2B`` rows of one forward pass, log-probs by ``jmem.ops.sequence_logprobs`` over
    ``--loss-chunk`` tokens (no ``[B, S, V]`` logits); DPO's reference is the same base with
    the adapters off, in the step (``jmem.losses.preference_loss``)."""
    objective = config.training.objective
    logprobs = functools.partial(preference.sequence_logprobs, config=cfg, levers=lv)
    reference = "adapters_off" if objective == "dpo" else None
    return jmem.losses.preference_loss(
        logprobs, objective, reference=reference, **preference_hyperparams(config)
    )


def dropout_key(config):
    """The LoRA dropout key of a ``--lora-dropout`` run (from ``--seed``; the train step folds
    in the step and microbatch, and checkpoints it), or None without dropout."""
    return jax.random.key(config.run.seed + 2) if config.training.lora_dropout else None


def job_resolved_levers(config, cfg, dtype, target=None):
    """The job's ``jmem.Levers`` resolved for one microbatch ``[batch / grad_accum,
    seq_len]`` (preference pairs: twice the rows) in ``dtype`` on ``target`` (None: the
    running backend)."""
    data, batch = config.data, None
    if data.batch_size is not None and data.seq_len is not None:
        rows = rows_per_example(config) * max(1, data.batch_size // config.execution.grad_accum)
        batch = (rows, data.seq_len)
    context = mesh_sizes(config)[2]
    lv = jmem.resolve_levers(job_levers(config), cfg, batch, target, dtype=dtype, context=context)
    return _defaults_named(lv, config.execution)


def _defaults_named(levers, execution):
    """``levers`` with the reason of each lever that the job's default supplied (its
    ``--flag`` at its default value) beginning ``default`` where the resolver, which cannot
    tell, says ``as given``."""
    defaults = {f.name: f.default for f in dataclasses.fields(execution)}
    reasons = tuple(
        (k, "default" + why[len("as given") :])
        if why.startswith("as given") and k in defaults and getattr(execution, k) == defaults[k]
        else (k, why)
        for k, why in levers.reasons
    )
    return dataclasses.replace(levers, reasons=reasons)


def rows_per_example(config) -> int:
    """Sequences per example of a batch: 2 for preference pairs (chosen, rejected), else 1
    (GRPO's ``--batch-size`` counts completions)."""
    return 1 if config.training.objective in ("sft", "grpo") else 2


def abstract_batch(config) -> dict:
    """The train step's batch as ``jax.ShapeDtypeStruct``s (for ``--dry-run``): int32
    ``[B, S]`` inputs and targets, or for preference pairs ``[B, 2, S]`` inputs, targets and
    ``completion_mask``."""
    b, s = config.data.batch_size, config.data.seq_len
    if config.training.objective == "grpo":
        return grpo_abstract_batch(config)
    if config.training.objective == "sft":
        return {k: jax.ShapeDtypeStruct((b, s), jnp.int32) for k in ("inputs", "targets")}
    batch = {k: jax.ShapeDtypeStruct((b, 2, s), jnp.int32) for k in ("inputs", "targets")}
    batch["completion_mask"] = jax.ShapeDtypeStruct((b, 2, s), jnp.float32)
    return batch


def build(config, cfg, *, compute_dtype=None, mesh=None, target=None, disk=True):
    """The train step, the loss, the compute dtype and the learning-rate schedule; shared by
    training, the dry run and ``benchmarks/peer_qlora.py``.

    Args:
      config: a resolved ``FinetuneConfig`` (``lr`` and ``steps`` set).
      cfg: the model's ``LlamaConfig``.
      compute_dtype: overrides ``config.execution.precision`` (e.g. float32 for a benchmark).
      mesh: a ``jmem.sharding.make_mesh`` mesh: the step is sharded by its rules (FSDP).
      target: the compile target the levers are resolved for (``jmem.resolve_levers``;
        None: the running backend). The resolved levers are ``step.levers``; with
        ``--remat none`` they inline the layers (a layer loop would stack every saved
        activation).
      disk: with ``--offload-dir``, keep the state on disk (False: in host memory, the
        same device footprint, for the dry run's abstract compile).

    Raises:
      CliError: a bad ``--offload-dir`` (missing parent, not writable), in one line.

    Returns:
      ``(step, loss_fn, dtype, schedule)``: a ``jmem.TrainStep``, ``loss_fn(adapters,
      batch, *, frozen)`` (a preference ``--objective``: ``(loss, metrics)`` of a ``[B, 2,
      S]`` batch of pairs; grpo: of ``grpo_step.pack_rows``' batch; the step built with
      ``has_aux``), the compute dtype and the optax learning-rate schedule (warmup over
      ``updates / 20``, cosine decay to ``lr / 10``; ``updates`` is ``steps`` times
      ``updates_per_step``).
    """
    dtype = jnp.float16 if config.execution.precision == "fp16" else jnp.bfloat16
    dtype = dtype if compute_dtype is None else compute_dtype
    lv = job_resolved_levers(config, cfg, dtype, target)
    preference_run = config.training.objective != "sft"  # a loss with metrics (has_aux)
    full = full_finetuning(config)
    if config.training.objective == "grpo":
        loss_fn = grpo_loss(config, cfg, lv, full)
    elif preference_run:
        loss_fn = _preference_loss(config, cfg, lv)
    else:
        loss_fn = _full_loss(cfg, lv) if full else _loss(cfg, lv)
    updates = config.training.steps * updates_per_step(config)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        config.training.lr,
        warmup_steps=max(1, updates // 20),
        decay_steps=max(2, updates),
        end_value=config.training.lr / 10,
    )
    opt = OPTIMIZERS[config.training.optimizer](
        schedule, weight_decay=config.training.weight_decay, mask=jmem.decay_mask
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), opt)
    scale = DynamicLossScale(2.0**15, period=500) if dtype == jnp.float16 else NoOpLossScale()
    on_disk = disk and config.execution.offload_dir is not None
    with offload_dir_input() if on_disk else contextlib.nullcontext():
        step = jmem.train_step(
            loss_fn,
            opt,
            precision=_precision(dtype, full),
            master_weights=full,
            loss_scale=scale,
            levers=lv,
            microbatches=config.execution.grad_accum,
            offload_optimizer=offload_mode(config, disk),
            offload_dir=config.execution.offload_dir if on_disk else None,
            mesh=mesh,
            has_aux=preference_run,
        )
    return step, loss_fn, dtype, schedule


def updates_per_step(config) -> int:
    """Optimizer updates per step: GRPO's ``--num-iterations`` (mu updates per rollout),
    else 1."""
    return config.grpo.num_iterations if config.training.objective == "grpo" else 1


def _precision(dtype, full: bool) -> str:
    """The step's precision policy: fp32 adapters (QLoRA), or for full fine-tuning params
    stored in the compute dtype with fp32 masters in the optimizer state."""
    name = jnp.dtype(dtype).name
    return f"p={name if full else 'f32'},c={name},o=f32"


@contextlib.contextmanager
def offload_dir_input():
    """A ValueError about the disk state (``offload_dir ...``: a bad directory, too little
    space) as one CliError naming ``--offload-dir``."""
    try:
        yield
    except CliError:
        raise
    except ValueError as e:
        msg = one_line(e)
        rest = msg[len("offload_dir") :] if msg.startswith("offload_dir") else f": {msg}"
        raise CliError("--offload-dir" + rest) from e


def offload_mode(config, disk: bool = True):
    """``train_step``'s ``offload_optimizer`` for the job's flags: ``"disk"`` with
    ``--offload-dir`` (``True``, host memory, when ``disk`` is False), else ``--offload``."""
    offload = offload_of(config.execution)
    if offload.disk:
        return "disk" if disk else True
    return offload.optimizer


def checkpointable(state):
    """The state as checkpoints hold it: an optimizer state on disk as the optimizer's own
    state (its files as read-only memmaps; wait for the save before the next step)."""
    if isinstance(state.opt_state, DiskState):
        return state.replace(opt_state=state.opt_state.full())
    return state


def from_checkpoint(state, restored):
    """``restored`` (restored into ``checkpointable(state)``) as the step takes it: an
    optimizer state on disk is written back over ``state``'s files (they are rebuilt from
    the checkpoint, whatever a killed step left in them)."""
    if isinstance(state.opt_state, DiskState):
        return restored.replace(opt_state=state.opt_state.restored(restored.opt_state))
    return restored


def quantized_base(config, cfg, dtype, abstract: bool):
    """NF4 base params: from a checkpoint, or random (quantized on the device, in one jit)."""
    if config.model.checkpoint:
        if abstract:
            return jax.eval_shape(lambda: qlora.quantize_params(llama.abstract_params(cfg, dtype)))
        with user_input(f"--checkpoint {config.model.checkpoint}"):
            if cfg.num_experts:  # read in dtype, then NF4 (the router stays float)
                params, _ = hf.load_params(config.model.checkpoint, cfg, dtype=dtype)
                return jax.jit(qlora.quantize_params)(params)
            params, _ = hf.load_params(config.model.checkpoint, cfg, dtype=dtype, quantize="nf4")
        return params
    make = lambda k: qlora.quantize_params(llama.init(k, cfg, dtype))
    if abstract:
        return jax.eval_shape(make, jax.random.key(config.run.seed))
    return jax.jit(make)(jax.random.key(config.run.seed))


def full_params(config, cfg, abstract: bool):
    """Full fine-tuning's trainable params in float32 (``train_step`` takes the fp32 masters
    from them, then stores the params in the compute dtype): from a checkpoint, or random."""
    if config.model.checkpoint:
        if abstract:
            return llama.abstract_params(cfg, jnp.float32)
        with user_input(f"--checkpoint {config.model.checkpoint}"):
            params, _ = hf.load_params(config.model.checkpoint, cfg, dtype=jnp.float32)
        return params
    make = lambda k: llama.init(k, cfg, jnp.float32)
    if abstract:
        return jax.eval_shape(make, jax.random.key(config.run.seed))
    return jax.jit(make)(jax.random.key(config.run.seed))


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


def model_name(config) -> str:
    """``--config``'s name, or the ``--checkpoint`` directory's."""
    return config.model.config or os.path.basename(os.path.normpath(config.model.checkpoint))
