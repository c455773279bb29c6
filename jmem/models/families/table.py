"""The table of model families: each transformers ``model_type`` jmem loads is a ``Family``
entry, a set of ``LlamaConfig`` family options plus the ``config.json`` fields that set the
rest, and ``tensor_names`` maps every params leaf to its Hugging Face tensor name.

Every family rule is a field of its entry (the options it implies, from
``jmem._src.model_table.FAMILY_OPTIONS``; how it places windows; which configs it computes),
so a new Llama-like family is one ``Family`` entry here (see ``docs/families.md``); the
``config.json`` reader is ``read.py``, the writer ``write.py``. Sources: transformers'
``modeling_<family>.py`` and ``configuration_<family>.py`` (Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3, Phi-3, OLMo 2).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

from jmem._src import model_table
from jmem.models.llama import LlamaConfig
from jmem.models.llama import param_shapes

__all__ = [
    "ALTERNATING",
    "EVERY_LAYER",
    "FAMILIES",
    "FAMILY_OPTIONS",
    "HANDLED_FIELDS",
    "IGNORED_FIELDS",
    "NOT_LOADED",
    "NO_WINDOWS",
    "PATTERN",
    "QWEN_WINDOWS",
    "Family",
    "Windows",
    "family_of",
    "refuse",
    "tensor_names",
]

_ATTN_BIASES = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_BIASES = ("gate_proj", "up_proj", "down_proj")
_QKV = ("q_proj", "k_proj", "v_proj")


def refuse(field: str, value, supported: str):
    """Raises the loader's ValueError for a ``config.json`` value jmem does not implement."""
    raise ValueError(
        f"config.json: {field}={value!r} is not implemented by jmem.models.llama "
        f"(supported: {supported}); loading it would compute a different model."
    )


def _no_fields(c: dict) -> dict:
    return {}


def _no_output(config: LlamaConfig) -> dict:
    return {}


def _llama_biases(c: dict) -> dict:
    """``attention_bias`` (q/k/v/o) and ``mlp_bias`` (gate/up/down), as Llama."""
    biases = ()
    if c.get("attention_bias", False):
        biases += _ATTN_BIASES
    if c.get("mlp_bias", False):
        biases += _MLP_BIASES
    return {"biases": biases}


def _write_llama_biases(config: LlamaConfig) -> dict:
    return {"attention_bias": "q_proj" in config.biases, "mlp_bias": "gate_proj" in config.biases}


def _attention_bias(c: dict) -> dict:
    """``attention_bias``: biases on q/k/v/o (Qwen3, Gemma, OLMo 2 have no MLP biases)."""
    return {"biases": _ATTN_BIASES if c.get("attention_bias", False) else ()}


def _write_attention_bias(config: LlamaConfig) -> dict:
    return {"attention_bias": bool(config.biases)}


def _no_dropout(c: dict, *fields: str) -> None:
    for field in fields:
        if c.get(field):
            refuse(field, c[field], "0.0 (jmem applies no dropout)")


def _gemma(c: dict) -> dict:
    """Gemma 2/3 fields: attention scale, soft-caps, GeGLU named ``hidden_activation``."""
    if c.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", True, "false (causal attention)")
    qpas = c.get("query_pre_attn_scalar")
    return {
        **_attention_bias(c),
        "hidden_act": c.get("hidden_activation") or "gelu_pytorch_tanh",
        "attn_scale": None if qpas is None else float(qpas) ** -0.5,
        "attn_logit_softcap": _float_or_none(c.get("attn_logit_softcapping")),
        "final_logit_softcap": _float_or_none(c.get("final_logit_softcapping")),
    }


def _float_or_none(x) -> float | None:
    return None if x is None else float(x)


def _write_gemma(config: LlamaConfig) -> dict:
    scale = config.attn_scale if config.attn_scale is not None else config.head_dim**-0.5
    qpas = round(scale**-2, 6)
    return {
        **_write_attention_bias(config),
        "hidden_activation": config.hidden_act,
        "query_pre_attn_scalar": int(qpas) if float(qpas).is_integer() else qpas,
        "attn_logit_softcapping": config.attn_logit_softcap,
        "final_logit_softcapping": config.final_logit_softcap,
    }


