"""The two phases of a GRPO step for the planner: the training step on the rollout's
completions (the SFT estimate at ``prompt + completion`` tokens plus GRPO's per-token
arrays) and the largest generation micro-batch that fits a memory (``kv_cache``'s
generation phase). See ``docs/planner.md`` ("The GRPO phases") and ``docs/grpo.md``.
"""

from __future__ import annotations

from typing import Any

from jmem._src.planner.advice import DEFAULT_RESERVE
from jmem._src.planner.advice import fits
from jmem._src.planner.estimate import estimate
from jmem._src.planner.estimate import remat_of
from jmem._src.planner.kv_cache import Phase
from jmem._src.planner.kv_cache import generation_phase
from jmem._src.units import GiB

__all__ = ["grpo_extra_bytes", "largest_generation_batch", "training_phase"]


def grpo_extra_bytes(batch_size: int, seq_len: int, beta: float = 0.0) -> int:
    """Bytes GRPO's loss adds to an SFT step of the same tokens: float32 ``[B, S]`` (the job
    packs them over the whole sequence) old log-probs (the rollout's), the completion mask,
    the policy's log-probs and their gradient, the reference's
    log-probs when ``beta > 0`` (the base with the adapters off: a forward without
    gradient, run before the policy's, whose activations are never saved), and float32
    ``[B]`` advantages.

    Raises:
      ValueError: non-positive sizes or a negative ``beta``."""
    if batch_size < 1 or seq_len < 1 or beta < 0:
        raise ValueError(
            f"need batch_size, seq_len >= 1 and beta >= 0; got {batch_size}, {seq_len}, {beta}."
        )
    per_token = 4 + (1 if beta > 0 else 0)
    return 4 * batch_size * (per_token * seq_len + 1)


def training_phase(
    model: Any,
    *,
    batch_size: int,
    max_prompt_len: int,
    max_completion_len: int,
    beta: float = 0.0,
    **config,
) -> Phase:
    """The device peak of GRPO's training step on ``batch_size`` completions (a
    micro-batch) of ``max_prompt_len + max_completion_len`` tokens: ``estimate``'s ledger
    of the SFT step over those tokens (the same forward and backward through the policy)
    plus ``grpo_extra_bytes``.

    Args:
      model: as ``estimate``.
      batch_size: completions per training micro-batch.
      max_prompt_len, max_completion_len: tokens per prompt and per completion.
      beta: the KL coefficient; > 0 adds the reference's log-probs.
      **config: ``estimate``'s keywords (``lora``, ``quantization``, ``levers``, ...).

    Returns:
      a ``Phase`` named ``"training"`` with parts ``sft`` and ``grpo_extras`` (bytes).

    Raises:
      ValueError: as ``estimate`` and ``grpo_extra_bytes``.

    Source: DeepSeekMath (Shao et al. 2024) for the loss's inputs; TRL's ``GRPOTrainer``
    for the reference as the adapters-off base.
    """
    seq_len = max_prompt_len + max_completion_len
    ledger = estimate(model, batch_size=batch_size, seq_len=seq_len, **config)
    extra = grpo_extra_bytes(batch_size, seq_len, beta)
    remat = ledger.config.get("remat") or remat_of(config)
    cfg = {"rows": batch_size, "tokens": f"{max_prompt_len}+{max_completion_len}", "remat": remat}
    notes = (
        "the reference's forward (beta > 0) holds one layer at a time and runs before the "
        "policy's: it adds its log-probs only",
    )
    parts = {"sft": ledger.total, "grpo_extras": extra}
    return Phase("training", ledger.total + extra, parts, cfg, notes)


def largest_generation_batch(
    memory: int, model: Any, *, rows: int, reserve: float = DEFAULT_RESERVE, **config
) -> tuple[int, Phase, str]:
    """The largest divisor of ``rows`` (the completions of a step) whose generation phase
    fits ``memory`` (``fits``: peak + ``reserve``), with that phase and why.

    Args:
      memory: device bytes.
      model: as ``generation_phase``.
      rows: completions per step (prompts x num_generations).
      reserve: bytes kept free.
      **config: ``generation_phase``'s keywords but ``generation_batch``.

    Returns:
      ``(generation_batch, phase, why)``; ``generation_batch`` 0 and the one-row phase when
      not even one row fits.

    Raises:
      ValueError: as ``generation_phase``, or ``rows < 1``.
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1; got {rows}.")
    divisors = [d for d in range(rows, 0, -1) if rows % d == 0]
    larger = None
    for d in divisors:
        phase = generation_phase(model, generation_batch=d, **config)
        if fits(phase.total, memory, reserve):
            why = (
                f"generation batch {d}: the largest divisor of the {rows} completions whose "
                f"planned peak fits {memory / GiB:.3g} GiB with the {reserve / 1e9:g} GB reserve"
            )
            if larger is not None:
                why += f" ({larger[0]} rows: {larger[1] / GiB:.2f} GiB)"
            return d, phase, why
        larger = (d, phase.total)
    why = (
        f"not even 1 row's generation ({phase.total / GiB:.2f} GiB) fits {memory / GiB:.3g} GiB "
        f"with the {reserve / 1e9:g} GB reserve; shorten --max-completion-len"
    )
    return 0, phase, why
