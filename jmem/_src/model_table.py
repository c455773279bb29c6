"""The one table of model knowledge, as plain data: the layer's linear names, the decoder
options each family implies, and every preset's shape and family fields.

``jmem.models.llama`` builds its ``CONFIGS`` (``LlamaConfig``) from ``PRESETS``,
``jmem.models.families`` its ``Family.options`` from ``FAMILY_OPTIONS`` and the planner its
``MODEL_SHAPES`` (``ModelShape``) from ``PRESETS``: a leaf, so the planner imports no model
code. Shapes are from each model's ``config.json`` on the Hugging Face Hub
(``tests/test_families.py`` loads those files into the presets).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EXPERT_LINEAR_NAMES",
    "FAMILY_OPTIONS",
    "FUSED_LINEAR_NAMES",
    "LINEAR_NAMES",
    "PRESETS",
    "ROUTER_NAMES",
    "periodic_layer_types",
    "preset_fields",
]

#: The weight names of one layer that are matmul kernels ``[in, out]``.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: The kernels of a ``fused_projections`` layer (Phi-3): q/k/v and gate/up in one each.
FUSED_LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

#: A mixture-of-experts layer's expert kernels, stacked over experts ``[E, in, out]`` (and
#: over layers in params: ``[L, E, in, out]``), multiplied by ``jax.lax.ragged_dot``.
EXPERT_LINEAR_NAMES = ("expert_gate", "expert_up", "expert_down")

#: A mixture-of-experts layer's router ``[d_model, E]``: never quantized nor adapted.
ROUTER_NAMES = ("router",)

_GEMMA = {"norm_offset": 1.0, "norm_placement": "sandwich", "scale_embeddings": True}

#: Hugging Face ``model_type`` -> the ``LlamaConfig`` family options it implies (the
#: defaults, Llama's, are left out).
FAMILY_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"qk_norm": "head"},
    "gemma2": dict(_GEMMA),
    "gemma3_text": {**_GEMMA, "qk_norm": "head"},
    "phi3": {"fused_projections": True},
    "olmo2": {"qk_norm": "proj", "norm_placement": "post"},
    "mixtral": {},
    "qwen3_moe": {"qk_norm": "head"},
}


def periodic_layer_types(n: int, period: int) -> tuple[str, ...]:
    """Gemma's layer types: every ``period``-th layer ``"full_attention"``, the others
    ``"sliding_attention"`` (Gemma 2: ``period=2``; Gemma 3: ``sliding_window_pattern``, 6)."""
    return tuple("sliding_attention" if (i + 1) % period else "full_attention" for i in range(n))


def _gemma(n_layers: int, period: int, **fields) -> dict[str, Any]:
    """A Gemma 2 (``period=2``) or Gemma 3 (``period=6``: QK-norm, local RoPE base 10k)
    preset: the fields every published checkpoint of the family shares, plus ``fields``."""
    gemma3 = period == 6
    return {
        "family": "gemma3_text" if gemma3 else "gemma2",
        "num_layers": n_layers,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "tie_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_types": periodic_layer_types(n_layers, period),
        "attn_scale": 256**-0.5,
        "rope_theta": 1e6 if gemma3 else 10000.0,
        "local_rope_theta": 1e4 if gemma3 else None,
        "attn_logit_softcap": None if gemma3 else 50.0,
        "final_logit_softcap": None if gemma3 else 30.0,
        **fields,
    }


def _shape(V: int, H: int, F: int, L: int, nH: int, nKV: int, **fields) -> dict[str, Any]:
    """A preset's shape (vocabulary, hidden, MLP width, layers, heads, KV heads) and fields."""
    shape = dict(
        vocab_size=V, hidden_size=H, intermediate_size=F, num_layers=L, num_heads=nH,
        num_kv_heads=nKV,
    )  # fmt: skip
    return {"family": "llama", **shape, **fields}


_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0)
_LLAMA3_ROPE.update(original_max_position_embeddings=8192)
_GEMMA3_LONG = dict(
    max_seq_len=131072, rope_scaling={"rope_type": "linear", "factor": 8.0}, vocab_size=262208
)

