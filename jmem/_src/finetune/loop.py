"""The training loop: state (new or resumed), evaluation on held-out batches, progress,
checkpoints every ``--save-every`` steps."""

from __future__ import annotations

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
from jmem._src.finetune.build import build
from jmem._src.finetune.build import dropout_key
from jmem._src.finetune.build import quantized_base
from jmem._src.finetune.mesh import mesh_record
from jmem._src.finetune.outputs import Sampler
from jmem._src.finetune.outputs import save_adapters
from jmem._src.finetune.report import device_memory
from jmem._src.finetune.report import finish
from jmem._src.finetune.rundir import flags

format_bytes = MemoryReport.format_bytes


class Evaluator:
    """Loss over a fixed set of held-out batches (the first ``--eval-batches`` of the
    held-out split), with the adapters cast to the compute dtype as the train step does."""

    def __init__(self, step, loss_fn, held, n_batches: int, mesh=None):
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

    def __call__(self, state) -> float:
        """The held-out loss: batch means weighted by their trained-on target tokens."""
        losses = [float(self._loss(state.params, state.frozen, b)) for b in self.device_batches]
        weights = [float(np.sum(b["mask"])) if "mask" in b else 1.0 for b in self.batches]
        return float(np.average(losses, weights=weights)) if sum(weights) else float("nan")


def _meta(config, pos, losses, evals) -> dict:
    return {
        "data": pos.to_dict(),
        "losses": losses,
        "eval_losses": evals,
        "seed": config.run.seed,
        "args": flags(config),
    }


def init_state(config, cfg, step, dtype, ckpt, resume_step):
    """The train state (restored with ``--resume``), the data position and the histories.

    On a mesh (``step`` built with one) the state is born sharded; a checkpoint is restored
    collectively onto this run's mesh, whatever mesh wrote it.

    Returns:
      ``(state, position, losses, eval_losses, trainable parameter count)``.
    """
    frozen = quantized_base(config, cfg, dtype, abstract=False)
    adapters = jlora.init(
        jax.random.key(config.run.seed + 1),
        frozen,
        rank=config.training.lora_rank,
        alpha=config.training.lora_alpha,
        targets=config.training.lora_targets,
        dropout=config.training.lora_dropout,
    )
    state = step.init(adapters, frozen=frozen, dropout_key=dropout_key(config))
    pos, losses, evals = jdata.Position(), [], []
    if resume_step is not None:
        state, meta = ckpt.restore(state)
        pos = jdata.Position.from_dict(meta["data"])
        losses = list(meta.get("losses", []))
        evals = [list(e) for e in meta.get("eval_losses", [])]
        print(f"Resumed at step {int(state.step)} (data epoch {pos.epoch}, index {pos.index}).")
    return state, pos, losses, evals, jlora.num_trainable(adapters)


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
                total=config.training.steps, initial=start, desc="qlora", dynamic_ncols=True
            )
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


def _compile(step, state, batch):
    """One compile of the step: the executable and its peak bytes (per device on a mesh)."""
    t0 = time.perf_counter()
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


def train(config, cfg, tok, ds, held, resume_step, mesh=None):
    """Trains from step 0 or ``resume_step`` to ``config.training.steps``: evaluates, samples,
    checkpoints (collectively across processes), writes the adapters and the report.

    Returns:
      The summary (``summary.json``).
    """
    step, loss_fn, dtype, schedule = build(config, cfg, mesh=mesh)
    print(f"levers:\n{step.levers.describe()}", flush=True)
    ckpt = Checkpointer(
        os.path.join(os.path.abspath(config.run.out), "checkpoints"),
        save_every=config.run.save_every,
        keep=config.run.keep,
    )
    state, pos, losses, evals, n_adapter = init_state(config, cfg, step, dtype, ckpt, resume_step)
    evaluate = None
    if held is not None:
        evaluate = Evaluator(step, loss_fn, held, config.data.eval_batches, mesh)
    start = int(state.step)
    # Compile once; the same executable gives the memory report and runs every step.
    compiled, compiled_peak = _compile(step, state, step_batch(ds.batch_at(pos)[0], mesh))
    lrs = np.asarray(schedule(jnp.arange(config.training.steps)), np.float64).tolist()
    if evaluate is not None and start == 0:
        evals.append([0, evaluate(state)])
    chat = getattr(ds, "report", {}).get("chat", False)  # sample in the chat template
    sample = None if config.output.sample_prompt is None else Sampler(config, cfg, tok, step, chat)
    if sample is not None:
        sample(state, f"before (step {start})")
    tokens_per_step = config.data.batch_size * config.data.seq_len
    progress = Progress(config, start)
    times, it = [], ds.iterate(pos)
    for s in range(start, config.training.steps):
        batch, pos = next(it)
        batch = step_batch(batch, mesh)
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        loss = float(metrics["loss"])  # blocks until the step is done
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if evaluate is not None and (
            (s + 1) % config.data.eval_every == 0 or s + 1 == config.training.steps
        ):
            evals.append([s + 1, evaluate(state)])
        tps = tokens_per_step / np.median(times[1:] or times)  # the first call warms up
        progress.update(s, loss, evals, lrs[s], tps, device_memory() or compiled_peak)
        ckpt.maybe_save(s + 1, state, _meta(config, pos, losses, evals))
    progress.close()
    if config.training.steps not in ckpt.all_steps():
        ckpt.save(
            config.training.steps, state, _meta(config, pos, losses, evals)
        )  # always keep the last
    ckpt.close()
    if sample is not None:
        sample(state, f"after (step {config.training.steps})")
    save_adapters(config, cfg, state)
    tps = tokens_per_step / float(np.median(times[1:])) if len(times) > 1 else None
    extra = {**getattr(ds, "report", {}), **mesh_record(mesh)}
    if sample is not None:
        extra.update(sample.record())
    return finish(config, cfg, losses, evals, lrs, tps, n_adapter, compiled_peak, extra)
