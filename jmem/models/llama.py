"""Reference Llama-family decoder as pure functions of a params pytree.

RMSNorm, rotary position embeddings (``rope_theta``), grouped-query attention and a
SwiGLU MLP, as in Touvron et al. 2023 ("Llama 2") and Hugging Face's
``LlamaForCausalLM``, whose checkpoints load into it (``jmem.models.hf``).

Why pure functions instead of Flax modules: every jmem transform (remat over scans,
NF4 leaves, LoRA adapters, FP8 scaling state, sharding rules) acts on a params pytree
and on the traced computation. A plain ``forward(params, tokens, config)`` keeps the
pytree the single source of truth, with no module state to split and merge.

Layer params are stacked on a leading ``num_layers`` axis and iterated with
``lax.scan``, so compile time does not grow with depth and ``jmem.remat`` can
checkpoint each layer. Intermediates carry ``checkpoint_name`` tags (see
``CHECKPOINT_NAMES``) for name-based remat policies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jmem._src import fp8 as fp8_lib

Params = dict[str, Any]

#: Names given with ``checkpoint_name`` inside each layer, in execution order.
__all__ = [
    "CHECKPOINT_NAMES",
    "CONFIGS",
    "LINEAR_NAMES",
    "LlamaConfig",
    "abstract_params",
    "apply_rope",
    "attention",
    "cross_entropy",
    "decoder_layer",
    "forward",
    "get_config",
    "init",
    "loss_fn",
    "num_params",
    "param_shapes",
    "rms_norm",
    "rope_tables",
]

CHECKPOINT_NAMES = (
    "attn_norm",
    "query_proj",
    "key_proj",
    "value_proj",
    "attn_context",
    "attn_out",
    "mlp_norm",
    "mlp_gate",
    "mlp_up",
    "mlp_hidden",
    "mlp_down",
)

#: The weight names of one layer that are matmul kernels ``[in, out]``.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family model.

    Attributes:
      vocab_size: tokens in the vocabulary (V).
      hidden_size: model width (H).
      intermediate_size: SwiGLU MLP width (F).
      num_layers: decoder layers (L).
      num_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention when < num_heads).
      head_dim: per-head width; defaults to hidden_size // num_heads.
      rope_theta: RoPE base frequency.
      rms_norm_eps: epsilon inside RMSNorm.
      tie_embeddings: reuse the embedding matrix as the output head.
      max_seq_len: longest sequence the config is meant for (informational).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 4096

    def __post_init__(self):
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads="
                    f"{self.num_heads}; pass head_dim explicitly."
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} for grouped-query attention."
            )


CONFIGS: dict[str, LlamaConfig] = {
    # A few million parameters: trains on a CPU in minutes (byte-level vocabulary).
    "tiny": LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_seq_len=512,
    ),
    # About 1.1B parameters (TinyLlama-1.1B shapes).
    "llama_1b": LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        max_seq_len=2048,
    ),
    "llama2_7b": LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        max_seq_len=4096,
    ),
    "llama3_8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
}


def get_config(name: str | LlamaConfig, **overrides) -> LlamaConfig:
    """Returns a named config (``tiny``, ``llama_1b``, ``llama2_7b``, ``llama3_8b``).

    Raises:
      ValueError: for an unknown name; the message lists the known ones.
    """
    if isinstance(name, LlamaConfig):
        cfg = name
    else:
        try:
            cfg = CONFIGS[name]
        except KeyError:
            raise ValueError(
                f"Unknown model config {name!r}; choose one of {sorted(CONFIGS)}."
            ) from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def param_shapes(config: LlamaConfig) -> Params:
    """Shapes of every parameter, as a pytree of tuples (same structure as ``init``)."""
    c = config
    L, H, F, D = c.num_layers, c.hidden_size, c.intermediate_size, c.head_dim
    shapes: Params = {
        "embed": {"embedding": (c.vocab_size, H)},
        "layers": {
            "attn_norm": {"scale": (L, H)},
            "q_proj": {"kernel": (L, H, c.num_heads * D)},
            "k_proj": {"kernel": (L, H, c.num_kv_heads * D)},
            "v_proj": {"kernel": (L, H, c.num_kv_heads * D)},
            "o_proj": {"kernel": (L, c.num_heads * D, H)},
            "mlp_norm": {"scale": (L, H)},
            "gate_proj": {"kernel": (L, H, F)},
            "up_proj": {"kernel": (L, H, F)},
            "down_proj": {"kernel": (L, F, H)},
        },
        "final_norm": {"scale": (H,)},
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = {"kernel": (H, c.vocab_size)}
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def num_params(config: LlamaConfig) -> int:
    """Number of parameters (elements) of the model."""
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(config), is_leaf=_is_shape))


def abstract_params(config: LlamaConfig, dtype=jnp.float32) -> Params:
    """``jax.ShapeDtypeStruct`` leaves: measure or plan a model without allocating it."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(config), is_leaf=_is_shape
    )


