"""The training loop: state (new or resumed), evaluation on held-out batches, progress,
checkpoints every ``--save-every`` steps, and a stop at the first non-finite loss (or after
``--nonfinite-patience`` steps skipped in a row under fp16's dynamic loss scaling). One
step counter: step ``s`` is the ``s``-th step attempted, skipped ones included; checkpoints,
log lines, losses and resume all count it."""

from __future__ import annotations

import contextlib
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from jmem import Checkpointer
from jmem import MemoryReport
from jmem import data as jdata
from jmem import lora as jlora
from jmem import sharding
from jmem._src import lora_modules
from jmem._src import native_logs
from jmem._src.checkpointing import CheckpointDamagedError
from jmem._src.checkpointing import committed_steps
from jmem._src.cli import CliError
from jmem._src.cli import one_line
from jmem._src.cli import user_input
from jmem._src.finetune.build import build
from jmem._src.finetune.build import checkpointable
from jmem._src.finetune.build import dropout_key
from jmem._src.finetune.build import from_checkpoint
from jmem._src.finetune.build import full_finetuning
from jmem._src.finetune.build import full_params
from jmem._src.finetune.build import offload_dir_input
from jmem._src.finetune.build import quantized_base
from jmem._src.finetune.build import rows_per_example
from jmem._src.finetune.mesh import mesh_record
from jmem._src.finetune.outputs import Sampler
from jmem._src.finetune.outputs import save_adapters
from jmem._src.finetune.publish import RunPaths
from jmem._src.finetune.report import device_memory
from jmem._src.finetune.report import finish
from jmem._src.finetune.rundir import flags
from jmem._src.finetune.rundir import is_writer
from jmem._src.finetune.rundir import run_record
from jmem._src.finetune.rundir import write_json
from jmem._src.offload.disk import DiskState
from jmem._src.offload.disk import left_mid_update

format_bytes = MemoryReport.format_bytes


class TrainingStopped(CliError):
    """A run stopped at a non-finite loss (or after ``--nonfinite-patience`` skipped steps),
    or because a checkpoint could not be written; the message names the step and the last
    good checkpoint. Nothing is written after it: no checkpoint, adapters or summary."""


class Evaluator:
    """Loss over a fixed set of held-out batches (the first ``--eval-batches`` of the
    held-out split), with the adapters cast to the compute dtype as the train step does.
    A preference loss's metrics (reward margins, accuracies, rewards), averaged as the loss
    is, are in ``last_metrics`` after each call (None for SFT)."""

    def __init__(self, step, loss_fn, held, n_batches: int, mesh=None):
        self.last_metrics = None
        n = min(n_batches, held.batches_per_epoch)
        self.batches = [held.batch_at(jdata.Position(0, i * held.batch_size))[0] for i in range(n)]
        if mesh is not None:  # replicated: any row count, on one process or several
            rep = NamedSharding(mesh, PartitionSpec())
            place = lambda b: sharding.shard_state(b, jax.tree.map(lambda _: rep, b))
            self.device_batches = [place(b) for b in self.batches]
        else:
            self.device_batches = self.batches

        def eval_loss(params, frozen, batch):
            if step.precision is not None:
                params = step.precision.cast_to_compute(params)
            return loss_fn(params, batch, frozen=frozen)

        self._loss = jax.jit(eval_loss)
        self.has_aux = bool(self.batches) and "completion_mask" in self.batches[0]  # pairs

    def __call__(self, state) -> float:
        """The held-out loss: batch means weighted by their trained-on target tokens (by
        their pairs for a preference loss)."""
        outs = [self._loss(state.params, state.frozen, b) for b in self.device_batches]
        losses = [float(o[0] if self.has_aux else o) for o in outs]
        weights = [_weight(b) for b in self.batches]
        if not sum(weights):
            return float("nan")
        if self.has_aux:
            names = outs[0][1]
            self.last_metrics = {
                k: float(np.average([float(o[1][k]) for o in outs], weights=weights)) for k in names
            }
        return float(np.average(losses, weights=weights))


def _weight(batch) -> float:
    """A held-out batch's weight: its trained-on tokens (``mask``), or its examples."""
    if "mask" in batch:
        return float(np.sum(batch["mask"]))
    return float(len(batch["inputs"])) if "completion_mask" in batch else 1.0


