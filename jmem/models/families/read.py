"""The ``config.json`` reader: a Hugging Face config of a ``FAMILIES`` model type ->
``LlamaConfig`` (``config_from_dict``, behind ``jmem.models.hf.load_config``), refusing the
values jmem does not implement (RoPE types, dropout, quantized checkpoints, ...) and warning
about fields it does not know. Sources: transformers' ``configuration_<family>.py``.
"""

from __future__ import annotations

import warnings

from jmem.models.families.table import FAMILIES
from jmem.models.families.table import HANDLED_FIELDS
from jmem.models.families.table import IGNORED_FIELDS
from jmem.models.families.table import NOT_LOADED
from jmem.models.families.table import Family
from jmem.models.families.table import refuse
from jmem.models.llama import ACTIVATIONS
from jmem.models.llama import LlamaConfig
from jmem.models.llama import RopeScaling

__all__ = ["config_from_dict", "layer_windows"]


def layer_windows(c: dict, family: Family) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` of a ``config.json`` in ``LlamaConfig``'s normal
    form: no window when no layer slides, ``layer_types`` only when layers differ.
    ``family.windows`` says where the windows are when the file has no ``layer_types``."""
    n = c["num_hidden_layers"]
    window = c.get("sliding_window") if family.windows.enabled(c) else None
    if window is None:
        types = ["full_attention"] * n
    elif c.get("layer_types") is not None:
        types = list(c["layer_types"])
    else:
        types = family.windows.layer_types(c, n)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != n:
        refuse("layer_types", types, f"{n} entries of full_attention, sliding_attention")
    if "sliding_attention" not in types:
        return None, None
    return int(window), (None if len(set(types)) == 1 else tuple(types))


_ROPE_KEYS = {
    None: {"rope_type", "type", "rope_theta"},
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
}


def _rope_dict(c: dict) -> tuple[str, dict]:
    """``(field, merged parameters)`` from ``rope_scaling`` (transformers < 5) and
    ``rope_parameters`` (>= 5, which also holds ``rope_theta``); ``rope_scaling`` wins."""
    field = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    winner = c.get(field) or {}
    kind = winner.get("rope_type", winner.get("type"))
    rope = {**(c.get("rope_parameters") or {}), **(c.get("rope_scaling") or {})}
    rope.pop("type", None)
    rope["rope_type"] = kind  # the winning spelling's type, not the other's
    return field, rope


def _rope(c: dict, field: str | None = None, rope: dict | None = None):
    """``(rope_theta, rope_scaling)``; refuses RoPE types and keys jmem does not implement
    (Phi-3's ``longrope``/``su``, YaRN, dynamic NTK, partial rotary)."""
    if rope is None:
        field, rope = _rope_dict(c)
    kind = rope.get("rope_type")
    supported = "rope_type default, linear, llama3"
    if kind not in _ROPE_KEYS:
        refuse(f"{field}.rope_type", kind, supported)
    required = _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta"}
    missing = sorted(k for k in required if rope.get(k) is None)
    if missing:
        raise ValueError(
            f"config.json: {field} with rope_type={kind!r} lacks {missing}; RoPE "
            f"{kind} scaling needs {sorted(required)}."
        )
    extra = {k: v for k, v in rope.items() if k not in _ROPE_KEYS[kind] and v is not None}
    partial = extra.pop("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        refuse("partial_rotary_factor", partial, "1.0 (rotary over the whole head)")
    if extra:
        refuse(field, extra, f"{supported} with keys {sorted(_ROPE_KEYS[kind] - {'type'})}")
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind in (None, "default"):
        return theta, None
    factor = float(rope["factor"])
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    return theta, RopeScaling(
        "llama3",
        factor,
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )


def _gemma3_rope(c: dict) -> tuple[float, RopeScaling | None, float]:
    """``(rope_theta, rope_scaling, local_rope_theta)`` of Gemma 3: ``rope_parameters``
    per layer type (transformers >= 5), or ``rope_theta``/``rope_scaling`` for the global
    layers and ``rope_local_base_freq`` for the local ones (< 5)."""
    params = c.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            refuse("rope_parameters", unknown, "keys full_attention, sliding_attention")
        full = {"rope_type": "default", "rope_theta": 1e6, **params.get("full_attention", {})}
        local = {"rope_type": "default", "rope_theta": 1e4, **params.get("sliding_attention", {})}
        theta, scaling = _rope(c, "rope_parameters.full_attention", full)
        local_theta, local_scaling = _rope(c, "rope_parameters.sliding_attention", local)
        if local_scaling is not None:
            refuse("rope_parameters.sliding_attention.rope_type", local["rope_type"], "default")
        return theta, scaling, local_theta
    c = {"rope_theta": 1e6, **c}
    theta, scaling = _rope(c)
    return theta, scaling, float(c.get("rope_local_base_freq", 1e4))


def _check_fields(c: dict, family: Family) -> None:
    """Refuses fields whose values jmem does not implement; warns about unknown fields."""
    if c.get("quantization_config"):
        method = c["quantization_config"].get("quant_method", "?")
        refuse(
            "quantization_config.quant_method",
            method,
            "unquantized checkpoints; use load_params(quantize='nf4') to quantize on load",
        )
    field = family.activation_field
    if c.get(field) is not None and c[field] not in ACTIVATIONS:
        refuse(field, c[field], ", ".join(sorted(ACTIVATIONS)))
    if c.get("attention_dropout", 0.0):
        refuse("attention_dropout", c["attention_dropout"], "0.0 (jmem applies no dropout)")
    known = IGNORED_FIELDS | HANDLED_FIELDS | set(family.fields)
    unknown = sorted(k for k in set(c) - known if c[k] is not None)
    if unknown:
        warnings.warn(
            f"config.json fields {unknown} are unknown to jmem.models.hf and ignored; if "
            "they change the model, its logits will differ from transformers'.",
            stacklevel=3,
        )


def config_from_dict(c: dict) -> LlamaConfig:
    """``LlamaConfig`` from a parsed Hugging Face ``config.json`` of a ``FAMILIES`` model
    type. See ``jmem.models.hf.load_config``."""
    model_type = c.get("model_type", "llama")
    if model_type not in FAMILIES:
        hint = f"; {NOT_LOADED[model_type]}" if model_type in NOT_LOADED else ""
        refuse("model_type", model_type, ", ".join(FAMILIES) + hint)
    family = FAMILIES[model_type]
    c = {**dict(family.defaults), **c}  # fields the file omits take the family's defaults
    _check_fields(c, family)
    if family.per_layer_rope:
        rope_theta, rope_scaling, local_theta = _gemma3_rope(c)
    else:
        (rope_theta, rope_scaling), local_theta = _rope(c), None
    window, layer_types = layer_windows(c, family)
    if layer_types is None and window is not None and local_theta is not None:
        rope_theta, rope_scaling = local_theta, None  # every layer is local
    heads = c["num_attention_heads"]
    kwargs = dict(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rope_theta=rope_theta,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq_len=int(c.get("max_position_embeddings", 4096)),
        rope_scaling=rope_scaling,
        sliding_window=window,
        layer_types=layer_types,
        local_rope_theta=local_theta if layer_types is not None else None,
        hidden_act=c.get("hidden_act", "silu"),
        **dict(family.options),
    )
    return LlamaConfig(**{**kwargs, **family.read(c)})