def init(key: jax.Array, config: LlamaConfig, dtype=jnp.float32) -> Params:
    """Random parameters: normal(0, 0.02) weights (as HF's ``initializer_range``), unit norms.

    Returns:
      The params pytree described in the module docstring, every leaf of ``dtype``.
    """
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]
    ]
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, shape, path in zip(keys, leaves, paths):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


@jax.named_scope("rms_norm")
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019), computed in float32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float):
    """cos/sin tables ``[seq_len, head_dim // 2]`` (float32) for rotary embeddings."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


@jax.named_scope("rope")
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x [B, S, heads, D]`` by position, half-split layout as in HF Llama."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _dense(x: jax.Array, kernel: jax.Array, meta=None) -> jax.Array:
    """``x @ kernel`` in the activation dtype (the kernel is cast to it if needed); an FP8
    delayed-scaling matmul (``jmem.fp8.fp8_dot``) when an ``Fp8Meta`` ``meta`` is given."""
    if meta is not None:
        return fp8_lib.fp8_dot(x, kernel.astype(x.dtype), meta)
    return jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype))


def _meta(fp8: Params | None, name: str):
    """This layer's ``Fp8Meta`` for projection ``name``, or None (no FP8)."""
    return None if fp8 is None or fp8.get(name) is None else fp8[name]["kernel"]


@jax.named_scope("attention")
def attention(q, k, v):
    """Causal grouped-query attention. q ``[B,S,nH,D]``, k/v ``[B,S,nKV,D]`` -> ``[B,S,nH,D]``."""
    b, s, nh, d = q.shape
    nkv = k.shape[2]
    q = q.reshape(b, s, nkv, nh // nkv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / math.sqrt(d)
    mask = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, s, nh, d)


def decoder_layer(
    x: jax.Array, layer: Params, config: LlamaConfig, cos, sin, fp8: Params | None = None
) -> jax.Array:
    """One pre-norm decoder layer. x ``[B, S, H]`` -> ``[B, S, H]``, same dtype.
    ``fp8``: this layer's slice of ``forward``'s ``fp8["layers"]`` (or None)."""
    c = config
    b, s, _ = x.shape
    h = checkpoint_name(rms_norm(x, layer["attn_norm"]["scale"], c.rms_norm_eps), "attn_norm")
    q = checkpoint_name(_dense(h, layer["q_proj"]["kernel"], _meta(fp8, "q_proj")), "query_proj")
    k = checkpoint_name(_dense(h, layer["k_proj"]["kernel"], _meta(fp8, "k_proj")), "key_proj")
    v = checkpoint_name(_dense(h, layer["v_proj"]["kernel"], _meta(fp8, "v_proj")), "value_proj")
    q = apply_rope(q.reshape(b, s, c.num_heads, c.head_dim), cos, sin)
    k = apply_rope(k.reshape(b, s, c.num_kv_heads, c.head_dim), cos, sin)
    v = v.reshape(b, s, c.num_kv_heads, c.head_dim)
    ctx = checkpoint_name(attention(q, k, v).reshape(b, s, -1), "attn_context")
    x = x + checkpoint_name(
        _dense(ctx, layer["o_proj"]["kernel"], _meta(fp8, "o_proj")), "attn_out"
    )
    h = checkpoint_name(rms_norm(x, layer["mlp_norm"]["scale"], c.rms_norm_eps), "mlp_norm")
    gate = checkpoint_name(
        _dense(h, layer["gate_proj"]["kernel"], _meta(fp8, "gate_proj")), "mlp_gate"
    )
    up = checkpoint_name(_dense(h, layer["up_proj"]["kernel"], _meta(fp8, "up_proj")), "mlp_up")
    hidden = checkpoint_name(jax.nn.silu(gate) * up, "mlp_hidden")
    return x + checkpoint_name(
        _dense(hidden, layer["down_proj"]["kernel"], _meta(fp8, "down_proj")), "mlp_down"
    )


