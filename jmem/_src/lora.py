"""LoRA: low-rank adapters kept as their own pytree, applied without merging weights.

``apply(fn)`` computes ``x·W + s·(x·a)·b`` at every targeted matmul through the
implicit-weight interpreter (``jmem/_src/implicit/``). Semantics follow Hu et al. 2021
("LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685) and Hugging Face
PEFT's ``LoraLayer``. Design and limits: ``docs/lora.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp

from jmem._src import nf4 as _nf4
from jmem._src import tree as _tree
from jmem._src.implicit import interpreter as _implicit
from jmem._src.implicit import targets as _targets

__all__ = ["LoraWeight", "init", "apply", "merge", "num_trainable", "DEFAULT_TARGETS"]

#: Default targets, as PEFT's default for Llama: the query and value projections.
DEFAULT_TARGETS = _targets.LORA_DEFAULT_TARGETS


@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """Adapter of one weight ``W [*L, in, out]``: ``W + scale * a @ b``.

    Attributes:
      a: ``[*L, in, r]`` (PEFT's ``lora_A.weight`` transposed), random at init.
      b: ``[*L, r, out]`` (PEFT's ``lora_B.weight`` transposed), zeros at init.
      scale: static float, ``alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA).
    """

    a: Any
    b: Any
    scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))

    @property
    def rank(self) -> int:
        """The adapter rank ``r`` (``a.shape[-1]``)."""
        return int(self.a.shape[-1])

    def delta(self, dtype=jnp.float32) -> jax.Array:
        """The dense update ``scale * a @ b`` ``[*L, in, out]`` (materializes it)."""
        d = jnp.einsum("...ir,...ro->...io", self.a.astype(jnp.float32), self.b.astype(jnp.float32))
        return (d * self.scale).astype(dtype)


jax.tree_util.register_dataclass(LoraWeight, data_fields=["a", "b"], meta_fields=["scale"])


def init(
    key: jax.Array,
    params,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: str | Callable[[str, Any], bool] = DEFAULT_TARGETS,
    init: str = "kaiming",
    rslora: bool = False,
    dtype=jnp.float32,
) -> dict[str, LoraWeight]:
    """Creates LoRA adapters for the weights of ``params`` matched by ``targets``.

    Args:
      key: PRNG key.
      params: the base params pytree (arrays, ``NF4Array`` or ``ShapeDtypeStruct`` leaves).
      rank: r, the adapter rank (>= 1).
      alpha: LoRA alpha; the scale is ``alpha / rank`` (``alpha / sqrt(rank)`` if rslora).
      targets: regex matched (``re.fullmatch``) against each leaf's '/'-joined path, or a
        predicate ``(path, leaf) -> bool``. Only leaves of rank >= 2 are adapted (a matched
        bias is skipped); rank-3+ leaves are stacks ``[*L, in, out]``.
      init: ``"kaiming"`` (PEFT default: ``a ~ U(-1/sqrt(in), 1/sqrt(in))``) or
        ``"gaussian"`` (``a ~ N(0, (1/r)^2)``); ``b`` is zeros either way.
      rslora: rank-stabilized scaling ``alpha / sqrt(rank)``.
      dtype: dtype of ``a`` and ``b`` (float32 by default, as PEFT keeps adapters).

    Returns:
      ``{path: LoraWeight}``, ordered as the leaves of ``params``.

    Raises:
      ValueError: for rank < 1, an unknown ``init``, or when no leaf matches ``targets``.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int; got {rank!r}.")
    if init not in ("kaiming", "gaussian"):
        raise ValueError(f"init must be 'kaiming' or 'gaussian'; got {init!r}.")
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    pred = _tree.path_predicate(targets)
    flat, _ = _implicit.flatten_params(params)
    chosen = [(p, x) for p, x in flat if len(getattr(x, "shape", ())) >= 2 and pred(p, x)]
    if not chosen:
        raise ValueError(
            f"No weight of rank >= 2 matches targets={targets!r}; paths are "
            f"{[p for p, _ in flat][:20]}."
        )
    keys = jax.random.split(key, len(chosen))
    out: dict[str, LoraWeight] = {}
    for k, (path, w) in zip(keys, chosen):
        *lead, fan_in, fan_out = w.shape
        if init == "kaiming":
            bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) on lora_A [r, in]
            a = jax.random.uniform(k, (*lead, fan_in, rank), jnp.float32, -bound, bound)
        else:
            a = jax.random.normal(k, (*lead, fan_in, rank), jnp.float32) / rank
        b = jnp.zeros((*lead, rank, fan_out), dtype)
        out[path] = LoraWeight(a=a.astype(dtype), b=b, scale=float(scale))
    return out


def apply(fn: Callable, *, allow_materialize: bool = False) -> Callable:
    """Wraps ``fn(params, *args, **kwargs)`` as ``fn_lora(params, lora, *args, **kwargs)``.

    ``fn_lora`` computes ``fn(merge(params, lora), ...)`` as ``x·W + s·(x·a)·b`` at each
    targeted matmul (no merged weight is built). ``params`` may contain ``NF4Array`` leaves
    (QLoRA: dequantized per matmul, recomputed in backward). ``lora`` may be ``None``.

    Args:
      fn: any JAX function whose first argument is a params pytree: a pure model function,
        an NNX ``nnx.merge(graphdef, state)(x)`` wrapper, the reference Llama.
      allow_materialize: where a targeted weight cannot stay implicit (see ``docs/lora.md``),
        materialize its merged, dequantized value for that operation instead of raising.

    Returns:
      ``fn_lora(params, lora, *args, **kwargs)``.

    Raises (when called):
      ValueError: an adapter path missing from ``params`` or of the wrong shape.
      jmem.lora.ImplicitWeightError: a targeted weight used other than in a matmul.
    """

    @functools.wraps(fn)
    def fn_lora(params, lora, *args, **kwargs):
        return _implicit.call(fn, params, lora, args, kwargs, allow_materialize=allow_materialize)

    return fn_lora


def merge(params, lora: dict[str, LoraWeight]):
    """Merges and unloads: returns params with ``W + scale * a @ b`` at each adapted leaf.

    ``NF4Array`` leaves with an adapter are dequantized (to their original dtype) and merged;
    other leaves are returned as they are. The result has ``W``'s dtype.

    Args:
      params: the base params pytree (arrays or ``NF4Array`` leaves).
      lora: ``{path: LoraWeight}`` (``init``).

    Returns:
      ``params`` with each adapted leaf replaced by its merged dense weight.

    Raises:
      ValueError: if an adapter names no leaf of ``params``.
    """
    flat, treedef = _implicit.flatten_params(params)
    names = {p for p, _ in flat}
    missing = sorted(set(lora) - names)
    if missing:
        raise ValueError(f"LoRA adapters for {missing} have no matching leaf in params.")
    out = []
    for path, w in flat:
        ad = lora.get(path)
        if ad is None:
            out.append(w)
            continue
        dense = _nf4.dequantize(w, w.dtype) if isinstance(w, _nf4.NF4Array) else w
        out.append((dense.astype(jnp.float32) + ad.delta(jnp.float32)).astype(dense.dtype))
    return jax.tree.unflatten(treedef, out)


def num_trainable(lora: dict[str, LoraWeight]) -> int:
    """Number of trainable parameters (elements of every ``a`` and ``b``)."""
    return sum(int(math.prod(x.shape)) for x in jax.tree.leaves(lora))