def _meta(config, step, pos, losses, evals, lrs, skipped, metrics=None) -> dict:
    return {
        **(metrics or {}),  # a preference loss's per-step and held-out metrics
        "step": step,  # steps attempted; TrainState.step counts the updates applied
        "skipped_steps": skipped,
        "data": pos.to_dict(),
        "losses": losses,
        "eval_losses": evals,
        "learning_rates": lrs,
        "seed": config.run.seed,
        "args": flags(config),
    }


def init_state(config, cfg, step, dtype, ckpt, resume_step):
    """The train state (restored with ``--resume``: the newest intact checkpoint, a damaged
    newer one named in a note), the data position and the histories.

    On a mesh (``step`` built with one) the state is born sharded; a checkpoint is restored
    collectively onto this run's mesh, whatever mesh wrote it.

    Returns:
      ``(state, position, losses, eval_losses, trainable parameter count, history)``:
      ``history`` holds ``start`` (the steps attempted so far), ``learning_rates``,
      ``skipped_steps`` (those whose update was skipped for non-finite gradients) and a
      preference loss's ``metrics`` and ``eval_metrics``.

    Raises:
      CliError: when every checkpoint is damaged, or the state does not match it.
    """
    trainable, frozen = trainable_and_frozen(config, cfg, dtype)
    disk = config.execution.offload_dir
    torn = disk is not None and left_mid_update(disk)  # before init rewrites the files
    with offload_dir_input() if disk else contextlib.nullcontext():
        state = step.init(trainable, frozen=frozen, dropout_key=dropout_key(config))
    n_trainable = num_trainable(trainable)
    del trainable
    pos, losses, evals = jdata.Position(), [], []
    history = {"start": 0, "learning_rates": [], "skipped_steps": []}
    history.update(metrics=[], eval_metrics=[])
    if resume_step is not None:
        note = lambda line: print(f"note: {line}; trying the previous checkpoint", flush=True)
        with user_input("--resume", (CheckpointDamagedError, ValueError)):
            restored, meta = ckpt.restore(checkpointable(state), on_damaged=note)
        state = from_checkpoint(state, restored)
        pos = jdata.Position.from_dict(meta["data"])
        losses = list(meta.get("losses", []))
        evals = [list(e) for e in meta.get("eval_losses", [])]
        history = {
            "start": int(meta.get("step", int(state.step))),
            "learning_rates": list(meta.get("learning_rates", [])),
            "skipped_steps": list(meta.get("skipped_steps", [])),
            "metrics": list(meta.get("metrics", [])),
            "eval_metrics": list(meta.get("eval_metrics", [])),
        }
        print(
            f"Resumed at step {history['start']} (data epoch {pos.epoch}, index {pos.index}).",
            flush=True,
        )
    if torn:
        source = f"checkpoint step {history['start']}" if resume_step is not None else "init"
        print(
            f"note: --offload-dir {disk} was left in the middle of an update (step.json: clean "
            f"false); its files were rebuilt from {source}, not read.",
            flush=True,
        )
    return state, pos, losses, evals, n_trainable, history


def trainable_and_frozen(config, cfg, dtype):
    """``(trainable, frozen)``: LoRA adapters on the NF4 base, or (``--lora-rank 0``, full
    fine-tuning) the float32 params and no frozen tree."""
    if full_finetuning(config):
        return full_params(config, cfg, abstract=False), None
    frozen = quantized_base(config, cfg, dtype, abstract=False)
    adapters = jlora.init(
        jax.random.key(config.run.seed + 1),
        frozen,
        rank=config.training.lora_rank,
        alpha=config.training.lora_alpha,
        modules=lora_modules.modules(config.training.lora_targets),
        dropout=config.training.lora_dropout,
    )
    return adapters, frozen


def num_trainable(trainable) -> int:
    """Trainable elements: every float leaf (LoRA adapters: ``jmem.lora.num_trainable``)."""
    return sum(int(math.prod(x.shape)) for x in jax.tree.leaves(trainable))


def disk_record(state, steps: int) -> dict:
    """Summary fields of an optimizer state on disk (``--offload-dir``): its bytes and the
    seconds per step this process spent reading and writing it; empty otherwise."""
    opt = state.opt_state
    if not isinstance(opt, DiskState):
        return {}
    return {
        "offload_disk_bytes": opt.store.nbytes,
        "offload_disk_io_s_per_step": opt.store.io_seconds / max(1, steps),
    }