def forward(
    params: Params,
    tokens: jax.Array,
    config: LlamaConfig,
    *,
    layer_transform: Callable | None = None,
    fp8: Params | None = None,
) -> jax.Array:
    """Logits of a causal LM.

    Args:
      params: the params pytree (see ``init``); activations take the embedding's dtype.
      tokens: int32 ``[B, S]``.
      config: the model's ``LlamaConfig``.
      layer_transform: optional wrapper applied to the scan body ``(x, layer) -> (x, None)``,
        e.g. ``lambda f: jmem.remat(f, "selective")``. ``jmem.remat`` around the whole loss
        reaches the scan body without it.
      fp8: optional FP8 scaling states from ``jmem.fp8.init_metas(params, LINEAR_NAMES)``
        (one ``Fp8Meta`` per layer, stacked, scanned with the layer params): projections
        with a meta run as FP8 matmuls (E4M3 forward, E5M2 gradients, delayed scaling).
        The new states are the gradient w.r.t. ``fp8`` (see ``jmem.fp8``). With ``fp8``
        the scan body's second argument is ``(layer, layer_fp8)``.

    Returns:
      float32 logits ``[B, S, V]``.

    Raises:
      ValueError: if ``tokens`` is not a 2-D integer array, or ``fp8`` holds metas
        outside ``"layers"`` (they would go unused and be reset).
    """
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be an integer array [batch, seq]; got {tokens.dtype}{tokens.shape}."
        )
    c = config
    embedding = params["embed"]["embedding"]
    x = jnp.take(embedding, tokens, axis=0)
    cos, sin = rope_tables(tokens.shape[1], c.head_dim, c.rope_theta)

    if fp8 is not None and any(
        fp8_lib.is_meta(m)
        for k, v in fp8.items()
        if k != "layers"
        for m in jax.tree.leaves(v, is_leaf=fp8_lib.is_meta)
    ):
        raise ValueError(
            "fp8 metas are only used for the projections under 'layers'; "
            "build them with fp8.init_metas(params, LINEAR_NAMES)."
        )

    def body(x, layer):
        layer, layer_fp8 = layer if fp8 is not None else (layer, None)
        return decoder_layer(x, layer, c, cos, sin, layer_fp8), None

    if layer_transform is not None:
        body = layer_transform(body)
    xs = params["layers"] if fp8 is None else (params["layers"], fp8["layers"])
    x, _ = jax.lax.scan(body, x, xs)
    x = rms_norm(x, params["final_norm"]["scale"], c.rms_norm_eps)
    head = embedding.T if c.tie_embeddings else params["lm_head"]["kernel"]
    return jnp.einsum("bsh,hv->bsv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)


@jax.named_scope("cross_entropy")
def cross_entropy(
    logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """Mean token cross-entropy (nats). logits ``[B,S,V]`` float, targets int ``[B,S]``."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = logz - picked
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def loss_fn(
    params: Params, batch: dict[str, jax.Array], config: LlamaConfig, **kwargs
) -> jax.Array:
    """Mean next-token cross-entropy of ``batch = {"inputs": [B,S], "targets": [B,S]}``
    (optional ``"mask"`` ``[B,S]``). Extra keyword arguments go to ``forward``."""
    logits = forward(params, batch["inputs"], config, **kwargs)
    return cross_entropy(logits, batch["targets"], batch.get("mask"))
