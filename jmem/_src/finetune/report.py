"""The report of a run: ``summary.json``, the loss/eval/learning-rate plot and the closing
line; model FLOPs utilization where the device's peak is known."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys

import jax
import numpy as np

from jmem import MemoryReport
from jmem._src import host_allocator
from jmem._src.finetune.rundir import flags
from jmem._src.finetune.rundir import is_writer
from jmem._src.finetune.rundir import versions
from jmem._src.finetune.setup import offload_record
from jmem._src.units import format_count
from jmem.models import llama

format_bytes = MemoryReport.format_bytes

#: What the job trains for by default: supervised fine-tuning (next-token loss on the text,
#: or on the responses of instruction and chat examples).
OBJECTIVE = "SFT"
#: ``--objective`` as the report names it.
OBJECTIVE_LABELS = {
    "sft": OBJECTIVE,
    "dpo": "DPO",
    "orpo": "ORPO",
    "simpo": "SimPO",
    "grpo": "GRPO",
}
#: The preference metrics the log, ``metrics.jsonl`` and the plot's second panel show.
PREFERENCE_METRICS = ("rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected")


def objective_label(config) -> str:
    """``--objective`` in words: ``"SFT"``, ``"DPO"`` (``"IPO"`` with ``--loss-type ipo``),
    ``"ORPO"``, ``"SimPO"``."""
    t = config.training
    return "IPO" if t.objective == "dpo" and t.loss_type == "ipo" else OBJECTIVE_LABELS[t.objective]


#: The x axis of the plot and the steps of ``summary.json``'s ``losses`` and
#: ``eval_losses``: one count of optimizer updates for both.
STEP_AXIS = "step s: the weights after s updates (train loss: on step s's batch)"

#: Dense bf16 peak FLOP/s by device kind (vendor specs), for model FLOPs utilization.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def train_flops_per_token(cfg, seq_len: int, n_adapter: int, full: bool = False) -> float:
    """Model FLOPs per trained token, excluding remat recomputation (the MFU convention of
    Chowdhery et al. 2022), for a frozen base: forward 2N plus input-gradient 2N over the
    base matmuls, 6 per adapter parameter, and attention 12 * L * H * S (scores and context,
    forward and backward; causal masking not discounted). Full fine-tuning (``full``: the
    base trains, no adapters): 6N over the matmuls plus the attention term."""
    n_matmul = llama.num_params(cfg) - (
        0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    )
    attention = 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
    if full:
        return 6.0 * n_matmul + attention
    return 4.0 * n_matmul + 6.0 * n_adapter + attention


def peak_flops() -> float | None:
    """Dense bf16 peak FLOP/s of this process's first device (``PEAK_FLOPS``), or None."""
    kind = jax.local_devices()[0].device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


def device_memory() -> int | None:
    """Peak bytes in use on this process's first device, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


@contextlib.contextmanager
def quiet_stdout():
    """The block's standard output discarded, at the file descriptor (``sys.stdout`` and fd 1
    to ``os.devnull``, restored after; standard error is kept): for the processes other
    than process 0 of a multi-process run, whose prints would repeat process 0's.

    At the descriptor because C++ writes there too: gloo prints its ``[Gloo] Rank r is
    connected to n peer ranks`` lines with ``std::cout`` on each CPU collective's first
    use (``gloo::Context::printConnectivityInfo``), with no log level or environment
    variable that turns them off; process 0 still prints its own."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        with open(os.devnull, "w") as f, contextlib.redirect_stdout(f):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def recent_train_loss(losses, evals) -> tuple[float | None, int]:
    """Mean training loss over the last evaluation interval (the steps between the last two
    evaluations; the last 10 steps with fewer than two) and how many steps it averages.

    One batch's loss varies by about 0.15 nats from step to step on the default corpus, so
    the last step alone is no yardstick for the held-out loss; Hugging Face's Trainer
    likewise logs the mean loss over its logging interval. Non-finite losses (skipped
    fp16 steps) are left out. ``(None, 0)`` when there is no finite loss."""
    if len(evals) >= 2:
        window = int(evals[-1][0] - evals[-2][0])
    else:
        window = 10
    tail = [x for x in losses[-max(window, 1) :] if x is not None and np.isfinite(x)]
    return (float(np.mean(tail)), len(tail)) if tail else (None, 0)


