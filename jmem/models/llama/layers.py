"""The decoder's layers as pure functions: RMSNorm (Zhang & Sennrich 2019), rotary position
embeddings (Su et al. 2021, "RoFormer"; Llama 3.1 and linear scaling), the projections
(plain matmuls: NF4, LoRA and FP8 act on them through ``jmem.qlora/lora/fp8.apply``), q/k/v
with QK-norm, the gated MLP (Shazeer 2020), the embedding and the output head.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jmem._src import moe
from jmem._src.mesh_batch import rows_split
from jmem.models.llama.config import ACTIVATIONS
from jmem.models.llama.config import LlamaConfig
from jmem.models.llama.config import Params
from jmem.models.llama.config import RopeScaling


@jax.named_scope("rms_norm")
def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis, multiplied by ``offset + scale``
    (Gemma's ``(1 + w)`` with ``offset=1``), computed in float32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (offset + scale.astype(jnp.float32))).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """Inverse frequencies ``[head_dim // 2]`` float32 of RoPE, scaled per ``scaling``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(positions, head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """cos/sin tables (float32) for rotary embeddings (Su et al. 2021, "RoFormer").

    Args:
      positions: an ``int`` sequence length (positions ``0..n-1``) or an integer array of
        positions, ``[S]`` or ``[B, S]`` (e.g. reset to 0 at each packed example).
      head_dim: per-head width D (even).
      theta: RoPE base frequency.
      scaling: optional ``RopeScaling`` (``config.rope_scaling``).

    Returns:
      ``(cos, sin)``, each ``positions.shape + (D // 2,)`` float32.
    """
    if isinstance(positions, int):
        positions = jnp.arange(positions)
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


@jax.named_scope("rope")
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x [B, S, heads, D]`` by position, half-split layout as in HF Llama.
    ``cos``/``sin``: ``[S, D // 2]`` or ``[B, S, D // 2]`` from ``rope_tables``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x @ kernel`` in the activation dtype (the kernel is cast to it if needed). Under
    ``jmem.fp8.apply`` a kernel with an ``Fp8Meta`` makes this an FP8 matmul. On a mesh in
    context the output keeps the rows' batch split (``rows_split``): FSDP, not tensor
    parallelism over the whole batch."""
    return rows_split(jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype)))


def _proj(h: jax.Array, layer: Params, name: str) -> jax.Array:
    """Projection ``name`` of ``h``: ``h @ kernel`` (+ ``bias`` when the params have one)."""
    y = _dense(h, layer[name]["kernel"])
    bias = layer[name].get("bias")
    return y if bias is None else y + bias.astype(y.dtype)


def _norm(x, layer: Params, name: str, config: LlamaConfig) -> jax.Array:
    """RMSNorm of ``x`` with layer weight ``name``, tagged ``name`` for remat policies."""
    y = rms_norm(x, layer[name]["scale"], config.rms_norm_eps, config.norm_offset)
    return checkpoint_name(y, name)


def _qkv(h, layer, config: LlamaConfig):
    """Query, key and value projections ``[B, S, heads, D]`` before RoPE (QK-norm applied)."""
    c = config
    b, s, _ = h.shape
    if c.fused_projections:  # Phi-3: [q | k | v] along the output axis
        qkv = _proj(h, layer, "qkv_proj")
        q_end, k_end = c.num_heads * c.head_dim, (c.num_heads + c.num_kv_heads) * c.head_dim
        q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    else:
        q, k, v = (_proj(h, layer, n) for n in ("q_proj", "k_proj", "v_proj"))
    q, k, v = (checkpoint_name(t, n) for t, n in zip((q, k, v), _QKV_TAGS))
    if c.qk_norm == "proj":  # OLMo 2: over the whole projection
        q, k = _norm(q, layer, "q_norm", c), _norm(k, layer, "k_norm", c)
    q = q.reshape(b, s, c.num_heads, c.head_dim)
    k = k.reshape(b, s, c.num_kv_heads, c.head_dim)
    if c.qk_norm == "head":  # Qwen3, Gemma 3: over each head
        q, k = _norm(q, layer, "q_norm", c), _norm(k, layer, "k_norm", c)
    return q, k, v.reshape(b, s, c.num_kv_heads, c.head_dim)


_QKV_TAGS = ("query_proj", "key_proj", "value_proj")


def _mlp(h, layer, config: LlamaConfig) -> jax.Array:
    """Gated MLP ``down(act(gate(h)) * up(h))``; Phi-3's fused ``gate_up_proj`` is
    ``[gate | up]``."""
    if config.fused_projections:
        gate_up = _proj(h, layer, "gate_up_proj")
        gate, up = jnp.split(gate_up, 2, axis=-1)
    else:
        gate, up = _proj(h, layer, "gate_proj"), _proj(h, layer, "up_proj")
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    hidden = checkpoint_name(ACTIVATIONS[config.hidden_act](gate) * up, "mlp_hidden")
    return checkpoint_name(_proj(hidden, layer, "down_proj"), "mlp_down")


def _moe(h, layer, config: LlamaConfig) -> tuple[jax.Array, jax.Array]:
    """The routed-experts MLP (``num_experts > 0``, ``jmem._src.moe.routed_experts``):
    ``h [..., H]`` -> ``(out [..., H], router probabilities float32 [..., E])``."""
    c = config
    lead = h.shape[:-1]
    out, probs = moe.routed_experts(
        h.reshape(-1, h.shape[-1]),
        layer["router"]["kernel"],
        layer["expert_gate"]["kernel"],
        layer["expert_up"]["kernel"],
        layer["expert_down"]["kernel"],
        top_k=c.num_experts_per_tok,
        norm_topk_prob=c.norm_topk_prob,
        activation=ACTIVATIONS[c.hidden_act],
    )
    return out.reshape(*lead, -1), probs.reshape(*lead, -1)


def _embed(params: Params, tokens: jax.Array, config: LlamaConfig) -> jax.Array:
    """Token embeddings ``[B, S, H]`` (times ``sqrt(H)`` in their dtype for Gemma)."""
    x = jnp.take(params["embed"]["embedding"], tokens, axis=0)
    if config.scale_embeddings:
        x = x * jnp.asarray(math.sqrt(config.hidden_size), jnp.float32).astype(x.dtype)
    return x


def head_kernel(params: Params, config: LlamaConfig) -> jax.Array:
    """The output head ``[H, V]`` (the params' dtype): ``lm_head/kernel``, or
    ``embed/embedding`` transposed when ``config.tie_embeddings``."""
    return params["embed"]["embedding"].T if config.tie_embeddings else params["lm_head"]["kernel"]


def final_norm(params: Params, x: jax.Array, config: LlamaConfig) -> jax.Array:
    """The final norm of ``hidden_states``' output: ``[B, S, H]`` -> ``[B, S, H]``, same
    dtype (``rms_norm`` with ``final_norm/scale``, ``rms_norm_eps``, ``norm_offset``)."""
    return rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps, config.norm_offset)


def _head(params: Params, x: jax.Array, config: LlamaConfig) -> jax.Array:
    """Final norm and output head: ``[B, S, H]`` -> float32 logits ``[B, S, V]``
    (soft-capped with ``final_logit_softcap``)."""
    x = final_norm(params, x, config)
    head = head_kernel(params, config)
    logits = jnp.einsum("bsh,hv->bsv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
    cap = config.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)
