"""Routed experts, dropless: a router's softmax over E experts picks each token's top k,
the tokens are sorted by expert and every projection is one grouped matmul
(``jmem._src.grouped_matmul``, ``jax.lax.ragged_dot``'s product) over the experts' stacked
kernels; no capacity factor, no token dropped. Routing as transformers'
``MixtralTopKRouter``/``Qwen3MoeTopKRouter`` (softmax in float32, top-k, optional
renormalisation); the grouped matmul as MegaBlocks (Gale et al.
2023, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts"); the load-balancing
loss as Switch Transformer (Fedus et al. 2021, eqs. 4-6) and transformers'
``load_balancing_loss_func``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jmem._src.grouped_matmul import grouped_matmul
from jmem._src.mesh_batch import expert_split

__all__ = ["load_balancing_loss", "local_experts", "route", "routed_experts", "router_stats"]


def route(
    x: jax.Array, router: jax.Array, *, top_k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router: logits ``x @ router`` in the activation dtype (as transformers' router
    ``F.linear``), softmax over experts in float32, top ``top_k``.

    Args:
      x: ``[T, H]`` tokens (any float dtype).
      router: ``[H, E]`` kernel.
      top_k: k, experts per token (1 <= k <= E).
      norm_topk_prob: divide the k weights by their sum (Mixtral; Qwen3-MoE's flag).

    Returns:
      ``(probs, weights, experts)``: float32 ``[T, E]`` softmax probabilities, float32
      ``[T, k]`` routing weights and int32 ``[T, k]`` expert ids (descending probability;
      ties to the lower id, as ``torch.topk``).
    """
    logits = jnp.einsum("th,he->te", x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    logits = checkpoint_name(logits, "router_logits")
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts.astype(jnp.int32)


def routed_experts(
    x: jax.Array,
    router: jax.Array,
    expert_gate: jax.Array,
    expert_up: jax.Array,
    expert_down: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
) -> tuple[jax.Array, jax.Array]:
    """A mixture-of-experts gated MLP over tokens, dropless.

    Each token goes to its ``top_k`` experts (``route``); the ``T * k`` (token, expert)
    pairs are sorted by expert and each projection is one grouped matmul over the stacked
    kernels with the experts' group sizes (``jmem._src.grouped_matmul``), so the matmul work is that of k experts
    per token, not E. Expert ``e`` computes ``down_e(act(gate_e(h)) * up_e(h))``; the
    outputs are weighted by the routing weights and summed per token (in float32).

    The kernels are used as they come (``.astype`` to the activation dtype, then
    the grouped matmul): NF4, LoRA or FP8 weights act on them through jmem's interpreter.

    On a mesh in context with an ``"expert"`` axis of size ``N > 1`` the layer runs expert
    parallel (``jmem._src.expert_parallel``): each device computes its ``E / N`` experts for
    the tokens of its expert group; the result is the same.

    Args:
      x: ``[T, H]`` tokens in the activation dtype.
      router: ``[H, E]``.
      expert_gate, expert_up: ``[E, H, F]``.
      expert_down: ``[E, F, H]``.
      top_k, norm_topk_prob: as ``route``.
      activation: the gate's activation (SwiGLU: silu).

    Returns:
      ``(out, probs)``: ``out`` ``[T, H]`` in ``x.dtype``, and the router's float32
      ``[T, E]`` softmax probabilities (for ``router_stats``).

    Raises:
      ValueError: kernels whose shapes do not fit ``x`` and ``router``, or ``top_k`` outside
        ``1..E``.
    """
    t, h = x.shape
    e = router.shape[-1]
    _check_shapes(h, e, router, expert_gate, expert_up, expert_down, top_k)
    if expert_split() > 1:
        from jmem._src import expert_parallel  # noqa: PLC0415 (it imports this module)

        kernels = (expert_gate, expert_up, expert_down)
        return expert_parallel.routed_experts(
            x, router, *kernels, top_k=top_k, norm_topk_prob=norm_topk_prob, activation=activation
        )
    probs, weights, experts = route(x, router, top_k=top_k, norm_topk_prob=norm_topk_prob)
    kernels = (expert_gate, expert_up, expert_down)
    out = local_experts(x, weights, experts, kernels, first=0, activation=activation)
    return out.astype(x.dtype), probs


def local_experts(x, weights, experts, kernels, *, first, activation) -> jax.Array:
    """The routed pairs of experts ``first .. first + E_l - 1`` (``E_l`` the kernels' leading
    size), weighted and summed per token, float32 ``[T, H]``; pairs routed to other experts
    are sorted after the local groups (outside every group of the grouped matmul) and
    contribute zero. With ``first = 0`` and all ``E`` kernels, the whole layer.

    Args:
      x: ``[T, H]`` tokens; ``weights`` float32 ``[T, k]``, ``experts`` int32 ``[T, k]``
        (``route``).
      kernels: ``(gate, up, down)``: ``[E_l, H, F]``, ``[E_l, H, F]``, ``[E_l, F, H]``.
      first: int32 scalar (may be traced): the global id of the first local expert.
      activation: the gate's activation.
    """
    expert_gate, expert_up, expert_down = kernels
    t, h = x.shape
    top_k, e = experts.shape[-1], expert_gate.shape[0]
    flat = experts.reshape(-1) - first  # [T * k], token-major, local ids
    local = (flat >= 0) & (flat < e)
    flat = jnp.where(local, flat, e)  # other experts' pairs: after the local groups
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = jnp.take(x, order // top_k, axis=0)  # [T * k, H], sorted by expert
    dt = x.dtype
    gate = checkpoint_name(_grouped(xs, expert_gate.astype(dt), group_sizes), "expert_gate")
    up = checkpoint_name(_grouped(xs, expert_up.astype(dt), group_sizes), "expert_up")
    hidden = checkpoint_name(activation(gate) * up, "expert_hidden")
    down = _grouped(hidden, expert_down.astype(dt), group_sizes)
    down = checkpoint_name(down, "expert_down")
    unsorted = jnp.zeros_like(down).at[order].set(down)  # back to token-major pairs
    pairs = unsorted.reshape(t, top_k, h).astype(jnp.float32)
    pairs = jnp.where(local.reshape(t, top_k, 1), pairs, 0.0)  # rows outside the groups
    return jnp.sum(pairs * weights[..., None], axis=1)  # no matmul: elementwise, float32


def _grouped(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``lhs [M, K]`` rows grouped by ``group_sizes [E]`` times ``rhs [E, K, N]``:
    ``jmem._src.grouped_matmul`` (tiles of each expert's rows; XLA rewrites
    ``jax.lax.ragged_dot`` into a dot over a zero-padded ``[M, E K]`` copy, E times the
    work). NF4/LoRA experts act on it through the interpreter's rule for its call."""
    return grouped_matmul(lhs, rhs, group_sizes)


def _check_shapes(h, e, router, gate, up, down, top_k) -> None:
    if router.ndim != 2 or router.shape[0] != h:
        raise ValueError(f"router must be [H={h}, E]; got {router.shape}.")
    f = gate.shape[-1]
    want = {"expert_gate": (e, h, f), "expert_up": (e, h, f), "expert_down": (e, f, h)}
    got = {"expert_gate": gate.shape, "expert_up": up.shape, "expert_down": down.shape}
    bad = {k: v for k, v in got.items() if tuple(v) != want[k]}
    if bad:
        raise ValueError(f"expert kernels {bad} do not fit router [{h}, {e}]: want {want}.")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in 1..E={e}.")


def router_stats(probs: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """One layer's load-balancing statistics from its router probabilities.

    Args:
      probs: float32 ``[..., E]`` softmax probabilities of the tokens that count.
      top_k: k.

    Returns:
      ``(selected, prob_sum)``, float32 ``[E]`` each: how many of the tokens chose each
      expert among their top k (no gradient), and the sum of the probabilities.
    """
    e = probs.shape[-1]
    probs = probs.reshape(-1, e)
    _, experts = jax.lax.top_k(jax.lax.stop_gradient(probs), top_k)
    selected = jnp.zeros((e,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    return selected, jnp.sum(probs, axis=0)


def load_balancing_loss(selected: jax.Array, prob_sum: jax.Array, tokens) -> jax.Array:
    """The load-balancing loss over all layers, as transformers' ``load_balancing_loss_func``
    (its every-token form: no attention mask).

    ``E * sum_e f_e * P_e`` with ``f_e`` the choices of expert ``e`` and ``P_e`` its
    probability mass, each summed over layers and divided by ``layers * tokens``; 1 when
    routing is uniform, up to ``E`` when one expert takes everything (for ``k = 1``).

    Args:
      selected, prob_sum: float32 ``[L, E]``: ``router_stats`` of each layer.
      tokens: tokens per layer (``T``).

    Returns:
      float32 scalar.
    """
    layers, e = selected.shape
    rows = layers * tokens
    f = jnp.sum(selected, axis=0) / rows
    p = jnp.sum(prob_sum, axis=0) / rows
    return e * jnp.sum(f * p)