def finish(
    config, cfg, losses, evals, lrs, tokens_per_s, n_adapter, compiled_peak, extra=None, where=None
):
    """summary.json (with ``extra`` added: the data report, devices and mesh, samples), the
    plot and the closing line; only process 0 writes, into ``where`` (default ``--out``; the
    job's staging directory, published into ``--out`` after). Returns the summary."""
    recent, k = recent_train_loss(losses, evals)
    summary = {
        "config": config.model.config,
        "checkpoint": os.path.abspath(config.model.checkpoint) if config.model.checkpoint else None,
        "model": dataclasses.asdict(cfg),
        "data": os.path.abspath(config.data.data) if config.data.data else "pydoc_data.topics",
        "tokenizer": config.model.tokenizer,
        "args": flags(config),
        "versions": versions(),
        "objective": objective_label(config),
        "method": method_label(config),
        "steps": config.training.steps,
        "step_axis": "losses[s] and eval_losses' [s, loss]: " + STEP_AXIS,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        # The mean over the last evaluation interval: what the eval loss is compared with.
        "recent_loss": recent,
        "recent_loss_steps": k,
        "eval_losses": evals,
        "last_eval_loss": evals[-1][1] if evals else None,
        "tokens_per_s": tokens_per_s,
        "peak_bytes": device_memory() or compiled_peak,
        "peak_source": "device memory_stats" if device_memory() else "compiled (jmem.measure)",
        "trainable_params": n_adapter,
        "offload": offload_record(config, cfg),
        "losses": losses,
        "learning_rates": lrs,
        "device": jax.devices()[0].device_kind,
        "host_allocator": {  # asked for, and what was in effect (jmem.host)
            "requested": config.run.host_allocator,
            "huge_pages": host_allocator.huge_pages_active(),
            "retained": host_allocator.retained(),
        },
        **(extra or {}),
    }
    peak = peak_flops()
    if summary["tokens_per_s"] and peak:
        n, full = summary["trainable_params"], not config.training.lora_rank
        fpt = train_flops_per_token(cfg, config.data.seq_len, n, full=full)
        summary["mfu"] = summary["tokens_per_s"] * fpt / peak
    metrics = summary.get("metrics") or None
    if metrics:
        summary["first_metrics"], summary["last_metrics"] = metrics[0], metrics[-1]
    eval_metrics = summary.get("eval_metrics") or []
    if eval_metrics:
        summary["last_eval_metrics"] = eval_metrics[-1][1]
    plot = os.path.join(config.run.out, "loss.png")
    if is_writer():
        where = where or config.run.out
        with open(os.path.join(where, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        write_metrics(os.path.join(where, "metrics.jsonl"), summary)
        plot_losses(
            losses,
            evals,
            lrs,
            os.path.join(where, "loss.png"),
            run_title(config, cfg),
            metrics,
            eval_metrics,
        )
    ev = f"; eval loss {evals[-1][1]:.4f}" if evals else ""
    ev += _reward_words(summary.get("rewards"))
    if eval_metrics:
        m = eval_metrics[-1][1]
        ev += f" (accuracy {m['rewards/accuracies']:.2f}, margin {m['rewards/margins']:.4f})"
    mean = f" (mean of the last {k}: {recent:.4f})" if k > 1 else ""
    print(
        f"\n{method_label(config)}: first loss {losses[0]:.4f} -> last loss {losses[-1]:.4f} over {len(losses)} "
        f"steps{mean}{ev}; {tokens_per_s or 0:,.0f} tokens/s; peak "
        f"{format_bytes(summary['peak_bytes'])} ({summary['peak_source']}); curve: {plot}"
        + (f"; MFU {summary['mfu']:.1%}" if "mfu" in summary else "")
    )
    return summary


def _reward_words(rewards) -> str:
    """GRPO's closing words: the mean reward of the first and the last step."""
    if not rewards:
        return ""
    return f"; mean reward {rewards[0]:.4f} (step 1) -> {rewards[-1]:.4f} (step {len(rewards)})"


def write_metrics(path: str, summary: dict) -> None:
    """``metrics.jsonl``: one JSON object per line, per step ``{"step": s, "loss",
    "learning_rate"}`` (step ``s``'s batch, before its update; a preference loss's metrics
    added by their names, ``rewards/margins``...), then per evaluation ``{"step": s,
    "eval_loss"}`` (and ``"eval/rewards/margins"``...)."""
    losses, lrs = summary["losses"], summary["learning_rates"]
    metrics = summary.get("metrics") or [{}] * len(losses)
    evals = {s: m for s, m in summary.get("eval_metrics") or []}
    with open(path, "w") as f:
        for s, (loss, lr, m) in enumerate(zip(losses, lrs, metrics)):
            f.write(json.dumps({"step": s, "loss": loss, "learning_rate": lr, **m}) + "\n")
        for s, loss in summary["eval_losses"]:
            extra = {f"eval/{k}": v for k, v in evals.get(s, {}).items()}
            f.write(json.dumps({"step": s, "eval_loss": loss, **extra}) + "\n")


def model_label(config, cfg) -> str:
    """The run's model in words: ``--config``'s name, or the ``--checkpoint``'s
    ``model_type`` (its directory's name when config.json has none), and its size in
    human units: ``"tiny, 1.4M params"``, ``"qwen3, 596M params"``."""
    name = config.model.config
    if config.model.checkpoint:
        with open(os.path.join(config.model.checkpoint, "config.json")) as f:
            name = json.load(f).get("model_type")
        name = name or os.path.basename(os.path.normpath(config.model.checkpoint))
    return f"{name}, {format_count(llama.num_params(cfg))} params"


def run_title(config, cfg) -> str:
    """The plot's title: the objective, the method and the model (``model_label``):
    ``"SFT with QLoRA (r=8): qwen3, 596M params"``, ``"SFT with full fine-tuning: ..."``."""
    return f"{objective_label(config)} with {method_label(config)}: {model_label(config, cfg)}"


def method_label(config) -> str:
    """What trains: ``"QLoRA (r=8)"``, or ``"full fine-tuning"`` for ``--lora-rank 0``."""
    rank = config.training.lora_rank
    return f"QLoRA (r={rank})" if rank else "full fine-tuning"


def plot_losses(losses, evals, lrs, path, title, metrics=None, eval_metrics=None):
    """Training loss per step, held-out loss at its steps, learning rate on a second axis;
    one axis of optimizer steps (``STEP_AXIS``): ``losses[s]`` (step ``s``'s batch, before
    its update) and an evaluation at ``s`` both measure the trained weights (the adapters,
    or with ``--lora-rank 0`` the params) after ``s`` updates,
    so the train curve starts at 0 with the evaluation before the first update; integer
    step ticks. With a preference loss's ``metrics`` (one dict per step) and
    ``eval_metrics`` (``[s, dict]``), a second panel below: reward margin, chosen and
    rejected rewards, and accuracy on its own axis (``_plot_preference``)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    if metrics:
        fig, (ax, pref_ax) = plt.subplots(2, 1, figsize=(6.5, 6.6), sharex=True)
    else:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
    steps = np.arange(len(losses))  # losses[s]: the weights after s updates
    lines = ax.plot(steps, losses, label="train loss")
    if evals:
        e = np.asarray(evals, np.float64)
        lines += ax.plot(e[:, 0], e[:, 1], "o-", label="eval loss (held out)")
    ax.set_ylabel(_loss_label(metrics))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lines += lr_ax.plot(steps, lrs[: len(losses)], "--", color="gray", label="learning rate")
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    ax.set_title(title)
    if metrics and "reward" in metrics[0]:
        _plot_rewards(pref_ax, metrics)
        pref_ax.set_xlabel(STEP_AXIS, fontsize=9)
    elif metrics:
        _plot_preference(pref_ax, metrics, eval_metrics or [])
        pref_ax.set_xlabel(STEP_AXIS, fontsize=9)
    else:
        ax.set_xlabel(STEP_AXIS, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _loss_label(metrics) -> str:
    """The loss axis's label: SFT's nats per token, a preference loss per pair, GRPO's."""
    if not metrics:
        return "loss (nats/token)"
    return "GRPO loss" if "reward" in metrics[0] else "loss (per pair)"


def _plot_rewards(ax, metrics):
    """GRPO's panel: each step's mean reward (the weighted sum), with one standard deviation
    of the groups shaded, and each reward function's mean when there are several."""
    steps = np.arange(len(metrics))
    mean = np.asarray([m["reward"] for m in metrics])
    std = np.asarray([m["reward_std"] for m in metrics])
    lines = ax.plot(steps, mean, label="mean reward")
    ax.fill_between(steps, mean - std, mean + std, alpha=0.2, label="group std")
    names = [k[len("rewards/") : -len("/mean")] for k in metrics[0] if k.endswith("/mean")]
    if len(names) > 1:
        for n in names:
            lines += ax.plot(steps, [m[f"rewards/{n}/mean"] for m in metrics], lw=0.8, label=n)
    ax.set_ylabel("reward (of the step's completions)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)


def _plot_preference(ax, metrics, eval_metrics):
    """The preference panel: per-step reward margin, chosen and rejected rewards (left
    axis), accuracy (right axis, 0 to 1), the held-out margin and accuracy as points."""
    steps = np.arange(len(metrics))
    series = lambda name: [m[name] for m in metrics]
    lines = ax.plot(steps, series("rewards/margins"), label="reward margin")
    lines += ax.plot(steps, series("rewards/chosen"), lw=0.8, label="chosen reward")
    lines += ax.plot(steps, series("rewards/rejected"), lw=0.8, label="rejected reward")
    if eval_metrics:
        at = [s for s, _ in eval_metrics]
        margins = [m["rewards/margins"] for _, m in eval_metrics]
        lines += ax.plot(at, margins, "o", label="eval margin (held out)")
    ax.set_ylabel("reward (nats)")
    ax.grid(alpha=0.3)
    acc_ax = ax.twinx()
    lines += acc_ax.plot(steps, series("rewards/accuracies"), ":", color="k", label="accuracy")
    if eval_metrics:
        acc = [m["rewards/accuracies"] for _, m in eval_metrics]
        lines += acc_ax.plot(at, acc, "s", color="k", label="eval accuracy (held out)")
    acc_ax.set_ylim(-0.05, 1.05)
    acc_ax.set_ylabel("accuracy (chosen reward > rejected)")
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper left", fontsize=7)