def step_batch(batch: dict, mesh=None) -> dict:
    """The batch as the train step takes it: on a mesh, placed with
    ``jmem.sharding.shard_batch``."""
    return batch if mesh is None else sharding.shard_batch(batch, mesh)


class Progress:
    """A tqdm bar, or (``--no-progress``) a log line every 10 steps."""

    def __init__(self, config, start: int):
        self.bar = None
        if not config.run.no_progress and jax.process_index() == 0:
            from tqdm.auto import tqdm  # noqa: PLC0415

            self.bar = tqdm(
                total=config.training.steps, initial=start, desc="finetune", dynamic_ncols=True
            )
        self.start = start

    def update(self, s, loss, evals, lr, tps, mem, aux=None):
        ev = evals[-1][1] if evals else None
        if self.bar is not None:
            post = {"loss": f"{loss:.3f}"}
            if aux:
                post.update(margin=f"{aux['rewards/margins']:.3f}")
                post.update(acc=f"{aux['rewards/accuracies']:.2f}")
            if ev is not None:
                post["eval"] = f"{ev:.3f}"
            post.update(lr=f"{lr:.1e}", tok_s=f"{tps:,.0f}", mem=format_bytes(mem))
            self.bar.set_postfix(post)
            self.bar.update(1)
        elif (s + 1) % 10 == 0 or s == self.start or (evals and evals[-1][0] == s + 1):
            print(
                f"step {s + 1:5d}  loss {loss:.4f}"
                + (preference_line(aux) if aux else "")
                + (f"  eval {ev:.4f}" if ev is not None else "")
                + f"  lr {lr:.2e}  {tps:,.0f} tok/s  mem {format_bytes(mem)}",
                flush=True,
            )

    def close(self):
        if self.bar is not None:
            self.bar.close()


def preference_line(aux: dict) -> str:
    """A preference step's metrics in a log line: reward margin, accuracy, and the chosen
    and rejected rewards (``jmem.losses``' ``rewards/*``, batch means)."""
    r = {k: _four_places(v) for k, v in aux.items() if k.startswith("rewards/")}
    return (
        f"  margin {r['rewards/margins']}  acc {aux['rewards/accuracies']:.2f}"
        f"  chosen {r['rewards/chosen']}  rejected {r['rewards/rejected']}"
    )


def _four_places(value) -> str:
    """``value`` to 4 places, without the sign of a value that rounds to zero."""
    text = f"{float(value):.4f}"
    return "0.0000" if text == "-0.0000" else text


def _compile(step, state, batch):
    """One compile of the step: the executable and its peak bytes (per device on a mesh)."""
    t0 = time.perf_counter()
    with native_logs.hidden():
        compiled = step.jitted.lower(state, batch).compile()
    peak = MemoryReport.from_compiled(compiled).peak_bytes
    per = (
        " per device"
        if isinstance(batch["inputs"], jax.Array) and batch["inputs"].sharding.num_devices > 1
        else ""
    )
    print(
        f"compiled the train step in {time.perf_counter() - t0:.1f}s; "
        f"compiled peak {format_bytes(peak)}{per}",
        flush=True,
    )
    return compiled, peak


class _Guard:
    """The stop at a non-finite step: a non-finite loss stops at once; non-finite gradients
    with a finite loss are a skipped step, normal under fp16's dynamic loss scaling while
    the scale calibrates, so there ``--nonfinite-patience`` of them in a row stop the run
    (under bf16, one does)."""

    def __init__(self, config, ckpt, aside: str | None = None):
        self.dynamic = config.execution.precision == "fp16"
        self.patience = config.training.nonfinite_patience
        self.ckpt, self.skipped, self.aside = ckpt, 0, aside

    def __call__(self, s: int, loss: float, grads_finite: bool) -> None:
        if math.isfinite(loss) and grads_finite:
            self.skipped = 0
            return
        if self.dynamic and math.isfinite(loss):
            self.skipped += 1
            if self.skipped < self.patience:
                return
            why = (
                f"{self.skipped} steps in a row skipped for non-finite gradients under "
                f"dynamic loss scaling (--nonfinite-patience {self.patience})"
            )
        elif not math.isfinite(loss):
            why = f"the loss is {loss}"
        else:
            why = "the gradients are not finite"
        raise TrainingStopped(
            f"step {s + 1}: {why}; stopped without writing a checkpoint, adapters or summary; "
            f"{continue_from(self.ckpt, self.aside)}; lower --lr first"
        )


