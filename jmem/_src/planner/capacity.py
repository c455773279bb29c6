"""The capacity searches: the largest model, batch or sequence whose training step (its
``estimate``) fits a memory size, by bisection over a monotone total."""

from __future__ import annotations

from typing import Any

from jmem._src.planner.estimate import estimate
from jmem._src.planner.estimate import remat_of
from jmem._src.planner.estimate import with_remat
from jmem._src.units import parse_memory

__all__ = ["largest_batch", "largest_model", "largest_seq_len", "largest_seq_len_by_remat"]


def _bisect(fits, lo: int, hi: int) -> int:
    """Largest x in [lo, hi] with fits(x), assuming monotone; lo - 1 if none."""
    if not fits(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_model(
    memory: Any, *, activation_budget: float | None = 6e9, reserve: float = 2e9, **config
) -> int:
    """Largest parameter count whose training step fits in ``memory``.

    Constraint: ``static(N) + activations + reserve <= memory``, with activations either
    the fixed ``activation_budget`` (bytes) or, when it is ``None``, computed for
    :func:`standard_shape` ``(N)`` at the given ``batch_size``/``seq_len``/``remat``.

    Example (nominal accounting, 24 GB, 6 GB activations, 2 GB reserve): mixed-precision
    Adam 16 N <= 16 GB gives 1.0e9; 8-bit states 10 N gives 1.6e9; 8-bit with the moments
    offloaded 8 N gives 2.0e9.

    Args:
      memory: device bytes or a string (see :func:`parse_memory`).
      activation_budget: bytes set aside for activations, or None to compute them.
      reserve: bytes left for fragmentation, workspace and the runtime.
      **config: keywords of :func:`estimate` (``optimizer``, ``offload``, ...).

    Returns:
      Parameters (int); 0 if nothing fits.

    Raises:
      ValueError: as :func:`estimate`, or if ``config`` names a ``model``.
    """
    if "model" in config:
        raise ValueError("largest_model searches over the parameter count; do not pass model.")
    mem = parse_memory(memory)

    def fits(n: int) -> bool:
        if n < 1:
            return True
        kw = dict(config)
        if activation_budget is not None:
            kw["activations"] = int(activation_budget)
        return estimate(n, **kw).total + reserve <= mem

    return max(0, _bisect(fits, 1, 4 * int(mem)))  # NF4: about 0.52 bytes a parameter


def largest_batch(
    memory: Any, model: Any, *, reserve: float = 2e9, max_batch: int = 1 << 20, **config
) -> int:
    """Largest per-device ``batch_size`` (sequences) whose step fits in ``memory - reserve``.

    Returns 0 when even one sequence does not fit. ``config``: keywords of :func:`estimate`.

    Raises:
      ValueError: as :func:`estimate`.
    """
    mem = parse_memory(memory)
    config.pop("batch_size", None)
    return max(
        0,
        _bisect(
            lambda b: estimate(model, batch_size=b, **config).total + reserve <= mem, 1, max_batch
        ),
    )


def largest_seq_len(
    memory: Any,
    model: Any,
    *,
    reserve: float = 2e9,
    multiple_of: int = 1,
    max_seq_len: int = 1 << 22,
    **config,
) -> int:
    """Largest ``seq_len`` (a multiple of ``multiple_of``) whose step fits; 0 if none.

    Raises:
      ValueError: as :func:`estimate`.
    """
    mem = parse_memory(memory)
    config.pop("seq_len", None)
    m = int(multiple_of)
    if m < 1:
        raise ValueError(f"multiple_of must be >= 1; got {multiple_of!r}.")
    k = _bisect(
        lambda j: estimate(model, seq_len=j * m, **config).total + reserve <= mem,
        1,
        max(1, max_seq_len // m),
    )
    return max(0, k) * m


def largest_seq_len_by_remat(
    memory: Any, model: Any, *, reserve: float = 2e9, multiple_of: int = 1024, **config
) -> dict[str, int]:
    """The longest sequence that fits ``memory - reserve`` under each remat: the step's own
    (``"full"`` when it has none or ``"none"``) and ``"offload_inputs"`` (each layer's input in
    host memory).

    Args:
      memory: device bytes or a string (``parse_memory``).
      model: as ``estimate`` (a ``LlamaConfig`` brings its long-context paths).
      reserve: bytes left for fragmentation, workspace and the runtime.
      multiple_of: the granularity of the search (tokens).
      **config: keywords of ``estimate`` (``levers``, ``target``, ``lora``, ...); how close
        each target's activation terms come to its compiler is in ``docs/planner.md``.

    Returns:
      ``{remat: tokens, "offload_inputs": tokens}``, 0 where nothing fits.

    Raises:
      ValueError: as ``estimate``.
    """
    config.pop("seq_len", None)
    remat = remat_of(config)
    remat = "full" if remat in (None, "none") else remat
    kw = dict(reserve=reserve, multiple_of=multiple_of, **config)
    return {
        mode: largest_seq_len(memory, model, **with_remat(kw, mode))
        for mode in (remat, "offload_inputs")
    }
