"""GRPO's training loop: per step, ``--batch-size / --num-generations`` prompts (a seeded
order, a function of the step alone), their completions sampled over the current adapters
(``llama.rollout``, the key ``fold_in(seed key, step)``), the rewards of the completions'
text (``--reward``), group-relative advantages, then ``--num-iterations`` updates of
``jmem.losses.grpo``. Stateless in the data and the sampler, so a resumed run repeats the
uninterrupted one bit for bit; checkpoints, the guard against non-finite steps and the
report are the SFT loop's."""

from __future__ import annotations

import contextlib
import os
import time

import jax
import numpy as np

from jmem import Checkpointer
from jmem import data as jdata
from jmem._src.cli import one_line
from jmem._src.finetune.build import build
from jmem._src.finetune.build import checkpointable
from jmem._src.finetune.build import full_finetuning
from jmem._src.finetune.build import updates_per_step
from jmem._src.finetune.grpo_step import abstract_batch
from jmem._src.finetune.grpo_step import eos_id
from jmem._src.finetune.grpo_step import logps_program
from jmem._src.finetune.grpo_step import loss_hyperparams
from jmem._src.finetune.grpo_step import pack_rows
from jmem._src.finetune.grpo_step import rollout_program
from jmem._src.finetune.loop import TrainingStopped
from jmem._src.finetune.loop import _compile
from jmem._src.finetune.loop import _Guard
from jmem._src.finetune.loop import _meta
from jmem._src.finetune.loop import _writing
from jmem._src.finetune.loop import continue_from
from jmem._src.finetune.loop import init_state
from jmem._src.finetune.loop import step_batch
from jmem._src.finetune.outputs import save_adapters
from jmem._src.finetune.prompt_data import prompt_columns
from jmem._src.finetune.publish import RunPaths
from jmem._src.finetune.report import finish
from jmem._src.finetune.rundir import is_writer
from jmem._src.finetune.rundir import run_record
from jmem._src.finetune.rundir import write_json
from jmem._src.grpo import group_advantages
from jmem._src.rewards import RewardError

#: Completions printed at each sample point, and the characters kept of each text.
SAMPLES, SAMPLE_CHARS = 2, 80
#: The offset of ``--seed`` of the sampler's key (the base uses seed, adapters seed + 1,
#: LoRA dropout seed + 2).
ROLLOUT_SEED = 3


