"""The table of model families: each transformers ``model_type`` jmem loads is a ``Family``
entry, a set of ``LlamaConfig`` family options plus the ``config.json`` fields that set the
rest, and ``tensor_names`` maps every params leaf to its Hugging Face tensor name.

Every family rule is a field of its entry (the options it implies, from
``jmem._src.model_table.FAMILY_OPTIONS``; how it places windows; which configs it computes),
so a new Llama-like family is one ``Family`` entry here (see ``docs/families.md``); the
``config.json`` reader is ``read.py``, the writer ``write.py``. Sources: transformers'
``modeling_<family>.py`` and ``configuration_<family>.py`` (Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3, Phi-3, OLMo 2, Mixtral, Qwen3-MoE).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

from jmem._src import model_table
from jmem.models.llama import LlamaConfig
from jmem.models.llama import expert_size
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
    "USE_SLIDING_WINDOW",
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


def _write_use_sliding_window(config: LlamaConfig, types: list[str]) -> dict:
    """Qwen3-MoE: one window in every layer, switched by ``use_sliding_window``."""
    return {
        "sliding_window": config.sliding_window,
        "use_sliding_window": bool(types[0] != "full_attention"),
    }


def _int_field(c: dict, field: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        refuse(field, value, "a positive integer")
    return value


def _router_fields(c: dict, experts_field: str) -> dict:
    """The router's fields shared by Mixtral and Qwen3-MoE."""
    num = c.get(experts_field)
    if num is None and experts_field == "num_experts":
        num = c.get("num_local_experts")  # transformers 5 writes Qwen3-MoE's E under this name
    return {
        "num_experts": _int_field(c, experts_field, num),
        "num_experts_per_tok": _int_field(c, "num_experts_per_tok", c["num_experts_per_tok"]),
        "router_aux_loss_coef": float(c.get("router_aux_loss_coef") or 0.0),
    }


def _mixtral(c: dict) -> dict:
    """Mixtral: E = ``num_local_experts``, experts ``intermediate_size`` wide, the top-k
    weights always renormalised; no router jitter (a training-time noise jmem omits)."""
    if c.get("router_jitter_noise"):
        refuse("router_jitter_noise", c["router_jitter_noise"], "0.0 (jmem adds no router noise)")
    return {**_router_fields(c, "num_local_experts"), "norm_topk_prob": True}


def _write_mixtral(config: LlamaConfig) -> dict:
    c = config
    return {
        "num_local_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "router_aux_loss_coef": c.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
    }


def _qwen3_moe(c: dict) -> dict:
    """Qwen3-MoE: every layer sparse (``decoder_sparse_step`` 1, no ``mlp_only_layers``),
    experts ``moe_intermediate_size`` wide, ``norm_topk_prob``, attention biases."""
    if c.get("decoder_sparse_step", 1) != 1:
        refuse("decoder_sparse_step", c["decoder_sparse_step"], "1 (every layer's MLP routed)")
    if c.get("mlp_only_layers"):
        refuse("mlp_only_layers", c["mlp_only_layers"], "[] (every layer's MLP routed)")
    return {
        **_attention_bias(c),
        **_router_fields(c, "num_experts"),
        "moe_intermediate_size": _int_field(c, "moe_intermediate_size", c["moe_intermediate_size"]),
        "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
    }


