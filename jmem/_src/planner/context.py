"""The planner per device of a context mesh: what attention adds to one device's
token-local ledger, and the collectives a step sends, per context strategy.

With a sequence of ``S`` tokens split over ``C`` devices, every token-local ledger term
(projections, MLP, norms, the chunked loss, the layer inputs a remat policy keeps) is
that of ``S / C`` tokens (``planner.estimate(seq_len=S // C)``). Attention adds, per
device, the buffers its strategy holds for one layer at a time (docs/sharding.md,
"Context parallelism"), in units of the whole sequence's K/V, ``kv = 2 S nKV D`` values
(bf16 here), or of Ulysses' head-split q, k, v and output, ``qkvo = (2 nH + 2 nKV) D S /
C``:

- ``all_gather``: the gathered K/V and, in the backward pass, its gradient (f32, before
  the reduce-scatter), less the overlap XLA's buffer assignment finds: ``2.5 kv``;
- ``ring``: the compiled ring of jmem's custom VJP holds a little less (its rotation
  buffers, residuals and the dK/dV in flight): ``2.33 kv``, fitted over 1M-4M tokens
  (the compiled residual grows from 1.5 to 2.8 kv with the length; not modelled, so
  the planner is within -10%..+10% there);
- ``ulysses``: the all-to-all buffers in and out of the head split beyond what the
  token-local ledger already holds: ``0.65 qkvo``, fitted over 1M-8M tokens (the
  compiled residual is 0.3-0.95 qkvo as XLA's buffer placement changes with the length;
  the planner is within -7%..+6% there).

The factors are calibrated on XLA:GPU compiles for h100_sxm without a GPU (llama3_1_8b,
QLoRA r=32, 1M tokens, context=8, remat ``full`` and ``offload_inputs``;
``benchmarks/results/context_parallel_h100.json``; the token-chunk loop's input
cotangent sharded as the input, which before held the whole sequence's hidden states on
every device and had been counted here) and checked at 2M-8M tokens
(``benchmarks/results/context_parallel_longest_h100.json``, ``tests/test_context_plan.py``).

Collectives per step and device (bytes each delivers, as ``jmem._src.hlo_collectives``
counts them), ``L`` layers, ``P`` forward passes (2 under a remat policy that recomputes
attention, else 1):

- ``all_gather``: all-gather ``P L kv``, reduce-scatter ``L kv / C``;
- ``ring``: collective-permute ``(C - 1) / C * (P + 3) L kv`` (each forward pass rotates
  K/V, the backward pass K/V and their gradients in f32);
- ``ulysses``: all-to-all ``(P + 1) L qkvo`` (in and out of the head split, forward and
  backward).
"""

from __future__ import annotations

__all__ = ["STRATEGY_FACTORS", "attention_bytes", "collective_bytes", "unit_bytes"]

#: per strategy: (unit, factor): attention's extra per-device bytes = factor * unit
STRATEGY_FACTORS = {"all_gather": ("kv", 2.5), "ring": ("kv", 2.33), "ulysses": ("qkvo", 0.65)}


def unit_bytes(shape, seq_len: int, context: int, unit: str, itemsize: int = 2) -> float:
    """Bytes of ``unit`` (``"kv"``: the whole sequence's K and V, ``2 S nKV D``; ``"qkvo"``:
    one device's Ulysses q, k, v and output, ``(2 nH + 2 nKV) D S / C``) for a model
    ``shape`` (``num_heads``, ``num_kv_heads``, ``head_dim`` or ``hidden_size``), ``seq_len``
    tokens per sequence and ``context`` devices; ``itemsize`` bytes per value."""
    d = getattr(shape, "head_dim", None) or shape.hidden_size // shape.num_heads
    if unit == "kv":
        return 2.0 * seq_len * shape.num_kv_heads * d * itemsize
    if unit == "qkvo":
        return (2 * shape.num_heads + 2 * shape.num_kv_heads) * d * seq_len / context * itemsize
    raise ValueError(f"unit {unit!r} is unknown; choose 'kv' or 'qkvo'.")


def attention_bytes(
    shape, seq_len: int, context: int, strategy: str, batch: int = 1, itemsize: int = 2
) -> int:
    """Per-device bytes attention adds to the token-local ledger of ``seq_len / context``
    tokens, for ``batch`` sequences of ``seq_len`` tokens split over ``context`` devices
    (module docstring; ``itemsize``: bytes per activation value); 0 for ``context == 1``.
    Raises ValueError for an unknown ``strategy``."""
    if context <= 1:
        return 0
    if strategy not in STRATEGY_FACTORS:
        raise ValueError(
            f"context strategy {strategy!r} is unknown; choose from {list(STRATEGY_FACTORS)}."
        )
    unit, factor = STRATEGY_FACTORS[strategy]
    return int(factor * batch * unit_bytes(shape, seq_len, context, unit, itemsize))


def collective_bytes(
    shape,
    seq_len: int,
    context: int,
    strategy: str,
    *,
    passes: int = 2,
    batch: int = 1,
    itemsize: int = 2,
) -> dict[str, float]:
    """``{kind: bytes}`` one step's attention collectives deliver per device (module
    docstring; ``passes``: forward passes of attention, 2 under remat, 1 without;
    ``itemsize``: bytes per value on the wire, 4 where the backend moves bf16 as f32, as
    XLA:CPU does); empty for
    ``context == 1``. Raises ValueError for an unknown ``strategy``."""
    if context <= 1:
        return {}
    layers = shape.num_layers
    kv = batch * unit_bytes(shape, seq_len, context, "kv", itemsize)
    if strategy == "all_gather":
        return {"all-gather": passes * layers * kv, "reduce-scatter": layers * kv / context}
    if strategy == "ring":
        return {"collective-permute": (context - 1) / context * (passes + 3) * layers * kv}
    if strategy == "ulysses":
        qkvo = batch * unit_bytes(shape, seq_len, context, "qkvo", itemsize)
        return {"all-to-all": (passes + 1) * layers * qkvo}
    raise ValueError(
        f"context strategy {strategy!r} is unknown; choose from {list(STRATEGY_FACTORS)}."
    )