def _qwen2(c: dict) -> dict:
    """Qwen2: q/k/v biases built in, so no ``attention_bias``/``mlp_bias`` fields."""
    if c.get("attention_bias") or c.get("mlp_bias"):
        refuse("attention_bias/mlp_bias", True, "absent for qwen2 (q/k/v biases are built in)")
    return {"biases": _QKV}


def _phi3(c: dict) -> dict:
    """Phi-3: no dropout; no biases (its fused projections have none)."""
    _no_dropout(c, "resid_pdrop", "embd_pdrop")
    if c.get("attention_bias"):
        refuse("attention_bias", True, "false (Phi-3's qkv_proj has no bias)")
    return {}


def _all_full(c: dict, n: int) -> list[str]:
    return ["full_attention"] * n


def _all_sliding(c: dict, n: int) -> list[str]:
    return ["sliding_attention"] * n


def _qwen_types(c: dict, n: int) -> list[str]:
    """Qwen2/3: sliding from layer ``max_window_layers`` on."""
    start = c.get("max_window_layers", n)
    return ["full_attention" if i < start else "sliding_attention" for i in range(n)]


def _alternate_types(c: dict, n: int) -> list[str]:
    """Gemma 2: even layers local, odd layers global."""
    return list(model_table.periodic_layer_types(n, 2))


def _pattern_types(c: dict, n: int) -> list[str]:
    """Gemma 3: every ``sliding_window_pattern``-th layer global (default 6)."""
    pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6))
    return list(model_table.periodic_layer_types(n, int(pattern)))


def _always(c: dict) -> bool:
    return True


def _never(c: dict) -> bool:
    return False


def _use_sliding_window(c: dict) -> bool:
    return bool(c.get("use_sliding_window", False))  # as transformers' Qwen2/Qwen3 configs


def _write_no_windows(config: LlamaConfig, types: list[str]) -> dict:
    return {}


def _write_window(config: LlamaConfig, types: list[str]) -> dict:
    return {"sliding_window": config.sliding_window}


def _write_layer_types(config: LlamaConfig, types: list[str]) -> dict:
    return {"sliding_window": config.sliding_window, "layer_types": types}


def _write_qwen_windows(config: LlamaConfig, types: list[str]) -> dict:
    """``layer_types`` and Qwen's ``use_sliding_window``/``max_window_layers``."""
    c = config
    sliding = c.sliding_window is not None
    out = {"sliding_window": c.sliding_window, "layer_types": types}
    out.update(use_sliding_window=sliding, max_window_layers=0 if sliding else c.num_layers)
    if sliding and types[0] == "full_attention":
        out["max_window_layers"] = types.index("sliding_attention")
    return out


def _write_gemma_windows(config: LlamaConfig, types: list[str]) -> dict:
    """``layer_types`` with a window always set (unused when no layer slides)."""
    return {"sliding_window": config.sliding_window or 4096, "layer_types": types}


@dataclasses.dataclass(frozen=True)
class Windows:
    """How a family's ``config.json`` places sliding-window layers.

    Attributes:
      enabled: ``config.json`` dict -> whether its ``sliding_window`` applies at all (not
        for Llama; Qwen's ``use_sliding_window``).
      layer_types: ``(config.json dict, num_layers)`` -> each layer's type, for a file with
        a window and no ``layer_types`` field.
      write: ``(LlamaConfig, each layer's type)`` -> the window fields the family writes.
    """

    enabled: Callable[[dict], bool]
    layer_types: Callable[[dict, int], list[str]]
    write: Callable[[LlamaConfig, list[str]], dict]