def _write_qwen3_moe(config: LlamaConfig) -> dict:
    c = config
    return {
        **_write_attention_bias(c),
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": expert_size(c),
        "norm_topk_prob": c.norm_topk_prob,
        "router_aux_loss_coef": c.router_aux_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


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
#: Qwen3-MoE: ``use_sliding_window`` puts the window in every layer.
USE_SLIDING_WINDOW = Windows(_use_sliding_window, _all_sliding, _write_use_sliding_window)


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


def _mixtral_rejects(config: LlamaConfig) -> str | None:
    """Mixtral: no biases, renormalised top-k, experts ``intermediate_size`` wide."""
    if config.biases:
        return "Mixtral has no biases"
    if not config.norm_topk_prob:
        return "Mixtral always renormalises the top-k weights (norm_topk_prob=True)"
    if config.moe_intermediate_size is not None:
        return "Mixtral's experts are intermediate_size wide (leave moe_intermediate_size None)"
    return _llama_shaped(config, "Mixtral")


def _qwen3_moe_rejects(config: LlamaConfig) -> str | None:
    """Qwen3-MoE: ``moe_intermediate_size`` named, one window for every layer."""
    if config.moe_intermediate_size is None:
        return "Qwen3-MoE names its experts' width (set moe_intermediate_size)"
    if config.layer_types is not None:
        return "Qwen3-MoE has no per-layer attention types"
    return None


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
      experts: for a mixture-of-experts family, ``{jmem MOE_NAMES leaf: HF module}`` of a
        layer as pairs, ``{e}`` standing for the expert index (the router's module has
        none); empty for a dense family (``family_of`` matches it to ``num_experts``).
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
    experts: tuple[tuple[str, str], ...] = ()


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

_MOE_FIELDS = ("num_experts_per_tok", "router_aux_loss_coef", "output_router_logits")

FAMILIES["mixtral"] = Family(
    "MixtralForCausalLM",
    options=_implied("mixtral"),
    windows=EVERY_LAYER,
    fields=(*_MOE_FIELDS, "num_local_experts", "router_jitter_noise"),
    read=_mixtral,
    write=_write_mixtral,
    defaults=(
        ("rms_norm_eps", 1e-5),
        ("rope_theta", 1e6),
        ("num_local_experts", 8),
        ("num_experts_per_tok", 2),
        ("router_aux_loss_coef", 0.001),
    ),
    rejects=_mixtral_rejects,
    experts=(
        ("router", "block_sparse_moe.gate"),
        ("expert_gate", "block_sparse_moe.experts.{e}.w1"),
        ("expert_up", "block_sparse_moe.experts.{e}.w3"),
        ("expert_down", "block_sparse_moe.experts.{e}.w2"),
    ),
)
FAMILIES["qwen3_moe"] = Family(
    "Qwen3MoeForCausalLM",
    options=_implied("qwen3_moe"),
    windows=USE_SLIDING_WINDOW,
    fields=(
        *_MOE_FIELDS,
        "num_experts",
        "num_local_experts",  # transformers 5's spelling of num_experts
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "attention_bias",
    ),
    read=_qwen3_moe,
    write=_write_qwen3_moe,
    defaults=(
        ("sliding_window", 4096),
        ("num_experts_per_tok", 8),
        ("moe_intermediate_size", 768),
        ("router_aux_loss_coef", 0.001),
    ),
    rejects=_qwen3_moe_rejects,
    experts=(
        ("router", "mlp.gate"),
        ("expert_gate", "mlp.experts.{e}.gate_proj"),
        ("expert_up", "mlp.experts.{e}.up_proj"),
        ("expert_down", "mlp.experts.{e}.down_proj"),
    ),
)

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
    moe = config.num_experts > 0
    candidates = {
        name: fam
        for name, fam in FAMILIES.items()
        if {**default, **dict(fam.options)} == opts and bool(fam.experts) == moe
    }
    if not candidates:
        raise ValueError(
            f"The family options {opts} (num_experts={config.num_experts}) of {config} "
            "match no transformers family "
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
    ``param_shapes(config)``; layer names hold ``{i}`` for the layer index (and expert
    weights ``{e}`` for the expert's: one HF tensor per expert of each ``[L, E, in, out]``
    stack), and kernels are transposed (jmem ``[in, out]``, HF ``[out, in]``)."""
    names = {
        "embed/embedding": ("model.embed_tokens.weight", False),
        "final_norm/scale": ("model.norm.weight", False),
    }
    if not config.tie_embeddings:
        names["lm_head/kernel"] = ("lm_head.weight", True)
    norms = _layer_norm_names(config)
    experts = dict(FAMILIES[family_of(config)].experts) if config.num_experts else {}
    for name, leaves in param_shapes(config)["layers"].items():
        if name in experts:  # per expert ({e}) [out, in] weights, the router [E, H]
            names[f"layers/{name}/kernel"] = (f"model.layers.{{i}}.{experts[name]}.weight", True)
            continue
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