def last_good(ckpt) -> str:
    """``the last good checkpoint is step N in DIR`` (committed, on disk), or none."""
    with_errors = (OSError, ValueError, RuntimeError)
    try:
        ckpt.wait()
    except with_errors:
        pass
    steps = committed_steps(ckpt.directory)
    if not steps:
        return f"no checkpoint was written in {ckpt.directory}"
    return f"the last good checkpoint is step {steps[-1]} in {ckpt.directory}"


def continue_from(ckpt, aside: str | None) -> str:
    """What a stopped run leaves to continue from: its last good checkpoint (``--resume``
    continues from it) or, for a run that was to replace the run in ``aside`` (its
    ``--out``, ``--overwrite``), that the earlier run is kept as it was."""
    if aside:
        return (
            f"--overwrite: the earlier run in {aside} is kept as it was, this run's "
            "checkpoints are discarded"
        )
    good = last_good(ckpt)  # waits for a save in flight first
    if not committed_steps(ckpt.directory):  # a new run: the job removes its run.json too
        return f"{good}; --out keeps nothing of this run, run it again"
    return f"{good} (--resume continues from it)"


@contextlib.contextmanager
def _writing(ckpt, n: int, aside: str | None = None):
    """Checkpoint ``n`` written (or waited for) inside; a failed write (a full disk; orbax
    reports an asynchronous one at the next save or wait) names the last good one."""
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:
        raise TrainingStopped(
            f"checkpoint step {n} (or the one before) could not be written "
            f"({one_line(e)[:200]}); {continue_from(ckpt, aside)}"
        ) from e


def train(config, cfg, tok, ds, held, resume_step, mesh=None, paths=None):
    """Trains from step 0 or ``resume_step`` to ``config.training.steps``: evaluates, samples,
    checkpoints (collectively across processes), writes the adapters and the report.
    ``run.json`` is written once the state is built (restored): a refused resume leaves
    the previous one. A resumed run whose checkpoint is already at ``--steps`` (killed
    after its last checkpoint) trains nothing and writes the outputs.

    Checkpoints and ``run.json`` go to ``paths.work``, the outputs to ``paths.staging``
    (a ``jmem._src.finetune.publish.RunPaths``; default: ``--out``'s, not aside), where
    the caller publishes them.

    Returns:
      The summary (``summary.json``).

    Raises:
      TrainingStopped: at a non-finite step or a checkpoint that cannot be written; the
        previous adapters, summary and plot are left as they were.
    """
    paths = paths or RunPaths.of(config)
    step, loss_fn, dtype, schedule = build(config, cfg, mesh=mesh)
    print(f"levers:\n{step.levers.describe()}", flush=True)
    ckpt = Checkpointer(
        os.path.join(os.path.abspath(paths.work), "checkpoints"),
        save_every=config.run.save_every,
        keep=config.run.keep,
    )
    state, pos, losses, evals, n_adapter, history = init_state(
        config, cfg, step, dtype, ckpt, resume_step
    )
    if is_writer():
        write_json(os.path.join(paths.work, "run.json"), run_record(config))
    evaluate = None
    if held is not None:
        evaluate = Evaluator(step, loss_fn, held, config.data.eval_batches, mesh)
    start = history["start"]
    # Compile once; the same executable gives the memory report and runs every step.
    compiled, compiled_peak = _compile(step, state, step_batch(ds.batch_at(pos)[0], mesh))
    if evaluate is not None and start == 0:
        evals.append([0, evaluate(state)])
        if evaluate.last_metrics is not None:
            history["eval_metrics"].append([0, evaluate.last_metrics])
    chat = getattr(ds, "report", {}).get("chat", False)  # sample in the chat template
    sample = None if config.output.sample_prompt is None else Sampler(config, cfg, tok, step, chat)
    if sample is not None:
        sample(state, f"before (step {start})")
    run = _Run(config, ckpt, compiled, evaluate, schedule, mesh)
    run.aside = paths.out if paths.aside else None
    lrs = history["learning_rates"][:start]  # a checkpoint of jmem <= 0.2 has none
    run.losses, run.evals, run.lrs = losses, evals, lrs + run.schedule[len(lrs) : start]
    run.skipped = history["skipped_steps"]
    run.metrics, run.eval_metrics = history["metrics"][:start], history["eval_metrics"]
    try:
        state, pos, times = run.steps(state, pos, ds, start, compiled_peak)
    except TrainingStopped:
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            ckpt.close()  # orbax's threads end; nothing more is written
        raise
    ckpt.close()
    if sample is not None:
        sample(state, f"after (step {config.training.steps})")
    save_adapters(config, cfg, state, paths)
    tokens_per_step = rows_per_example(config) * config.data.batch_size * config.data.seq_len
    tps = tokens_per_step / float(np.median(times[1:])) if len(times) > 1 else None
    extra = {**getattr(ds, "report", {}), **mesh_record(mesh), "skipped_steps": run.skipped}
    extra.update(disk_record(state, len(times)))
    if config.training.objective != "sft":
        extra.update(metrics=run.metrics, eval_metrics=run.eval_metrics)
    if sample is not None:
        extra.update(sample.record())
    return finish(
        config, cfg, losses, evals, run.lrs, tps, n_adapter, compiled_peak, extra, paths.staging
    )


