"""The decoder: parameters (shapes, ``init``, ``abstract_params``), the layer scan and
``forward``. Layer params are stacked on a leading ``num_layers`` axis and iterated with
``lax.scan`` (compile time does not grow with depth; ``jmem.remat`` checkpoints each layer),
as MaxText's scanned decoder layers.
"""

from __future__ import annotations

import math
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jmem._src import fp8_apply
from jmem._src import fp8_meta
from jmem._src import levers as levers_lib
from jmem._src import moe
from jmem._src.offload import params as offload_params
from jmem.models.llama.block import _layer
from jmem.models.llama.block import _resolved
from jmem.models.llama.block import warn_fp8_argument
from jmem.models.llama.config import LlamaConfig
from jmem.models.llama.config import Params
from jmem.models.llama.config import expert_size
from jmem.models.llama.layers import _embed
from jmem.models.llama.layers import _head
from jmem.models.llama.layers import rope_tables


def _layer_shapes(c: LlamaConfig) -> Params:
    """Shapes of one layer's weights (without the leading ``L``)."""
    H, F, D = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * D, c.num_kv_heads * D
    if c.fused_projections:
        shapes = {
            "qkv_proj": {"kernel": (H, q + 2 * kv)},
            "o_proj": {"kernel": (q, H)},
            "gate_up_proj": {"kernel": (H, 2 * F)},
            "down_proj": {"kernel": (F, H)},
        }
    else:
        shapes = {
            "q_proj": {"kernel": (H, q)},
            "k_proj": {"kernel": (H, kv)},
            "v_proj": {"kernel": (H, kv)},
            "o_proj": {"kernel": (q, H)},
            **_mlp_shapes(c),
        }
    norms = {}
    if c.norm_placement != "post":
        norms.update(attn_norm=(H,), mlp_norm=(H,))
    if c.norm_placement != "pre":
        norms.update(post_attn_norm=(H,), post_mlp_norm=(H,))
    if c.qk_norm == "head":
        norms.update(q_norm=(D,), k_norm=(D,))
    elif c.qk_norm == "proj":
        norms.update(q_norm=(q,), k_norm=(kv,))
    shapes.update({name: {"scale": shape} for name, shape in norms.items()})
    for name in c.biases:
        shapes[name]["bias"] = shapes[name]["kernel"][-1:]
    return shapes


def _mlp_shapes(c: LlamaConfig) -> Params:
    """The MLP's kernels: gate/up/down ``[H, F]``/``[F, H]``, or with ``num_experts`` E the
    router ``[H, E]`` and the experts' stacks ``[E, H, F_e]``, ``[E, H, F_e]``,
    ``[E, F_e, H]`` (``MOE_NAMES``)."""
    H, F, E = c.hidden_size, c.intermediate_size, c.num_experts
    if not E:
        return {
            "gate_proj": {"kernel": (H, F)},
            "up_proj": {"kernel": (H, F)},
            "down_proj": {"kernel": (F, H)},
        }
    Fe = expert_size(c)
    return {
        "router": {"kernel": (H, E)},
        "expert_gate": {"kernel": (E, H, Fe)},
        "expert_up": {"kernel": (E, H, Fe)},
        "expert_down": {"kernel": (E, Fe, H)},
    }


