"""``apply``: FP8 matmuls in a plain model. ``apply(fn)`` runs ``fn`` under the
implicit-weight interpreter with each kernel carrying its ``Fp8Meta`` (``fp8_meta.py``), so
that every matmul against such a kernel is an ``fp8_dot_general`` (``fp8_dot.py``); FP8's own
interpreter rules (a weight carrying an ``Fp8Meta``; an FP8 matmul of an NF4/LoRA weight,
``implicit/fp8_rules.py``) are registered by importing this module, since the
interpreter's core never imports them. See ``docs/fp8.md``.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Callable

from jmem._src.fp8_meta import meta_paths
from jmem._src.implicit import fp8_rules as _fp8_rules  # noqa: F401  (registers the rules)
from jmem._src.implicit import interpreter as _interpreter

__all__ = ["apply", "applying"]


def apply(fn: Callable, *, allow_materialize: bool = False) -> Callable:
    """Wraps ``fn(params, *args, **kwargs)`` as ``fn_fp8(params, metas, *args, **kwargs)``,
    whose matmuls against the kernels with a meta run in FP8 with delayed scaling.

    The model writes plain matmuls (``x @ kernel``, ``einsum``, ``dot_general``); the
    implicit-weight interpreter (the one behind ``jmem.lora.apply``/``jmem.qlora.apply``,
    ``docs/lora.md``) carries each kernel with its ``Fp8Meta`` and runs ``fp8_dot_general``
    at each matmul against it: stacked kernels ``[L, in, out]`` with stacked metas
    ``[L]`` are sliced together by the model's ``lax.scan`` (or indexing), an ``NF4Array``
    kernel is dequantized to the view dtype first. The cotangent of ``metas`` is the
    updated states (the overwrite rule of ``fp8_dot``): ``jax.grad(fn_fp8,
    argnums=(0, 1))`` gives ``(param_grads, new_metas)``. A kernel used inside a loop over
    token chunks (``jmem.Levers(token_chunk=...)``) gets one state update, exactly the one
    of the unchunked call (per-chunk amaxes max-reduced, ``implicit/structural_rules.py``).

    Args:
      fn: a function whose first argument is a params pytree (e.g. ``llama.loss_fn``).
      allow_materialize: where a kernel with a meta is used other than in a matmul, use its
        dense value there (its state then gets no update from that use) instead of
        raising.

    Returns:
      ``fn_fp8(params, metas, *args, **kwargs)``; ``metas`` as ``init_metas(params, ...)``
      returns (an ``Fp8Meta`` at each FP8 kernel, None elsewhere), or None (``fn``
      unchanged).

    Raises (when called):
      TypeError: ``metas`` holds leaves other than ``Fp8Meta``/None.
      ValueError: a meta's path is not a leaf of ``params``, or its batch shape is not the
        kernel's stacked shape.
      jmem.lora.ImplicitWeightError: a kernel with a meta used other than in a matmul, or a
        stacked meta reaching a matmul unsliced.
    """

    @functools.wraps(fn)
    def fn_fp8(params, metas, *args, **kwargs):
        paths = meta_paths(metas)
        if not paths:
            return fn(params, *args, **kwargs)
        token = _APPLYING.set(True)
        try:
            return _interpreter.call(
                fn, params, None, args, kwargs, allow_materialize=allow_materialize, metas=paths
            )
        finally:
            _APPLYING.reset(token)

    return fn_fp8


#: True while ``apply`` traces its function with at least one meta.
_APPLYING = contextvars.ContextVar("jmem_fp8_applying", default=False)


def applying() -> bool:
    """Whether the code calling this is being traced under ``jmem.fp8.apply`` with at least
    one ``Fp8Meta`` (its matmuls against the kernels with a meta then run in FP8). The
    reference Llama reads it to refuse ``jmem.Levers(fp8=True)`` outside ``apply``."""
    return _APPLYING.get()
