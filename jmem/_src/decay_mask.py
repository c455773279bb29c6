"""Weight-decay mask: decay the matrices of projections, not norms, biases or embeddings.

Decoupled weight decay (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization")
is conventionally applied to the weight matrices of linear layers only; biases, the
scales/offsets of normalization layers and embedding tables are left alone (nanoGPT's and
minGPT's ``configure_optimizers``, Hugging Face's ``Trainer`` for norms and biases).

optax's ``adamw`` decays every parameter unless given ``mask=``, and the common
``lambda p: jax.tree.map(lambda x: x.ndim > 1, p)`` is wrong for jmem's models: their layers
are stacked on a leading ``num_layers`` axis, so a per-layer RMSNorm scale is ``[L, H]``
(two dimensions) and would be decayed. ``decay_mask`` decides by the parameter's *name and
role* (its key path), never by its number of dimensions.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax

from jmem._src.lora import LoraWeight
from jmem._src.tree import is_float_array
from jmem._src.tree import path_str

#: Leaf names of matmul weights (Flax/jmem ``kernel``, PyTorch/HF ``weight``, Haiku ``w``,
#: PEFT's ``lora_A``/``lora_B``).
KERNEL_NAMES = frozenset({"kernel", "weight", "w", "lora_a", "lora_b"})
#: Leaf names that are never decayed: biases, norm scales and offsets.
NO_DECAY_NAMES = frozenset({"bias", "b", "scale", "offset", "gamma", "beta"})
#: A path component naming an embedding table (``embed``, ``embed_tokens``, ``wte``...).
_EMBEDDING = re.compile(
    r"(?!un|embed_out$)\w*embed\w*|wte|wpe|word_embeddings|position_embeddings"
)  # GPT-NeoX's ``embed_out`` is the output head (a matrix, decayed)
#: A path component naming a normalization layer (``attn_norm``, ``LayerNorm_0``, ``ln_f``).
_NORM = re.compile(r"\w*norm\w*|ln(_\w+|\d+)?|\w*_ln(_\w+)?")  # not ``lnproj``


def _components(path) -> list[str]:
    """Lower-case names along a key path, split on ``/`` and ``.``; the ``.value`` attribute
    of a Flax NNX ``Variable`` is dropped (it is the container, not a name)."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            if k.name in ("value", "raw_value"):
                continue
            name = k.name
        elif isinstance(k, jax.tree_util.DictKey):
            name = str(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            name = str(k.idx)
        else:
            name = str(getattr(k, "key", k))
        out.extend(p.lower() for p in re.split(r"[/.]", name) if p)
    return out


def _decide(names: list[str], leaf: Any) -> bool | None:
    """True (decay), False (no decay) or None (the name does not say)."""
    if not is_float_array(leaf):
        return False
    if any(_EMBEDDING.fullmatch(n) or _NORM.fullmatch(n) for n in names):
        return False
    last = names[-1] if names else ""
    if last in NO_DECAY_NAMES:
        return False
    if last in KERNEL_NAMES:
        return True
    return None


def decay_mask(params: Any, *, default: bool | None = None) -> Any:
    """Which parameters weight decay should apply to, by name and role.

    ``True`` for the matrices of projections: leaves named ``kernel`` (Flax, jmem),
    ``weight`` (PyTorch/HF names), ``w`` (Haiku), ``lora_A``/``lora_B``, and the ``a``/``b``
    factors of a ``jmem.lora.LoraWeight`` (decided by the path of the weight they adapt).
    ``False`` for biases (``bias``, ``b``), norm parameters (``scale``, ``offset``,
    ``gamma``, ``beta``, or any leaf under a path component naming a norm: ``*norm*``,
    ``ln_*``, ``LayerNorm_0``), embedding tables (any path component ``*embed*``,
    ``wte``, ``wpe``; a separate output head such as ``lm_head/kernel`` is a projection and
    is decayed) and non-floating leaves. The number of dimensions is never used: the
    stacked ``[L, H]`` norm scales of ``jmem.models.llama`` are False.

    Works on plain dicts, Flax linen variables and Flax NNX ``State`` (``nnx.state(model,
    nnx.Param)``); pass the mask, or the function itself, to an optimizer::

        optax.adamw(1e-4, weight_decay=0.1, mask=jmem.decay_mask)
        jmem.adamw_8bit(1e-4, weight_decay=0.1, mask=jmem.decay_mask(params))

    Args:
      params: a params pytree (arrays, ``ShapeDtypeStruct`` s or ``LoraWeight`` s).
      default: the decision for leaves whose name says neither (e.g. a custom ``"proj"``
        leaf). None raises instead.

    Returns:
      A pytree of Python bools with the structure of ``params`` (a ``LoraWeight`` maps to a
      ``LoraWeight`` of bools).

    Raises:
      ValueError: when ``default`` is None and some floating leaves have unknown names; the
        message lists their paths.
    """
    unknown = []

    def leaf_mask(path, leaf):
        names = _components(path)
        if isinstance(leaf, LoraWeight):
            d = _decide(names, leaf.a)
            d = True if d is None else d  # an adapter of a custom-named matrix
            return dataclasses.replace(leaf, a=d, b=d)  # same static fields: same treedef
        d = _decide(names, leaf)
        if d is None:
            unknown.append(jax.tree_util.keystr(path))
            return default
        return d

    mask = jax.tree_util.tree_map_with_path(
        leaf_mask, params, is_leaf=lambda x: isinstance(x, LoraWeight)
    )
    if unknown and default is None:
        raise ValueError(
            f"decay_mask cannot tell from their names whether to decay {unknown[:10]}"
            f"{' ...' if len(unknown) > 10 else ''}: known matrix names are "
            f"{sorted(KERNEL_NAMES)}, known non-decayed names {sorted(NO_DECAY_NAMES)}, "
            "norm and embedding modules. Pass default=True or default=False for them, or "
            "build the mask with jax.tree_util.tree_map_with_path."
        )
    return mask


def norm_or_bias_paths(params: Any) -> list[str]:
    """For each leaf of ``params`` (``jax.tree.leaves`` order), its '/'-joined path when it is a
    floating norm parameter or bias (``decay_mask``'s names: no embeddings), else ``""``.
    The factors of a ``LoraWeight`` are never norms or biases."""
    out = []

    def visit(path, leaf):
        if isinstance(leaf, LoraWeight):
            out.extend("" for _ in jax.tree.leaves(leaf))
            return
        names = _components(path)
        norm = any(_NORM.fullmatch(n) for n in names)
        bias_or_scale = bool(names) and names[-1] in NO_DECAY_NAMES
        hit = is_float_array(leaf) and (norm or bias_or_scale)
        out.append(path_str(path) if hit else "")

    jax.tree_util.tree_map_with_path(visit, params, is_leaf=lambda x: isinstance(x, LoraWeight))
    return out
