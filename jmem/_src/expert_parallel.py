"""Expert parallelism: a mixture-of-experts layer whose ``E`` experts are split over the
``"expert"`` mesh axis (``N`` devices, ``E / N`` experts each), inside the otherwise
auto-sharded step.

A ``jax.shard_map`` over the mesh in context: each device routes its own tokens (the
router is replicated, so the router probabilities, the load-balancing statistics and the
loss are those of one device), all-gathers the tokens, routing weights and expert ids of
its expert group (the ``N`` devices along ``"expert"``), computes the pairs routed to its
local experts with the grouped matmul over its local kernels (``moe.local_experts``), and
reduce-scatters (``psum_scatter``, float32) the weighted sums back to the devices that
own the tokens. The backward pass is JAX's transpose: the all-gather becomes a
reduce-scatter of the token gradients and the reduce-scatter an all-gather. As GShard
(Lepikhin et al. 2020, arXiv:2006.16668) and DeepSpeed-MoE, with an all-gather instead of
an all-to-all.

Dropless: any device's experts may receive every pair of the group, so the sorted buffer
holds all ``N * T_l * k`` gathered pairs (``T_l`` tokens per device): the gathered tokens
``[N T_l, H]``, the sorted pairs ``[N T_l k, H]`` and the gate/up/hidden activations
``[N T_l k, F]`` are ``N`` times those of one device's own pairs, and the grouped matmul
runs over all those rows with the local ``E / N`` kernels (rows outside the local groups
are skipped by ``ragged_dot``'s groups but held). No capacity factor, no token dropped.

NF4 and LoRA experts: the interpreter's ``shard_map`` rule
(``jmem._src.implicit.structural_rules.shard_map``) passes the local slice of an implicit
weight (codes, scales, factors split on the expert axis) into the body, where the grouped
matmul rule sees a local ``Weight``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jmem._src import moe
from jmem._src.mesh_batch import batch_groups
from jmem._src.sharding import EXPERT_AXIS

__all__ = ["check_experts", "routed_experts"]


def check_experts(num_experts: int, n: int) -> None:
    """ValueError unless the expert axis size ``n`` divides ``num_experts``."""
    if num_experts % n:
        raise ValueError(
            f"the expert axis has {n} devices, which does not divide the {num_experts} experts; "
            f"use an expert axis size that divides {num_experts}."
        )


def _body(x, router, gate, up, down, *, top_k, norm_topk_prob, activation, gather):
    """One device: route its tokens, gather the group's, compute the local experts' pairs,
    reduce-scatter (``gather``; else the tokens are the group's already: a ``psum``)."""
    probs, weights, experts = moe.route(x, router, top_k=top_k, norm_topk_prob=norm_topk_prob)
    if gather:
        g = functools.partial(lax.all_gather, axis_name=EXPERT_AXIS, axis=0, tiled=True)
        xg, weights, experts = g(x), g(weights), g(experts)
    else:
        xg = x
    first = lax.axis_index(EXPERT_AXIS) * gate.shape[0]
    out = moe.local_experts(
        xg, weights, experts, (gate, up, down), first=first, activation=activation
    )
    if gather:
        out = lax.psum_scatter(out, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    else:
        out = lax.psum(out, EXPERT_AXIS)
    return out.astype(x.dtype), probs


def routed_experts(
    x: jax.Array,
    router: jax.Array,
    expert_gate: jax.Array,
    expert_up: jax.Array,
    expert_down: jax.Array,
    *,
    top_k: int,
    norm_topk_prob: bool,
    activation: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """``moe.routed_experts`` with the experts split over the ``"expert"`` axis of the
    mesh in context (module docstring); the same arguments and results.

    Args:
      x: ``[T, H]`` tokens, rows split over the batch axes that divide ``T``
        (``mesh_batch.batch_groups``; ``"expert"`` among them: each device holds ``T / G``).
      router: ``[H, E]``, replicated.
      expert_gate, expert_up: ``[E, H, F]``; expert_down: ``[E, F, H]``: split on ``E``.
      top_k, norm_topk_prob, activation: as ``moe.routed_experts``.

    Returns:
      ``(out [T, H] in x.dtype, float32 probs [T, E])``, split as ``x``.

    Raises:
      ValueError: an expert axis size that does not divide ``E`` (``check_experts``).
    """
    mesh = jax.sharding.get_abstract_mesh()
    n = int(dict(zip(mesh.axis_names, mesh.axis_sizes))[EXPERT_AXIS])
    check_experts(router.shape[-1], n)
    axes = batch_groups(x.shape[0])[0]
    rows = P(axes or None)
    kernel = P(EXPERT_AXIS)
    body = functools.partial(
        _body,
        top_k=top_k,
        norm_topk_prob=norm_topk_prob,
        activation=activation,
        gather=EXPERT_AXIS in axes,
    )
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows, P(), kernel, kernel, kernel),
        out_specs=(rows, rows),
        check_vma=False,
    )
    return fn(x, router, expert_gate, expert_up, expert_down)
