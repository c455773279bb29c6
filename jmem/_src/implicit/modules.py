"""Module rules: which leaves of params become implicit (NF4 / LoRA) weights by default.

QLoRA's default rule (``jmem.qlora.quantize_params(modules=None)``) follows bitsandbytes /
PEFT QLoRA, which quantize the ``nn.Linear`` layers of a model and nothing else: every
floating matrix except embeddings, the output head, norms and biases. A params tree has
no layer types, so the rule goes by name (``EXCLUDE``) and by role: in a stacked model
(``nn.scan`` / ``nnx.scan`` / ``lax.scan`` over layers) a norm scale is ``[L, H]``, rank 2
like a matrix; ``per_layer_vectors`` finds such leaves from their siblings. When a
selected weight cannot stay implicit, ``rule_note`` says which rule picked it and how to
change it (``docs/lora.md``).
"""

from __future__ import annotations

import re
from typing import Any

from jmem._src import tree as _tree

__all__ = [
    "EXCLUDE",
    "LORA_DEFAULT_MODULES",
    "default_modules",
    "per_layer_vectors",
    "default_quantized",
    "rule_note",
]

#: Leaves whose path matches this (``re.search``, case-insensitive) are never quantized by
#: default: embeddings, output heads, norms (``*norm*``, a path component starting with
#: ``ln`` such as ``ln1`` / ``ln_f``), biases, leaves named ``scale`` and a mixture of
#: experts' router (``router``, ``[d_model, E]`` per layer: it picks the experts, so it stays
#: float, as bitsandbytes leaves transformers' routers, which are no ``nn.Linear``).
EXCLUDE = r"(embed|embedding|wte|wpe|lm_head|output_head|norm|ln_|(^|/)ln|bias|(^|/)scale$|router)"

#: LoRA's default modules, as PEFT's default for Llama: the query and value projections;
#: on a mixture-of-experts model also the experts' projections (one LoRA pair per expert:
#: PEFT's default for Mixtral adapts q/v only, but the experts hold most of the weights).
LORA_DEFAULT_MODULES = r".*(q_proj|v_proj|expert_gate|expert_up|expert_down).*"


def default_modules(path: str, leaf: Any) -> bool:
    """Every floating weight of rank >= 2 whose path does not match ``EXCLUDE``.

    Args:
      path: the leaf's '/'-joined key path (``jmem.tree.path_str``).
      leaf: an array, ``jax.ShapeDtypeStruct`` or ``NF4Array``.
    """
    return (
        _tree.is_float_array(leaf)
        and len(leaf.shape) >= 2
        and re.search(EXCLUDE, path, re.IGNORECASE) is None
    )


def _prefixes(path: str) -> list[str]:
    """Ancestors of ``path``, deepest first; ``""`` is the root."""
    parts = path.split("/")
    return ["/".join(parts[:k]) for k in range(len(parts) - 1, -1, -1)]


def per_layer_vectors(flat: list[tuple[str, Any]]) -> set[str]:
    """Paths of rank-2 leaves that are one vector per layer of a stacked model.

    A rank-2 leaf ``[L, H]`` is a per-layer vector (a norm scale, a bias, a gain) when its
    deepest ancestor holding a rank >= 3 leaf (a stacked matrix ``[L, in, out]``) is a
    stack: every leaf under that ancestor has the same leading axis ``L``.

    Args:
      flat: ``[(path, leaf)]`` as ``jmem._src.implicit.weight.flatten_params`` gives.

    Returns:
      The set of such paths.
    """
    has_stack: dict[str, bool] = {}
    lead: dict[str, set] = {}
    for path, leaf in flat:
        shape = tuple(getattr(leaf, "shape", ()))
        for pre in _prefixes(path):
            has_stack[pre] = has_stack.get(pre, False) or len(shape) >= 3
            lead.setdefault(pre, set()).add(shape[0] if shape else None)
    out = set()
    for path, leaf in flat:
        shape = tuple(getattr(leaf, "shape", ()))
        if len(shape) != 2:
            continue
        pre = next((p for p in _prefixes(path) if has_stack[p]), None)
        if pre is not None and lead[pre] == {shape[0]}:
            out.add(path)
    return out


def default_quantized(flat: list[tuple[str, Any]]) -> set[str]:
    """Paths that ``qlora.quantize_params(modules=None)`` quantizes: ``default_modules``
    minus ``per_layer_vectors``."""
    vectors = per_layer_vectors(flat)
    return {p for p, x in flat if p not in vectors and default_modules(p, x)}


def rule_note(name: str, flat: list[tuple[str, Any]], nf4: bool, lora: bool) -> str:
    """Which module rule made ``name`` an implicit weight, and how to change it.

    Args:
      name: the weight's path.
      flat: ``[(path, leaf)]`` of the params (``NF4Array`` leaves kept whole).
      nf4: whether the leaf is an ``NF4Array``; lora: whether it has LoRA adapters.
    """
    notes = []
    if nf4:
        if name in default_quantized(flat):
            notes.append(
                f"{name!r} is NF4: qlora.quantize_params' default rule picks it "
                "(qlora.default_modules: floating, rank >= 2, path not matching qlora.EXCLUDE, "
                "not a per-layer vector of a stacked model), as may a modules= you passed; to "
                "keep it in float, pass qlora.quantize_params(params, modules=...) with a regex "
                "or predicate that does not match it."
            )
        else:
            notes.append(
                f"{name!r} is NF4 although qlora.quantize_params' default rule would not pick "
                "it: the modules= selection passed to qlora.quantize_params (or a direct "
                "nf4.quantize) chose it; change modules= so that it does not match this path."
            )
    if lora:
        if re.fullmatch(LORA_DEFAULT_MODULES, name):
            how = (
                f"lora.init's default modules (lora.DEFAULT_MODULES = {LORA_DEFAULT_MODULES!r}) "
                "match it, as may a modules= you passed"
            )
        else:
            how = (
                "the modules= selection passed to lora.init chose it (the default "
                "lora.DEFAULT_MODULES does not match it)"
            )
        notes.append(
            f"{name!r} has LoRA adapters: {how}; pass lora.init(..., modules=...) that does "
            "not match it."
        )
    return " ".join(notes)
