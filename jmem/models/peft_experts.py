"""Expert LoRA adapters in PEFT's format for transformers 5's fused experts (Qwen3-MoE,
Mixtral): PEFT adapts the experts' 3-D parameters ``mlp.experts.gate_up_proj [E, 2F, H]``
and ``mlp.experts.down_proj [E, H, F]`` through ``target_parameters`` (``lora.ParamWrapper``),
one ``lora_A``/``lora_B`` pair per parameter holding every expert's factors.

PEFT's layout for a parameter ``[E, out, in]`` of rank ``R``: ``lora_A.weight [E*R, in]``
(row ``e*R + j``: expert ``e``'s ``A_e [R, in]``) and ``lora_B.weight [out, R*E]`` (column
``j*E + e``: expert ``e``'s ``B_e [out, R]``); the update of expert ``e`` is
``scaling * B_e @ A_e`` (``ParamWrapper.get_delta_weight``). Two parameters of one module nest:
``gate_up_proj``, the first, is the inner wrapper (keys ``experts.base_layer.lora_*``),
``down_proj`` the outer (``experts.lora_*``); one alone is ``experts.lora_*``.

jmem keeps gate and up apart (``expert_gate``/``expert_up`` ``[L, E, H, F]``, pairs ``a_g, b_g``
and ``a_u, b_u`` of rank ``r``). Their fused update ``[(a_g b_g)ᵀ; (a_u b_u)ᵀ]`` is exactly
the rank-``2r`` pair ``A = [a_gᵀ; a_uᵀ]``, ``B = blockdiag(b_gᵀ, b_uᵀ)`` (what PEFT's own
conversion of per-expert adapters writes, with ``rank_pattern``/``alpha_pattern`` doubling
``r`` and ``lora_alpha`` for ``gate_up_proj``); when ``a_g == a_u`` it is the rank-``r``
pair ``A = a_gᵀ``, ``B = [b_gᵀ; b_uᵀ]``. Read back, a block-diagonal ``B`` splits into the
two rank-``r`` pairs again; any other fused pair ``(A, B)`` becomes ``(Aᵀ, B[:F]ᵀ)`` and
``(Aᵀ, B[F:]ᵀ)`` (rank ``R`` each, exact). Source: PEFT 0.21 ``tuners/lora/layer.py``
(``ParamWrapper``), ``utils/transformers_weight_conversion.py``. See ``docs/lora.md``.
"""

from __future__ import annotations

import re

import numpy as np

from jmem._src.model_table import EXPERT_LINEAR_NAMES

__all__ = [
    "EXPERT_PATHS",
    "PARAMS",
    "KEY_RE",
    "fused_gate_up",
    "from_peft",
    "key",
    "param_of",
    "slots",
    "split_gate_up",
    "to_peft",
]

#: jmem's expert kernel paths.
EXPERT_PATHS = tuple(f"layers/{n}/kernel" for n in EXPERT_LINEAR_NAMES)
#: transformers 5's fused expert parameter -> the jmem expert kernels it holds, in order.
PARAMS = {
    "gate_up_proj": ("layers/expert_gate/kernel", "layers/expert_up/kernel"),
    "down_proj": ("layers/expert_down/kernel",),
}
#: An expert adapter tensor's key: layer, inner (``base_layer.``) or outer wrapper, A or B.
KEY_RE = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.mlp\.experts\.(base_layer\.)?"
    r"lora_([AB])\.weight$"
)


def param_of(path: str) -> str:
    """The PEFT parameter (``gate_up_proj``/``down_proj``) holding jmem kernel ``path``."""
    return next(p for p, paths in PARAMS.items() if path in paths)


def slots(params: list[str]) -> dict[str, str]:
    """``{parameter: key infix}`` for the adapted ``params``: with both, ``gate_up_proj``
    is the inner wrapper (``base_layer.``) and ``down_proj`` the outer; one alone is outer."""
    if len(params) == 2:
        return {"gate_up_proj": "base_layer.", "down_proj": ""}
    return {p: "" for p in params}


def key(i: int, infix: str, which: str) -> str:
    """The safetensors key of layer ``i``'s expert factor ``which`` (``A``/``B``)."""
    return f"base_model.model.model.layers.{i}.mlp.experts.{infix}lora_{which}.weight"


def _t(x: np.ndarray) -> np.ndarray:
    """The last two axes swapped."""
    return np.swapaxes(x, -1, -2)


