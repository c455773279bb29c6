"""What a remat policy recomputes, as matmul work: the resolver's recompute cost.

A model of one decoder layer's forward matmul FLOPs per token (2 per multiply-add):
``qkv = 2·d·hd·(H + 2·KV)``, ``o = 2·H·hd·d``, ``gate_up = 4·d·f``, ``down = 2·f·d``, and
attention's ``Q·Kᵀ`` and ``P·V``: ``4·S·H·hd`` dense (every key, masked), else ``4·K·H·hd``
over the ``K`` keys a query sees (``S/2`` causal on average, at most a sliding window).
The step's minimum is a frozen base's forward plus its input gradients:
``2·linear + 3·attention`` (the attention backward is twice its forward).

What each policy recomputes in the backward pass (once; measured against the compiled
dot FLOPs of Llama-3.1-8B QLoRA at 4,096 tokens on h100_sxm, docs/remat.md):
  - ``none``, ``dots``: nothing; with token chunks the chunk's internals are recomputed
    under every policy: ``o_proj`` and the MLP's gate/up (down's output is not needed).
  - ``selective``, ``offload``: dense attention's ``Q·Kᵀ`` and ``P·V`` (matmuls with
    batch dimensions are not saved); blockwise and cuDNN attention save their output and
    log-sum-exp, so nothing more.
  - ``full``, ``offload_inputs``: the layer's forward but ``down_proj`` (the next layer's
    input is saved): q/k/v, ``o_proj``, gate/up, and dense attention (blockwise and cuDNN
    attention's backward starts from its saved output: no forward pass again).
Checked against the compiled dot FLOPs of ``tiny`` on XLA:CPU (tests/test_levers.py).
"""

from __future__ import annotations

__all__ = ["recompute_cost"]

_SHAPE = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")


def _per_token(model, seq: int, attention: str) -> dict[str, float]:
    """Forward matmul FLOPs per token of one layer, by part (module docstring)."""
    d, f, h, kv, hd = (int(getattr(model, k)) for k in _SHAPE)
    keys = seq / 2
    window = getattr(model, "sliding_window", None)
    if window and not getattr(model, "layer_types", None):
        keys = min(keys, window)
    if attention == "dense":
        keys = seq
    return {
        "qkv": 2 * d * hd * (h + 2 * kv),
        "o": 2 * h * hd * d,
        "gate_up": 4 * d * f,
        "down": 2 * f * d,
        "attention": 4 * keys * h * hd,
    }


def recompute_cost(
    remat: str, model, seq: int | None, *, token_chunked: bool, attention: str
) -> tuple[float, str] | None:
    """``(share, what)``: the matmul FLOPs ``remat`` recomputes in the backward pass as a
    share of the step's minimum (a frozen base's forward + input gradients), and the parts
    in words; None where the model has no shape attributes or ``seq`` is unknown.

    Args:
      remat: a ``jmem.REMAT_POLICIES`` name.
      model: a ``LlamaConfig`` (or any object with its shape attributes).
      seq: tokens per row.
      token_chunked: whether the token-local work runs in token chunks (``token_chunk``
        set and shorter than ``seq``).
      attention: the resolved implementation (``dense``, ``blockwise``, ``cudnn``).

    Source: the per-part FLOP model of this module's docstring (a model: the dry run
    prints the compile's own count).
    """
    if seq is None or not all(hasattr(model, k) for k in _SHAPE):
        return None
    flops = _per_token(model, seq, attention)
    linear = flops["qkv"] + flops["o"] + flops["gate_up"] + flops["down"]
    minimum = 2 * linear + 3 * flops["attention"]
    dense = ["attention"] if attention == "dense" else []
    parts: list[str] = []
    if remat in ("full", "offload_inputs"):
        parts = ["qkv", *dense, "o", "gate_up"]
    elif token_chunked:
        parts = ["o", "gate_up"]
    if remat in ("selective", "offload"):
        parts = dense + parts
    share = sum(flops[p] for p in parts) / minimum
    names = {
        "qkv": "q/k/v",
        "attention": "attention's Q·Kᵀ and P·V",
        "o": "o_proj",
        "gate_up": "the MLP's gate/up",
    }
    return share, ", ".join(names[p] for p in parts) or "no matmul"