def param_shapes(config: LlamaConfig) -> Params:
    """Shapes of every parameter, as a pytree of tuples (same structure as ``init``).

    Layer weights carry a leading ``num_layers`` axis; which ones exist follows the
    config's family options (``norm_placement``, ``qk_norm``, ``fused_projections``,
    ``biases``, ``tie_embeddings``)."""
    c = config
    layer = jax.tree.map(lambda s: (c.num_layers, *s), _layer_shapes(c), is_leaf=_is_shape)
    shapes: Params = {
        "embed": {"embedding": (c.vocab_size, c.hidden_size)},
        "layers": layer,
        "final_norm": {"scale": (c.hidden_size,)},
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = {"kernel": (c.hidden_size, c.vocab_size)}
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
    """Random parameters: normal(0, 0.02) weights (as HF's ``initializer_range``), unit
    norms (weights ``1 - norm_offset``), zero biases.

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
        if "norm" in path:  # the scale that multiplies is norm_offset + weight
            out.append(jnp.full(shape, 1.0 - config.norm_offset, dtype))
        elif "bias" in path:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def _is_local(config: LlamaConfig) -> jax.Array | None:
    """bool ``[L]``: which layers are sliding-window layers, when layers differ (None when
    every layer is the same: the window and RoPE are then Python constants)."""
    c = config
    if c.layer_types is None or (len(set(c.layer_types)) == 1 and c.local_rope_theta is None):
        return None
    return jnp.asarray([t == "sliding_attention" for t in c.layer_types])


def _layer_rope(config: LlamaConfig, positions):
    """RoPE tables of every layer, or a pair ``(global, local)`` when layers differ
    (selected per layer inside the scan by ``_per_layer``)."""
    c = config
    rope = rope_tables(positions, c.head_dim, c.rope_theta, c.rope_scaling)
    if _is_local(c) is None:
        return rope
    local = rope
    if c.local_rope_theta is not None:
        local = rope_tables(positions, c.head_dim, c.local_rope_theta, None)
    return rope, local


def _per_layer(local, rope, attn: dict, config: LlamaConfig):
    """This layer's ``(rope, attn)``: with mixed layers (``local``, a traced bool scalar
    scanned with the layer params) its RoPE tables and window (a traced int32, 0 for
    global attention); else the shared ones."""
    if local is None:
        return rope, attn
    rope = jax.tree.map(lambda g, loc: jnp.where(local, loc, g), *rope)
    window = jnp.where(local, config.sliding_window or 0, 0).astype(jnp.int32)
    return rope, {**attn, "sliding_window": window}


def _check_row_arrays(tokens, **arrays) -> None:
    """ValueError unless each given array is an integer ``[B, S]`` like ``tokens``."""
    for name, a in arrays.items():
        if a is not None and (a.shape != tokens.shape or not jnp.issubdtype(a.dtype, jnp.integer)):
            raise ValueError(
                f"{name} must be an integer array shaped like tokens {tokens.shape}; "
                f"got {a.dtype}{a.shape}."
            )


def _check_fp8(fp8) -> None:
    """ValueError for fp8 metas outside ``"layers"`` (the deprecated ``fp8=`` argument
    scaled the layers' projections only)."""
    if fp8 is not None and any(
        fp8_meta.is_meta(m)
        for k, v in fp8.items()
        if k != "layers"
        for m in jax.tree.leaves(v, is_leaf=fp8_meta.is_meta)
    ):
        raise ValueError(
            "fp8 metas are only used for the projections under 'layers'; "
            "build them with fp8.init_metas(params, LINEAR_NAMES)."
        )


def with_fp8(fn: Callable, name: str, params, fp8, *args, **kwargs):
    """``fn(params, *args, **kwargs)`` for the deprecated ``fp8=`` argument of ``name``:
    ``jmem.fp8.apply(fn)(params, fp8, ...)`` after ``_check_fp8``, with a warning."""
    warn_fp8_argument(name, stacklevel=4)
    _check_fp8(fp8)
    return fp8_apply.apply(fn)(params, fp8, *args, **kwargs)


def _check_fp8_levers(lv) -> None:
    """ValueError for ``levers.fp8=True`` outside ``jmem.fp8.apply``: the layers' matmuls
    are plain, so they would run in the compute dtype, not FP8."""
    if lv.fp8 and not fp8_apply.applying():
        raise ValueError(
            "levers.fp8=True but the model is not under jmem.fp8.apply with FP8 metas, so its "
            "matmuls would not run in FP8: call jmem.fp8.apply(llama.loss_fn)(params, metas, "
            "batch, cfg, levers=lv) with metas = jmem.fp8.init_metas(params, LINEAR_NAMES), "
            "or set Levers(fp8=False)."
        )


def hidden_states(
    params: Params,
    tokens: jax.Array,
    config: LlamaConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    layer_transform: Callable | None = None,
    levers: Any = None,
) -> tuple[jax.Array, levers_lib.ResolvedLevers]:
    """The decoder's hidden states: the last layer's output, before the final norm and the
    head, and the levers the layers ran with.

    ``forward`` is ``final_norm`` then the head (``head_kernel``, float32 accumulation,
    ``final_logit_softcap``) on these states; a loss over token chunks reads them instead
    of the logits (``loss_fn``, ``jmem.models.preference``).

    Args:
      params, tokens, config, positions, segment_ids, layer_transform, levers: as
        ``forward`` (tokens int32 ``[B, S]``; ``levers`` a ``jmem.Levers`` resolved here
        for this batch, a ``jmem.ResolvedLevers``, or None for ``jmem.Levers()``).

    Returns:
      ``(hidden, resolved)``: ``hidden`` ``[B, S, H]`` in the activations' dtype (the
      embedding's), and the ``jmem.ResolvedLevers`` of this call (its ``loss_chunk`` is the
      token chunk a loss over ``hidden`` uses).

    Raises:
      ValueError: as ``forward`` (misshaped tokens, positions or segment ids;
        ``levers.fp8=True`` outside ``jmem.fp8.apply``).
    """
    x, lv, _ = decode_layers(
        params,
        tokens,
        config,
        positions=positions,
        segment_ids=segment_ids,
        layer_transform=layer_transform,
        levers=levers,
    )
    return x, lv


def decode_layers(
    params: Params,
    tokens: jax.Array,
    config: LlamaConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    layer_transform: Callable | None = None,
    levers: Any = None,
) -> tuple[jax.Array, levers_lib.ResolvedLevers, jax.Array | None]:
    """``hidden_states`` and the router's load-balancing loss: ``(hidden, resolved,
    aux)``, ``aux`` a float32 scalar (``jmem._src.moe.load_balancing_loss`` over every
    layer and token of the batch, not yet weighted by ``router_aux_loss_coef``) for a
    mixture-of-experts config, None for a dense one. Arguments and errors as
    ``hidden_states``."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be an integer array [batch, seq]; got {tokens.dtype}{tokens.shape}."
        )
    _check_row_arrays(tokens, positions=positions, segment_ids=segment_ids)
    c = config
    x = _embed(params, tokens, c)
    lv = _resolved(levers, c, tokens.shape, x.dtype, segment_ids)
    _check_fp8_levers(lv)
    seq = tokens.shape[1]
    rope = _layer_rope(c, seq if positions is None else positions)
    attn = {"q_index": jnp.arange(seq), "segment_ids": segment_ids}
    is_local = _is_local(c)

    def body(x, xs):
        layer, local = xs if is_local is not None else (xs, None)  # layers differ: a flag
        if lv.offload_params:  # this layer's slice of the host-resident stack, to the device
            layer = offload_params.fetch(layer)
        # Named so that remat's "offload" policy saves the layer input in host memory.
        x = checkpoint_name(x, "layer_input")
        layer_rope, layer_attn = _per_layer(local, rope, attn, c)
        x, _, router = _layer(x, layer, c, layer_rope, layer_attn, lv=lv)
        return x, router  # router: None (dense) or this layer's moe.router_stats

    if layer_transform is not None:
        body = layer_transform(body)
    xs = params["layers"] if is_local is None else (params["layers"], is_local)
    x, router = jax.lax.scan(body, x, xs, unroll=lv.scan_unroll)
    aux = None if router is None else moe.load_balancing_loss(*router, math.prod(tokens.shape))
    return x, lv, aux


def forward(
    params: Params,
    tokens: jax.Array,
    config: LlamaConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    layer_transform: Callable | None = None,
    fp8: Params | None = None,
    levers: Any = None,
) -> jax.Array:
    """Logits of a causal LM.

    Args:
      params: the params pytree (see ``init``); activations take the embedding's dtype.
      tokens: int32 ``[B, S]``.
      config: the model's ``LlamaConfig``.
      positions: optional int32 ``[B, S]`` RoPE positions; default ``0..S-1`` in every row.
        For packed rows, restart at 0 at each example.
      segment_ids: optional int32 ``[B, S]``: packed examples (a row holding several
        sequences), one id per example; attention never crosses ids (see
        ``attention_mask``). Default: one sequence per row.
      layer_transform: optional wrapper applied to the scan body ``(x, layer) -> (x, None)``
        (``(x, router statistics)`` for a mixture-of-experts config),
        e.g. ``lambda f: jmem.remat(f, "selective")``. ``jmem.remat`` around the whole loss
        reaches the scan body without it.
      fp8: deprecated (one release; warns): FP8 scaling states from
        ``jmem.fp8.init_metas(params, LINEAR_NAMES)``; the same as
        ``jmem.fp8.apply(forward)(params, fp8, tokens, config, ...)``, which runs every
        projection with a meta as an FP8 matmul (E4M3 forward, E5M2 gradients, delayed
        scaling; the new states are the gradient w.r.t. the metas, ``docs/fp8.md``).
      levers: how the model is run: a ``jmem.Levers`` (resolved here for this batch on
        the running backend; None: ``jmem.Levers()``) or a ``jmem.ResolvedLevers`` (from
        ``jmem.resolve_levers``, e.g. for a compile target). ``loss_chunk`` is unused
        here: the logits are returned whole. ``levers.fp8=True`` needs the call to be
        under ``jmem.fp8.apply`` with metas (the FP8 matmuls run there).

    Returns:
      float32 logits ``[B, S, V]``.

    Raises:
      ValueError: if ``tokens`` is not a 2-D integer array, ``positions``/``segment_ids``
        are not integer arrays shaped like it, ``fp8`` holds metas outside ``"layers"``,
        or ``levers.fp8=True`` outside ``jmem.fp8.apply`` (with metas).
    """
    kw = dict(positions=positions, segment_ids=segment_ids, layer_transform=layer_transform)
    if fp8 is not None:
        return with_fp8(forward, "forward", params, fp8, tokens, config, **kw, levers=levers)
    params = offload_params.fetch_resident(params, levers)
    x = hidden_states(
        params,
        tokens,
        config,
        positions=positions,
        segment_ids=segment_ids,
        layer_transform=layer_transform,
        levers=levers,
    )[0]
    return _head(params, x, config)