def fused_gate_up(gate, up, f: int) -> tuple[np.ndarray, np.ndarray, float]:
    """PEFT's fused ``gate_up_proj`` pair of jmem's gate and up adapters (either may be None).

    Args:
      gate, up: ``LoraWeight`` with ``a [L, E, H, r]``, ``b [L, E, r, F]``, or None.
      f: F, one expert's width (the zero block of an adapter that is None).

    Returns:
      ``(A [L, E, R, H], B [L, E, 2F, R], scale)``: ``R = r_g + r_u`` (block-diagonal ``B``),
      ``r`` when the two ``a`` are equal, or the one adapter's ``r`` (zero block for the other).

    Raises:
      ValueError: the two adapters' scales differ (one fused pair has one scaling).
    """
    if gate is not None and up is not None and not np.isclose(gate.scale, up.scale, rtol=1e-6):
        raise ValueError(
            f"The expert_gate and expert_up adapters have scales {gate.scale} and {up.scale}; "
            "PEFT's fused gate_up_proj pair has one: use one rank and alpha for both."
        )
    one = gate if gate is not None else up
    a_g = None if gate is None else np.asarray(gate.a)
    a_u = None if up is None else np.asarray(up.a)
    if gate is None or up is None:
        a, b = np.asarray(one.a), _t(np.asarray(one.b))
        zero = np.zeros_like(b[..., :f, :])
        return _t(a), np.concatenate([b, zero] if up is None else [zero, b], axis=-2), one.scale
    b_g, b_u = _t(np.asarray(gate.b)), _t(np.asarray(up.b))
    if a_g.shape == a_u.shape and np.array_equal(a_g, a_u):
        return _t(a_g), np.concatenate([b_g, b_u], axis=-2), gate.scale
    A = np.concatenate([_t(a_g), _t(a_u)], axis=-2)
    top = np.concatenate([b_g, np.zeros(b_g.shape[:-1] + b_u.shape[-1:], b_g.dtype)], axis=-1)
    bottom = np.concatenate([np.zeros(b_u.shape[:-1] + b_g.shape[-1:], b_u.dtype), b_u], axis=-1)
    return A, np.concatenate([top, bottom], axis=-2), gate.scale


def split_gate_up(A: np.ndarray, B: np.ndarray) -> tuple[tuple, tuple]:
    """jmem's gate and up pairs ``((a_g, b_g), (a_u, b_u))`` of a fused PEFT pair.

    Args:
      A: ``[L, E, R, H]``; B: ``[L, E, 2F, R]``.

    Returns:
      ``a [L, E, H, r]``, ``b [L, E, r, F]`` for each: None for the one whose rows of ``B``
      are all zero while the other's are not (``fused_gate_up`` of one adapter); ``r = R/2``
      where ``B`` is block-diagonal (gate rows read only the first ``R/2`` ranks, up rows the
      rest: what ``fused_gate_up`` writes of two), else ``r = R`` with ``a_g = a_u = Aᵀ``.
    """
    R, f = A.shape[-2], B.shape[-2] // 2
    h = R // 2
    gate_rows, up_rows = B[..., :f, :].any(), B[..., f:, :].any()
    if gate_rows != up_rows:  # one of the two adapted (the other's block is zero)
        rows = B[..., :f, :] if gate_rows else B[..., f:, :]
        pair = (_t(A), _t(rows))
        return (pair, None) if gate_rows else (None, pair)
    if R % 2 == 0 and not B[..., :f, h:].any() and not B[..., f:, :h].any():
        gate = (_t(A[..., :h, :]), _t(B[..., :f, :h]))
        up = (_t(A[..., h:, :]), _t(B[..., f:, h:]))
        return gate, up
    return (_t(A), _t(B[..., :f, :])), (_t(A), _t(B[..., f:, :]))


def to_peft(A: np.ndarray, B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's ``(lora_A.weight [E*R, in], lora_B.weight [out, R*E])`` of per-expert
    ``A [E, R, in]``, ``B [E, out, R]``."""
    E, R, n_in = A.shape
    return (
        np.ascontiguousarray(A.reshape(E * R, n_in)),
        np.ascontiguousarray(B.transpose(1, 2, 0).reshape(B.shape[1], R * E)),
    )


def from_peft(a_w: np.ndarray, b_w: np.ndarray, num_experts: int):
    """``(A [E, R, in], B [E, out, R])`` of one layer's PEFT ``lora_A``/``lora_B`` weights.

    Raises:
      ValueError: shapes that are no ``E``-expert pair (rows of A not a multiple of E, or
        B's columns not A's rows).
    """
    E = num_experts
    if a_w.ndim != 2 or b_w.ndim != 2 or a_w.shape[0] % E or b_w.shape[1] != a_w.shape[0]:
        raise ValueError(
            f"expert adapter weights lora_A{a_w.shape}, lora_B{b_w.shape} are not the "
            f"[E*R, in], [out, R*E] pair of E={E} experts."
        )
    R = a_w.shape[0] // E
    return a_w.reshape(E, R, a_w.shape[1]), b_w.reshape(b_w.shape[0], R, E).transpose(2, 0, 1)
