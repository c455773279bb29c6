"""Parameters in host memory, streamed to the device layer by layer inside the layer scan.

The layer-stacked weights (``[L, ...]``: NF4 codes and absmax, or bf16 kernels) stay in
``pinned_host``; the scan body copies its layer's slice to the device (``fetch``), so the
forward pass, the remat recomputation and the backward pass each hold one layer's weights
on the device at a time. The copies are XLA's: the host-memory dynamic-slice and the move
to the device become one asynchronous host-to-device copy per iteration, which XLA's
scheduler overlaps with the iteration's other work (docs/offload.md). References:
ZeRO-Infinity (Rajbhandari et al., 2021, arXiv:2104.07857) for streaming parameters from
host memory; JAX's "Memories and host offloading" guide for the memory kinds.
"""

from __future__ import annotations

from typing import Any

import jax

from jmem._src.offload.memory_kinds import HOST
from jmem._src.offload.memory_kinds import is_tracer
from jmem._src.offload.memory_kinds import to_device
from jmem._src.offload.memory_kinds import to_host

__all__ = ["fetch", "fetch_resident", "params_to_host", "is_on_host", "offloads_params"]

#: The params entry holding the layer-stacked weights (streamed; the rest is fetched whole).
LAYERS = "layers"


def offloads_params(levers: Any) -> bool:
    """Whether ``levers`` (a ``jmem.Levers``/``ResolvedLevers`` or None) stream params."""
    return bool(getattr(levers, "offload_params", False))


def fetch(tree: Any) -> Any:
    """Copies every array leaf of ``tree`` to device memory; inside ``jit`` a
    ``device_put`` to ``jax.memory.Space.Device`` (a no-op for leaves already there).

    Used on one layer's slice inside the layer scan: XLA turns the dynamic-slice of the
    host-resident stack plus this copy into one host-to-device transfer of that layer.
    """
    return to_device(tree)


def fetch_resident(params: Any, levers: Any) -> Any:
    """``params`` with every top-level entry but ``"layers"`` (embedding, final norm, LM
    head) copied to the device whole, when ``levers.offload_params``; else ``params``.

    These are device-resident for the call (the embedding's gather and the chunked loss
    read all of them); only the layer stack is streamed."""
    if not offloads_params(levers) or not isinstance(params, dict):
        return params
    return {k: v if k == LAYERS else fetch(v) for k, v in params.items()}


def params_to_host(tree: Any) -> Any:
    """Moves every array leaf of ``tree`` to ``pinned_host`` (outside or inside ``jit``).

    For a params pytree run with ``jmem.Levers(offload_params=True)`` (e.g. the frozen
    NF4 base of QLoRA); ``jmem.train_step`` does it itself for its ``frozen`` params.

    Raises:
      ValueError: the devices holding an array have no ``pinned_host`` memory.
    """
    return to_host(tree, HOST)


def is_on_host(tree: Any) -> bool:
    """Whether every concrete array leaf of ``tree`` is in ``pinned_host`` memory (tracers
    and non-array leaves are not looked at)."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not is_tracer(x)]
    return all(getattr(x.sharding, "memory_kind", None) == HOST for x in leaves)