class _Run:
    """The steps of a run, from ``start`` to ``--steps``, with their histories."""

    def __init__(self, config, ckpt, compiled, evaluate, schedule, mesh):
        self.config, self.ckpt, self.compiled = config, ckpt, compiled
        self.evaluate, self.mesh = evaluate, mesh
        steps = config.training.steps
        # the learning rate of the n-th applied update (skipped steps apply none)
        self.schedule = np.asarray(schedule(jnp.arange(steps + 1)), np.float64).tolist()
        self.losses, self.evals, self.lrs, self.skipped = [], [], [], []
        self.aside = None  # the --out whose earlier run this one is to replace
        self.metrics, self.eval_metrics = [], []  # a preference loss's, per step

    def steps(self, state, pos, ds, start, compiled_peak):
        """Runs steps ``start..--steps``; returns ``(state, position, step times)``."""
        config, total = self.config, self.config.training.steps
        tokens_per_step = rows_per_example(config) * config.data.batch_size * config.data.seq_len
        progress, guard = Progress(config, start), _Guard(config, self.ckpt, self.aside)
        times, it = [], ds.iterate(pos)
        applied = int(state.step)  # the updates applied so far (the schedule's count)
        for s in range(start, total):
            batch, pos = next(it)
            batch = step_batch(batch, self.mesh)
            t0 = time.perf_counter()
            state, metrics = self.compiled(state, batch)
            loss = float(metrics["loss"])  # blocks until the step is done
            times.append(time.perf_counter() - t0)
            guard(s, loss, bool(metrics["grads_finite"]))
            self.losses.append(loss)
            self.lrs.append(self.schedule[min(applied, total)])
            if int(metrics["step"]) == applied:  # no update: skipped (fp16 loss scaling)
                self.skipped.append(s + 1)
            applied = int(metrics["step"])
            aux = {k: float(v) for k, v in metrics.get("aux", {}).items()}
            if aux:
                self.metrics.append(aux)
            self._evaluate(s + 1, state)
            tps = tokens_per_step / np.median(times[1:] or times)  # the first call warms up
            mem = device_memory() or compiled_peak
            progress.update(s, loss, self.evals, self.lrs[-1], tps, mem, aux)
            with _writing(self.ckpt, s + 1, self.aside):
                if self.ckpt.maybe_save(s + 1, checkpointable(state), self._meta(s + 1, pos)):
                    if checkpointable(state) is not state:  # the disk files change next step
                        self.ckpt.wait()
        progress.close()
        with _writing(self.ckpt, total, self.aside):
            if total not in self.ckpt.all_steps():  # always keep the last
                self.ckpt.save(total, checkpointable(state), self._meta(total, pos))
            self.ckpt.wait()
        return state, pos, times

    def _evaluate(self, n: int, state) -> None:
        """Evaluates after step ``n`` every ``--eval-every`` steps and after the last."""
        if self.evaluate is None:
            return
        if n % self.config.data.eval_every and n != self.config.training.steps:
            return
        self.evals.append([n, self.evaluate(state)])
        if self.evaluate.last_metrics is not None:
            self.eval_metrics.append([n, self.evaluate.last_metrics])

    def _meta(self, n, pos):
        metrics = {"metrics": self.metrics, "eval_metrics": self.eval_metrics}
        return _meta(self.config, n, pos, self.losses, self.evals, self.lrs, self.skipped, metrics)