#: No sliding window (Llama, OLMo 2).
NO_WINDOWS = Windows(_never, _all_full, _write_no_windows)
#: A window in every layer when ``sliding_window`` is set (Mistral, Phi-3).
EVERY_LAYER = Windows(_always, _all_sliding, _write_window)
#: Qwen2/3: ``use_sliding_window`` from ``max_window_layers`` on.
QWEN_WINDOWS = Windows(_use_sliding_window, _qwen_types, _write_qwen_windows)
#: Gemma 2: alternating local and global layers.
ALTERNATING = Windows(_always, _alternate_types, _write_gemma_windows)
#: Gemma 3: every ``sliding_window_pattern``-th layer global.
PATTERN = Windows(_always, _pattern_types, _write_gemma_windows)


def _computes_any(config: LlamaConfig) -> str | None:
    return None


def _llama_shaped(config: LlamaConfig, family: str) -> str | None:
    """Why Llama, Mistral and Qwen2 (``family``) cannot compute ``config``, if they cannot."""
    if config.layer_types is not None or config.attn_logit_softcap or config.final_logit_softcap:
        return f"{family} has no per-layer attention types or soft-caps"
    return None


def _llama_rejects(config: LlamaConfig) -> str | None:
    """Llama: all attention and/or all MLP projections biased, no window."""
    llama_sets = (set(), set(_ATTN_BIASES), set(_MLP_BIASES), set(_ATTN_BIASES + _MLP_BIASES))
    if set(config.biases) not in llama_sets:
        return "Llama biases all attention projections and/or all MLP projections"
    if config.sliding_window is not None:
        return "Llama has no sliding window"
    return _llama_shaped(config, "Llama")


def _mistral_rejects(config: LlamaConfig) -> str | None:
    """Mistral: a window, no biases."""
    if config.sliding_window is None:
        return "Mistral has a sliding window"
    if config.biases:
        return "Mistral has no biases"
    return _llama_shaped(config, "Mistral")


def _qwen2_rejects(config: LlamaConfig) -> str | None:
    """Qwen2: biases on q/k/v."""
    if set(config.biases) != set(_QKV):
        return "Qwen2 has biases on q/k/v only"
    return _llama_shaped(config, "Qwen2")


@dataclasses.dataclass(frozen=True)
class Family:
    """How one transformers ``model_type`` maps onto ``LlamaConfig``.

    Attributes:
      architecture: transformers' class (``config.json``'s ``architectures``).
      options: the ``LlamaConfig`` family options the model type implies (as pairs;
        ``model_table.FAMILY_OPTIONS``, which the presets read too).
      windows: how its ``config.json`` places sliding-window layers (a ``Windows``:
        ``NO_WINDOWS``, ``EVERY_LAYER``, ``QWEN_WINDOWS``, ``ALTERNATING``, ``PATTERN``).
      fields: the family's own ``config.json`` fields, read by ``read``.
      read: ``config.json`` dict -> ``LlamaConfig`` keyword arguments (biases, soft-caps,
        ...); refuses values it does not implement.
      write: the inverse, ``LlamaConfig`` -> those ``config.json`` fields.
      per_layer_rope: ``rope_parameters`` is ``{layer type: parameters}`` (Gemma 3).
      defaults: the transformers config class's defaults of fields a ``config.json`` may
        omit (Gemma's ``tie_word_embeddings=True``, soft-caps, ...), as pairs.
      activation_field: the ``config.json`` field naming the MLP activation
        (``hidden_activation`` for Gemma).
      rejects: ``LlamaConfig`` -> None when the family computes it, else why not
        (``family_of`` chooses among the families with the config's options by it:
        Llama, Mistral and Qwen2 share Llama's options and differ in biases and window).
    """

    architecture: str
    options: tuple[tuple[str, Any], ...] = ()
    windows: Windows = NO_WINDOWS
    fields: tuple[str, ...] = ()
    read: Callable[[dict], dict] = _no_fields
    write: Callable[[LlamaConfig], dict] = _no_output
    per_layer_rope: bool = False
    defaults: tuple[tuple[str, Any], ...] = ()
    activation_field: str = "hidden_act"
    rejects: Callable[[LlamaConfig], str | None] = _computes_any