def prompt_indices(step: int, n_prompts: int, per_step: int, seed: int) -> np.ndarray:
    """The prompts of step ``step`` (0-based): ``per_step`` consecutive places of a
    sequence of epochs, each a permutation of ``n_prompts`` seeded by ``(seed, epoch)``.
    A function of the step alone: a resumed run takes the same prompts."""
    places = np.arange(step * per_step, (step + 1) * per_step)
    out = np.empty(per_step, np.int64)
    for epoch in np.unique(places // n_prompts):
        order = np.random.default_rng([seed, int(epoch)]).permutation(n_prompts)
        here = places // n_prompts == epoch
        out[here] = order[places[here] % n_prompts]
    return out


def rollout_key(seed: int, step: int) -> jax.Array:
    """Step ``step``'s sampler key: ``fold_in(key(seed + ROLLOUT_SEED), step)``."""
    return jax.random.fold_in(jax.random.key(seed + ROLLOUT_SEED), step)


def left_padded(records, idx, length: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 ``[P, length]`` prompt ids (left-padded with 0) and their mask."""
    ids = np.zeros((len(idx), length), np.int32)
    mask = np.zeros((len(idx), length), np.int32)
    for r, i in enumerate(idx):
        tokens = np.asarray(records[i].ids, np.int32)[-length:]
        ids[r, length - len(tokens) :] = tokens
        mask[r, length - len(tokens) :] = 1
    return ids, mask


def completion_texts(tok, ro) -> list[str]:
    """Each completion's text: its tokens up to and including the EOS, decoded."""
    ids, mask = np.asarray(ro.completion_ids), np.asarray(ro.completion_mask)
    return [tok.decode(row[m > 0].tolist()) for row, m in zip(ids, mask)]


def score(reward_set, records, idx, ro, texts, g: int, step: int):
    """``(total [B], per-function {name: [B]})``: the rewards of step ``step``'s
    completions (``rewards.RewardSet``: their text and token ids, each prompt's text and
    columns repeated ``g`` times, TRL's order).

    Raises:
      TrainingStopped: naming the step and the reward's one-line error (a function that
        raised, a wrong length, NaN, a missing column)."""
    batch = [records[i] for i in idx]
    prompts = [r.text for r in batch for _ in range(g)]
    ids, mask = np.asarray(ro.completion_ids), np.asarray(ro.completion_mask)
    completion_ids = [row[m > 0].tolist() for row, m in zip(ids, mask)]
    try:
        total, per = reward_set(prompts, texts, prompt_columns(batch, g), completion_ids)
    except RewardError as e:
        raise TrainingStopped(f"step {step + 1}: {one_line(e)}") from e
    return np.asarray(total, np.float32), {k: np.asarray(v, np.float32) for k, v in per.items()}


def reward_metrics(total, per, g: int, scale: str):
    """``(advantages [B], metrics)``: group-relative advantages and the reward metrics
    named as TRL logs them (``reward``, ``reward_std`` the mean of the groups' standard
    deviations, ``rewards/NAME/mean``, ``rewards/NAME/std`` over the rows the function
    scored, None where it scored none, ``advantage_std``)."""
    adv = np.asarray(group_advantages(total, g, scale))
    groups = total.reshape(-1, g)
    m = {"reward": float(total.mean()), "reward_std": float(groups.std(axis=1, ddof=1).mean())}
    for name, v in per.items():
        m[f"rewards/{name}/mean"] = float(np.nanmean(v)) if np.any(v == v) else None
        m[f"rewards/{name}/std"] = float(np.nanstd(v)) if np.any(v == v) else None
    m["advantage_std"] = float(adv.std())
    return adv, m


def completion_metrics(ro, max_len: int, eos: int | None) -> dict:
    """Completion lengths (tokens, EOS included): mean, max and the share clipped at
    ``--max-completion-len`` (no EOS), as TRL's ``completions/*``."""
    mask = np.asarray(ro.completion_mask)
    lengths = mask.sum(axis=1)
    last = np.asarray(ro.completion_ids)[:, -1]
    clipped = (lengths == max_len) & (last != (-1 if eos is None else eos))
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/max_length": int(lengths.max()),
        "completions/clipped_ratio": float(np.mean(clipped)),
    }


def log_line(s: int, loss: float, m: dict, names, beta: float) -> str:
    """A step's log line: loss, reward mean and std (and per function), advantage std, KL
    (``--beta`` > 0), clip fractions, completion lengths, generation and training tok/s."""
    value = lambda n: m[f"rewards/{n}/mean"]
    text = lambda n: "-" if value(n) is None else f"{value(n):.3f}"
    per = "".join(f" {n} {text(n)}" for n in names) if len(names) > 1 else ""
    kl = f"  kl {m['kl']:.4f}" if beta > 0 else ""
    return (
        f"step {s + 1:5d}  loss {loss:.4f}  reward {m['reward']:.3f} ± {m['reward_std']:.3f}"
        + (f" ({per.strip()})" if per else "")
        + f"  adv std {m['advantage_std']:.3f}{kl}"
        + f"  clip {m['clip_ratio/low_mean']:.3f}/{m['clip_ratio/high_mean']:.3f}"
        + f"  len {m['completions/mean_length']:.1f} (max {m['completions/max_length']},"
        + f" {m['completions/clipped_ratio']:.0%} clipped)"
        + f"  gen {m['generation_tokens_per_s']:,.0f} tok/s"
        + f"  train {m['train_tokens_per_s']:,.0f} tok/s"
    )


def sample_lines(records, idx, texts, total, g: int) -> list[str]:
    """A few sampled completions (the first of the first prompts) with their rewards,
    their text shortened to ``SAMPLE_CHARS`` characters."""
    short = lambda t: repr(t if len(t) <= SAMPLE_CHARS else t[:SAMPLE_CHARS] + "...")
    out = []
    for k in range(min(SAMPLES, len(idx))):
        row = k * g
        out.append(
            f"  sample (reward {total[row]:.3f}): {short(records[idx[k]].text)} -> "
            f"{short(texts[row])}"
        )
    return out


class GrpoRun:
    """The steps of a GRPO run, ``start`` to ``--steps``, with their histories."""

    def __init__(self, config, cfg, tok, step, compiled, records, reward_set, ckpt):
        self.config, self.tok, self.step, self.compiled = config, tok, step, compiled
        self.records, self.reward_set, self.ckpt = records, reward_set, ckpt
        self.sample = rollout_program(config, cfg, tok)
        self.logps = logps_program(config, cfg, step.levers)
        self.beta = loss_hyperparams(config)["beta"]
        self.full = full_finetuning(config)
        self.losses, self.lrs, self.skipped, self.metrics = [], [], [], []
        self.samples, self.aside, self.mesh, self.schedule = [], None, None, []

    def _policy(self, state):
        """The adapters (or full params) in the compute dtype, as the train step uses them."""
        params = state.params
        if self.step.precision is not None:
            params = self.step.precision.cast_to_compute(params)
        return params

    def _batch(self, state, s: int):
        """Step ``s``'s rollout, rewards and train batch: ``(batch, metrics, sample lines)``."""
        config, g = self.config, self.config.grpo
        per_step = config.data.batch_size // g.num_generations
        idx = prompt_indices(s, len(self.records), per_step, config.run.seed)
        ids, mask = left_padded(self.records, idx, g.max_prompt_len)
        t0 = time.perf_counter()
        frozen = None if self.full else state.frozen
        ro = self.sample(self._policy(state), frozen, ids, mask, rollout_key(config.run.seed, s))
        ro = jax.tree.map(np.asarray, ro)  # blocks until sampled
        gen_s = time.perf_counter() - t0
        texts = completion_texts(self.tok, ro)
        total, per = score(self.reward_set, self.records, idx, ro, texts, g.num_generations, s)
        adv, m = reward_metrics(total, per, g.num_generations, g.scale_rewards)
        m.update(completion_metrics(ro, g.max_completion_len, eos_id(self.tok)))
        m["generation_tokens_per_s"] = float(np.sum(ro.completion_mask)) / max(gen_s, 1e-9)
        batch = pack_rows(config, ro, adv)
        if g.num_iterations > 1:  # the policy before the first update, not the sampler's
            batch["old_logps"] = np.asarray(self.logps(state.params, frozen, batch, False))
        if self.beta > 0:
            batch["ref_logps"] = np.asarray(self.logps(state.params, frozen, batch, True))
        return batch, m, sample_lines(self.records, idx, texts, total, g.num_generations)

    def _updates(self, state, s, batch, guard):
        """``--num-iterations`` updates on one batch: ``(state, mean loss, last aux,
        seconds)``."""
        batch = step_batch(batch, self.mesh)
        losses, t0 = [], time.perf_counter()
        for _ in range(updates_per_step(self.config)):
            applied = int(state.step)
            state, out = self.compiled(state, batch)
            loss = float(out["loss"])
            guard(s, loss, bool(out["grads_finite"]))
            if int(out["step"]) == applied:
                self.skipped.append(s + 1)
            losses.append(loss)
        aux = {k: float(v) for k, v in out.get("aux", {}).items()}
        return state, float(np.mean(losses)), aux, time.perf_counter() - t0

    def steps(self, state, start: int):
        """Runs steps ``start..--steps``; returns ``(state, training seconds per step)``."""
        config, total = self.config, self.config.training.steps
        guard, times = _Guard(config, self.ckpt, self.aside), []
        tokens = config.data.batch_size * config.data.seq_len * updates_per_step(config)
        names = tuple(self.reward_set.names)
        for s in range(start, total):
            try:
                batch, m, lines = self._batch(state, s)
            except TrainingStopped as e:
                raise TrainingStopped(f"{e}; {continue_from(self.ckpt, self.aside)}") from e
            lr = self.schedule[min(int(state.step), len(self.schedule) - 1)]
            state, loss, aux, secs = self._updates(state, s, batch, guard)
            times.append(secs)
            m.update(aux, train_tokens_per_s=tokens / max(secs, 1e-9))
            self.losses.append(loss)
            self.lrs.append(lr)
            self.metrics.append(m)
            print(log_line(s, loss, m, names, self.beta), flush=True)
            if s == start or (s + 1) % config.data.eval_every == 0 or s + 1 == total:
                print("\n".join(lines), flush=True)
                self.samples.append([s + 1, lines])
            with _writing(self.ckpt, s + 1, self.aside):
                self.ckpt.maybe_save(s + 1, checkpointable(state), self._meta(s + 1))
        with _writing(self.ckpt, total, self.aside):
            if total not in self.ckpt.all_steps():  # always keep the last
                self.ckpt.save(total, checkpointable(state), self._meta(total))
            self.ckpt.wait()
        return state, times

    def _meta(self, n: int) -> dict:
        per_step = self.config.data.batch_size // self.config.grpo.num_generations
        place = n * per_step
        pos = jdata.Position(place // len(self.records), place % len(self.records))
        metrics = {"metrics": self.metrics, "eval_metrics": []}
        return _meta(self.config, n, pos, self.losses, [], self.lrs, self.skipped, metrics)


def _zeros(config) -> dict:
    """A batch of zeros shaped as the train step's (for its one compile)."""
    return {k: np.zeros(v.shape, v.dtype) for k, v in abstract_batch(config).items()}


def reward_summary(metrics, names) -> dict:
    """summary.json's reward fields: ``rewards`` (each step's mean reward) and
    ``reward_functions`` (each function's mean over the steps)."""
    out = {"rewards": [m["reward"] for m in metrics]}
    means = {n: [m[f"rewards/{n}/mean"] for m in metrics] for n in names}
    means = {n: [v for v in vs if v is not None] for n, vs in means.items()}
    out["reward_functions"] = {n: float(np.mean(v)) if v else None for n, v in means.items()}
    return out


def train_grpo(config, cfg, tok, records, reward_set, resume_step, mesh=None, paths=None):
    """Trains a GRPO run from step 0 or ``resume_step`` to ``--steps`` (the SFT loop's
    ``train`` for ``--objective grpo``): checkpoints, adapters, ``summary.json`` (with the
    per-step ``rewards`` and each reward function's mean), ``metrics.jsonl`` and the plot.

    Args:
      config: the resolved config; cfg: the model; tok: the tokenizer.
      records: the prompts (``prompt_data.read_prompts``), ``PromptRecord``s.
      reward_set: a ``rewards.RewardSet``.
      resume_step: the checkpoint step to resume from, or None.
      mesh, paths: as ``loop.train``.

    Returns:
      The summary.

    Raises:
      TrainingStopped: a reward function's error, a non-finite step or a checkpoint that
        cannot be written; the checkpoints written before are kept.
    """
    paths = paths or RunPaths.of(config)
    step, _, dtype, schedule = build(config, cfg, mesh=mesh)
    print(f"levers:\n{step.levers.describe()}", flush=True)
    ckpt = Checkpointer(
        os.path.join(os.path.abspath(paths.work), "checkpoints"),
        save_every=config.run.save_every,
        keep=config.run.keep,
    )
    state, _, losses, _, n_adapter, history = init_state(
        config, cfg, step, dtype, ckpt, resume_step
    )
    if is_writer():
        write_json(os.path.join(paths.work, "run.json"), run_record(config))
    compiled, peak = _compile(step, state, step_batch(_zeros(config), mesh))
    run = GrpoRun(config, cfg, tok, step, compiled, records, reward_set, ckpt)
    start = history["start"]
    updates = config.training.steps * updates_per_step(config)
    run.schedule = np.asarray(schedule(np.arange(updates + 1)), np.float64).tolist()
    run.aside, run.mesh = (paths.out if paths.aside else None), mesh
    run.losses, run.lrs = losses[:start], history["learning_rates"][:start]
    run.skipped, run.metrics = history["skipped_steps"], history["metrics"][:start]
    try:
        state, times = run.steps(state, start)
    except TrainingStopped:
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            ckpt.close()
        raise
    ckpt.close()
    save_adapters(config, cfg, state, paths)
    tokens = config.data.batch_size * config.data.seq_len * updates_per_step(config)
    tps = tokens / float(np.median(times[1:])) if len(times) > 1 else None
    extra = {"skipped_steps": run.skipped, "metrics": run.metrics, "eval_metrics": []}
    extra.update(reward_summary(run.metrics, run.reward_set.names), samples=run.samples)
    extra["prompts"] = len(records)
    return finish(config, cfg, run.losses, [], run.lrs, tps, n_adapter, peak, extra, paths.staging)
