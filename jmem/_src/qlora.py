"""QLoRA: NF4-quantized frozen base weights + LoRA adapters, on any JAX/Flax model.

Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (arXiv:2305.14314);
bitsandbytes ``Linear4bit`` + PEFT. Each NF4 weight is dequantized per matmul (per layer,
inside a layer ``scan``) and again in the backward pass, never kept. See ``docs/lora.md``.
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax

from jmem._src import lora as _lora
from jmem._src import nf4 as _nf4
from jmem._src import tree as _tree
from jmem._src.implicit import interpreter as _implicit
from jmem._src.implicit import modules as _modules
from jmem._src.implicit.modules import EXCLUDE
from jmem._src.implicit.modules import default_modules

__all__ = ["quantize_params", "dequantize_params", "apply", "default_modules", "EXCLUDE"]


def quantize_params(
    params,
    modules: str | Callable[[str, Any], bool] | None = None,
    *,
    block_size: int = 64,
    double_quant: bool = True,
    targets: Any = _lora._UNSET,
):
    """Replaces the selected weights of ``params`` with ``jmem.nf4.NF4Array`` leaves.

    Args:
      params: a params pytree (arrays; ``jax.ShapeDtypeStruct`` under ``jax.eval_shape``).
      modules: ``None`` for the default rule: ``default_modules`` (floating, rank >= 2,
        path not matching ``EXCLUDE``: no embedding, output head, norm, bias or ``scale``)
        minus the per-layer vectors of a stacked model (a ``[L, H]`` leaf whose siblings
        are ``[L, ...]`` stacks, e.g. a norm scale under ``nn.scan``/``nnx.scan``); or a
        regex (``re.fullmatch`` on the '/'-joined path) or a predicate
        ``(path, leaf) -> bool``. Only floating leaves of
        rank >= 2 can be quantized; rank >= 3 leaves are stacks ``[*L, in, out]`` quantized
        per matrix, so a layer ``scan`` slices them into per-layer ``NF4Array``s.
      block_size, double_quant: see ``jmem.nf4.quantize``.
      targets: deprecated name of ``modules``.

    Returns:
      The same pytree structure with ``NF4Array`` leaves at the selected paths; the
      ``NF4Array`` keeps the original dtype, which the model sees when it runs.

    Raises:
      ValueError: if a selected leaf is not a floating array of rank >= 2, or nothing matched.
    """
    modules = _lora.renamed_keyword("qlora.quantize_params", targets, modules, None)
    flat, treedef = _implicit.flatten_params(params)
    if modules is None:
        chosen = _modules.default_quantized(flat)
        pred = lambda path, leaf: path in chosen  # noqa: E731
    else:
        pred = _tree.path_predicate(modules)
    out, n = [], 0
    for path, leaf in flat:
        if isinstance(leaf, _nf4.NF4Array) or not pred(path, leaf):
            out.append(leaf)
            continue
        shape = getattr(leaf, "shape", ())
        if len(shape) < 2 or not _tree.is_float_array(leaf):
            raise ValueError(
                f"Cannot NF4-quantize {path!r} ({getattr(leaf, 'dtype', type(leaf))}"
                f"{tuple(shape)}): only floating weights of rank >= 2 are supported."
            )
        out.append(_nf4.quantize(leaf, block_size=block_size, double_quant=double_quant))
        n += 1
    if n == 0:
        raise ValueError(
            "qlora.quantize_params matched no weight; pass modules= (a regex on paths "
            f"such as {[p for p, _ in flat][:8]})."
        )
    return jax.tree.unflatten(treedef, out)


def dequantize_params(qparams, dtype=None):
    """Replaces every ``NF4Array`` leaf by its dequantized array.

    Args:
      qparams: a params pytree with ``NF4Array`` leaves (``quantize_params``).
      dtype: the output dtype; ``None`` for each leaf's original dtype.

    Returns:
      ``qparams`` with dense arrays in place of the ``NF4Array`` leaves.
    """
    return jax.tree.map(
        lambda x: (
            _nf4.dequantize(x, x.dtype if dtype is None else dtype)
            if isinstance(x, _nf4.NF4Array)
            else x
        ),
        qparams,
        is_leaf=lambda x: isinstance(x, _nf4.NF4Array),
    )


def apply(fn: Callable, *, allow_materialize: bool = False) -> Callable:
    """``fn(params, *args)`` -> ``fn_q(qparams, lora, *args)`` (``lora`` may be ``None``).

    Same as ``jmem.lora.apply``; see there and ``docs/lora.md``.
    """
    return _lora.apply(fn, allow_materialize=allow_materialize)