def _implied(model_type: str) -> tuple[tuple[str, Any], ...]:
    """The family options of ``model_type`` as pairs (``model_table.FAMILY_OPTIONS``)."""
    return tuple(model_table.FAMILY_OPTIONS[model_type].items())


_GEMMA_DEFAULTS = (
    ("tie_word_embeddings", True),
    ("head_dim", 256),
    ("query_pre_attn_scalar", 256),
    ("sliding_window", 4096),
    ("hidden_activation", "gelu_pytorch_tanh"),
)
_GEMMA_FIELDS = (
    "hidden_activation",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_bidirectional_attention",
    "attention_bias",
)

#: ``model_type`` -> its mapping; the families ``jmem.models.hf`` loads.
FAMILIES: dict[str, Family] = {
    "llama": Family(
        "LlamaForCausalLM",
        options=_implied("llama"),
        fields=("attention_bias", "mlp_bias"),
        read=_llama_biases,
        write=_write_llama_biases,
        rejects=_llama_rejects,
    ),
    "mistral": Family(
        "MistralForCausalLM",
        options=_implied("mistral"),
        windows=EVERY_LAYER,
        defaults=(("sliding_window", 4096),),
        rejects=_mistral_rejects,
    ),
    "qwen2": Family(
        "Qwen2ForCausalLM",
        options=_implied("qwen2"),
        windows=QWEN_WINDOWS,
        fields=("attention_bias", "mlp_bias"),  # refused when set: q/k/v biases are built in
        read=_qwen2,
        rejects=_qwen2_rejects,
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM",
        options=_implied("qwen3"),
        windows=QWEN_WINDOWS,
        fields=("attention_bias",),
        read=_attention_bias,
        write=_write_attention_bias,
        defaults=(("head_dim", 128), ("sliding_window", 4096), ("max_window_layers", 28)),
    ),
    "gemma2": Family(
        "Gemma2ForCausalLM",
        options=_implied("gemma2"),
        windows=ALTERNATING,
        fields=_GEMMA_FIELDS,
        read=_gemma,
        write=_write_gemma,
        defaults=(
            *_GEMMA_DEFAULTS,
            ("attn_logit_softcapping", 50.0),
            ("final_logit_softcapping", 30.0),
        ),
        activation_field="hidden_activation",
    ),
    "gemma3_text": Family(
        "Gemma3ForCausalLM",
        options=_implied("gemma3_text"),
        windows=PATTERN,
        fields=(
            *_GEMMA_FIELDS,
            "rope_local_base_freq",
            "sliding_window_pattern",
            "_sliding_window_pattern",  # transformers 5's spelling
        ),
        read=_gemma,
        write=_write_gemma,
        per_layer_rope=True,
        defaults=_GEMMA_DEFAULTS,
        activation_field="hidden_activation",
    ),
    "phi3": Family(
        "Phi3ForCausalLM",
        options=_implied("phi3"),
        windows=EVERY_LAYER,
        # original_max_position_embeddings only matters to longrope, which is refused
        fields=("resid_pdrop", "embd_pdrop", "original_max_position_embeddings", "attention_bias"),
        read=_phi3,
        defaults=(("rms_norm_eps", 1e-5),),
    ),
    "olmo2": Family(
        "Olmo2ForCausalLM",
        options=_implied("olmo2"),
        fields=("attention_bias",),
        read=_attention_bias,
        write=_write_attention_bias,
        defaults=(("rms_norm_eps", 1e-5),),
    ),
}

#: ``model_type``s jmem does not load -> what to load instead.
NOT_LOADED: dict[str, str] = {
    "gemma3": (
        "gemma3 is the multimodal Gemma 3 (vision tower, language_model.* tensors): load a "
        "text-only gemma3_text checkpoint (Gemma 3 1B) instead"
    ),
}

#: ``LlamaConfig`` fields that select a family (each family sets some of them).
FAMILY_OPTIONS = (
    "norm_offset",
    "norm_placement",
    "qk_norm",
    "scale_embeddings",
    "fused_projections",
)