#: Preset name -> ``family`` (a ``FAMILY_OPTIONS`` key) and the ``LlamaConfig`` fields that
#: are not defaults; ``rope_scaling`` is a dict of ``RopeScaling`` fields.
PRESETS: dict[str, dict[str, Any]] = {
    # A few million parameters: trains on a CPU in minutes (byte-level vocabulary).
    "tiny": _shape(256, 256, 688, 4, 8, 4, max_seq_len=512),
    # About 1.1B parameters (TinyLlama-1.1B shapes).
    "llama_1b": _shape(32000, 2048, 5632, 22, 32, 4, max_seq_len=2048),
    "llama2_7b": _shape(32000, 4096, 11008, 32, 32, 32, max_seq_len=4096),
    "llama3_8b": _shape(128256, 4096, 14336, 32, 32, 8, rope_theta=500000.0, max_seq_len=8192),
    # Llama 3.1 8B: Llama 3 shapes, llama3 RoPE scaling to 128K context.
    "llama3_1_8b": _shape(
        128256,
        4096,
        14336,
        32,
        32,
        8,
        rope_theta=500000.0,
        max_seq_len=131072,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
    ),
    # Llama 3.1 70B (meta-llama/Llama-3.1-70B config.json): 80 layers, 8 KV heads.
    "llama3_1_70b": _shape(
        128256,
        8192,
        28672,
        80,
        64,
        8,
        rope_theta=500000.0,
        max_seq_len=131072,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
    ),
    # Llama 3.2 1B: tied embeddings, llama3 RoPE scaling with factor 32.
    "llama3_2_1b": _shape(
        128256,
        2048,
        8192,
        16,
        32,
        8,
        rope_theta=500000.0,
        tie_embeddings=True,
        max_seq_len=131072,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
    ),
    # Mistral 7B v0.1: sliding-window attention (4096 tokens) in every layer.
    "mistral_7b": _shape(
        32000,
        4096,
        14336,
        32,
        32,
        8,
        rope_theta=10000.0,
        max_seq_len=32768,
        sliding_window=4096,
        family="mistral",
    ),
    # Qwen2.5 7B: biases on q/k/v, 28 heads of 128, untied 152K vocabulary.
    "qwen2_5_7b": _shape(
        152064,
        3584,
        18944,
        28,
        28,
        4,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_seq_len=32768,
        biases=("q_proj", "k_proj", "v_proj"),
        family="qwen2",
    ),
    # Qwen2.5 72B (Qwen/Qwen2.5-72B config.json): q/k/v biases, untied head.
    "qwen2_5_72b": _shape(
        152064,
        8192,
        29568,
        80,
        64,
        8,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_seq_len=32768,
        biases=("q_proj", "k_proj", "v_proj"),
        family="qwen2",
    ),
    # Gemma 2 2B / 9B: alternating 4096-token sliding and global layers, soft-caps.
    "gemma2_2b": _gemma(
        26,
        2,
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_heads=8,
        num_kv_heads=4,
        max_seq_len=8192,
        sliding_window=4096,
    ),
    "gemma2_9b": _gemma(
        42,
        2,
        vocab_size=256000,
        hidden_size=3584,
        intermediate_size=14336,
        num_heads=16,
        num_kv_heads=8,
        max_seq_len=8192,
        sliding_window=4096,
    ),
    # Gemma 3 1B (text only), 4B and 12B (their language models): 5 local layers per
    # global one, QK-norm; 4B/12B scale the global RoPE linearly by 8.
    "gemma3_1b": _gemma(
        26,
        6,
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_heads=4,
        num_kv_heads=1,
        max_seq_len=32768,
        sliding_window=512,
    ),
    "gemma3_4b": _gemma(
        34,
        6,
        hidden_size=2560,
        intermediate_size=10240,
        num_heads=8,
        num_kv_heads=4,
        sliding_window=1024,
        **_GEMMA3_LONG,
    ),
    "gemma3_12b": _gemma(
        48,
        6,
        hidden_size=3840,
        intermediate_size=15360,
        num_heads=16,
        num_kv_heads=8,
        sliding_window=1024,
        **_GEMMA3_LONG,
    ),
    # Qwen3 0.6B / 8B: QK-norm per head, head_dim 128 != hidden / heads on 0.6B.
    "qwen3_0_6b": _shape(
        151936,
        1024,
        3072,
        28,
        16,
        8,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_embeddings=True,
        max_seq_len=40960,
        family="qwen3",
    ),
    "qwen3_8b": _shape(
        151936,
        4096,
        12288,
        36,
        32,
        8,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_seq_len=40960,
        family="qwen3",
    ),
    # Phi-3 mini 4K: fused qkv_proj / gate_up_proj, a 2047-token window in every layer.
    "phi3_mini": _shape(
        32064, 3072, 8192, 32, 32, 32, max_seq_len=4096, sliding_window=2047, family="phi3"
    ),
    # A CPU-sized Mixtral-style mixture of experts: 8 experts of 128, 2 per token.
    "tiny_moe": _shape(
        256,
        64,
        128,
        2,
        4,
        2,
        max_seq_len=512,
        num_experts=8,
        num_experts_per_tok=2,
        family="mixtral",
    ),
    # Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 8 experts of 14336, 2 per token.
    "mixtral_8x7b": _shape(
        32000,
        4096,
        14336,
        32,
        32,
        8,
        rope_theta=1e6,
        max_seq_len=32768,
        num_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        family="mixtral",
    ),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 128 experts of 768, 8 per token,
    # renormalised; QK-norm per head of 128.
    "qwen3_30b_a3b": _shape(
        151936,
        2048,
        6144,
        48,
        32,
        4,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_seq_len=40960,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        family="qwen3_moe",
    ),
    # OLMo 2 7B (1124): norms after each sublayer only, QK-norm over the projections.
    "olmo2_7b": _shape(
        100352,
        4096,
        11008,
        32,
        32,
        32,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
        max_seq_len=4096,
        family="olmo2",
    ),
}


def preset_fields(name: str) -> dict[str, Any]:
    """The ``LlamaConfig`` keyword arguments of preset ``name``: its family's options and
    its own fields (``rope_scaling`` still a dict). Raises KeyError for an unknown name."""
    fields = dict(PRESETS[name])
    return {**FAMILY_OPTIONS[fields.pop("family")], **fields}