def _options(config: LlamaConfig) -> dict:
    return {k: getattr(config, k) for k in FAMILY_OPTIONS}


def family_of(config: LlamaConfig) -> str:
    """The ``model_type`` of the first transformers family that computes ``config``: its
    options are the config's and its ``rejects`` finds no reason against it.

    Raises:
      ValueError: no family has ``config``'s options, or each that has rejects it (for the
        Llama-shaped ones, its biases and window: Qwen2 q/k/v biases; Mistral a window, no
        biases; Llama all attention and/or all MLP biases, no window); the message says why.
    """
    default = _options(LlamaConfig(num_layers=1))
    opts = _options(config)
    candidates = {
        name: fam for name, fam in FAMILIES.items() if {**default, **dict(fam.options)} == opts
    }
    if not candidates:
        raise ValueError(
            f"The family options {opts} of {config} match no transformers family "
            f"({sorted(FAMILIES)}); the export could not be loaded."
        )
    reasons = {name: fam.rejects(config) for name, fam in candidates.items()}
    accepted = [name for name, reason in reasons.items() if reason is None]
    if accepted:
        return accepted[0]
    raise ValueError(
        f"biases={config.biases}, sliding_window={config.sliding_window} and the attention "
        f"types of {config} match no transformers family ({'; '.join(reasons.values())}); "
        "the export cannot be loaded."
    )


def _layer_norm_names(config: LlamaConfig) -> dict[str, str]:
    """jmem norm weight -> HF module of one layer (Gemma's ``post_attention_layernorm``
    is the attention output's norm; Llama's is the MLP's input norm)."""
    return {
        "attn_norm": "input_layernorm",
        "mlp_norm": (
            "post_attention_layernorm"
            if config.norm_placement == "pre"
            else "pre_feedforward_layernorm"
        ),
        "post_attn_norm": "post_attention_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
        "q_norm": "self_attn.q_norm",
        "k_norm": "self_attn.k_norm",
    }


def tensor_names(config: LlamaConfig) -> dict[str, tuple[str, bool]]:
    """``{jmem leaf path: (HF tensor name, transposed)}`` for every leaf of
    ``param_shapes(config)``; layer names hold ``{i}`` for the layer index, and kernels are
    transposed (jmem ``[in, out]``, HF ``[out, in]``)."""
    names = {
        "embed/embedding": ("model.embed_tokens.weight", False),
        "final_norm/scale": ("model.norm.weight", False),
    }
    if not config.tie_embeddings:
        names["lm_head/kernel"] = ("lm_head.weight", True)
    norms = _layer_norm_names(config)
    for name, leaves in param_shapes(config)["layers"].items():
        if name in norms:
            names[f"layers/{name}/scale"] = (f"model.layers.{{i}}.{norms[name]}.weight", False)
            continue
        group = "self_attn" if name in (*_ATTN_BIASES, "qkv_proj") else "mlp"
        for leaf in leaves:
            hf_leaf = "weight" if leaf == "kernel" else leaf
            names[f"layers/{name}/{leaf}"] = (
                f"model.layers.{{i}}.{group}.{name}.{hf_leaf}",
                leaf == "kernel",
            )
    return names


#: config.json fields that do not change the computation (token ids, init, bookkeeping).
IGNORED_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",  # remote-code class names (Phi-3); jmem runs its own decoder
        "bos_token_id",
        "cache_implementation",  # generation's KV cache kind (Gemma's "hybrid")
        "dtype",
        "eos_token_id",
        "initializer_range",
        "max_position_embeddings",
        "pad_token_id",
        "pretraining_tp",  # a tensor-parallel split of the same matmul
        "tokenizer_class",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)

#: config.json fields every family reads (implemented, or refused for values jmem does not
#: implement); each ``Family`` adds its own ``fields``.
HANDLED_FIELDS = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "attention_dropout",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "quantization_config",
    }
)
