"""Reference Llama-family decoder as pure functions of a params pytree.

RMSNorm, rotary position embeddings (``rope_theta``, optional Llama 3.1 / linear
scaling), grouped-query attention (optional sliding window, packed rows via
``segment_ids``) and a gated MLP (SwiGLU by default), with optional projection biases, as
in Touvron et al. 2023 ("Llama 2") and Hugging Face's ``LlamaForCausalLM``. Named family
options (per-layer attention types and RoPE bases, norm form and placement, QK-norm,
attention scale and soft-caps, embedding scale, fused projections) make it Mistral, Qwen2/3,
Gemma 2/3, Phi-3 and OLMo 2 too, whose checkpoints load into it (``jmem.models.hf``; the
mapping is ``jmem.models.families``). ``generate`` decodes with a KV cache.

Why pure functions instead of Flax modules: every jmem transform (remat over scans,
NF4 leaves, LoRA adapters, FP8 scaling state, sharding rules) acts on a params pytree
and on the traced computation. A plain ``forward(params, tokens, config)`` keeps the
pytree the single source of truth, with no module state to split and merge.

Layer params are stacked on a leading ``num_layers`` axis and iterated with
``lax.scan``, so compile time does not grow with depth and ``jmem.remat`` can
checkpoint each layer. Intermediates carry ``checkpoint_name`` tags (see
``CHECKPOINT_NAMES``) for name-based remat policies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jmem._src import fp8 as fp8_lib
from jmem._src import levers as levers_lib
from jmem._src.attention import attention
from jmem._src.attention import attention_mask
from jmem._src.linear_cross_entropy import linear_cross_entropy
from jmem._src.linear_cross_entropy import token_nll
from jmem._src.token_chunks import over_tokens

Params = dict[str, Any]

#: Names given with ``checkpoint_name`` inside each layer, in execution order.
__all__ = [
    "CHECKPOINT_NAMES",
    "CONFIGS",
    "ACTIVATIONS",
    "FUSED_LINEAR_NAMES",
    "LAYER_TYPES",
    "LINEAR_NAMES",
    "NORM_PLACEMENTS",
    "LlamaConfig",
    "RopeScaling",
    "abstract_params",
    "apply_rope",
    "attention",
    "attention_mask",
    "cross_entropy",
    "decoder_layer",
    "forward",
    "generate",
    "get_config",
    "init",
    "linear_names",
    "loss_fn",
    "num_params",
    "param_shapes",
    "rms_norm",
    "rope_frequencies",
    "rope_tables",
]

CHECKPOINT_NAMES = (
    "layer_input",
    "attn_norm",
    "query_proj",
    "key_proj",
    "value_proj",
    "q_norm",
    "k_norm",
    "attn_context",
    "attn_out",
    "post_attn_norm",
    "mlp_norm",
    "mlp_gate",
    "mlp_up",
    "mlp_hidden",
    "mlp_down",
    "post_mlp_norm",
)

#: The weight names of one layer that are matmul kernels ``[in, out]``.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: The kernels of a ``fused_projections`` layer (Phi-3): q/k/v and gate/up in one each.
FUSED_LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

#: ``LlamaConfig.layer_types`` values.
LAYER_TYPES = ("full_attention", "sliding_attention")

#: ``LlamaConfig.norm_placement`` values.
NORM_PLACEMENTS = ("pre", "sandwich", "post")


def linear_names(config) -> tuple[str, ...]:
    """The kernel names of one layer of ``config``: ``LINEAR_NAMES``, or
    ``FUSED_LINEAR_NAMES`` with ``fused_projections``."""
    return FUSED_LINEAR_NAMES if config.fused_projections else LINEAR_NAMES


#: ``LlamaConfig.hidden_act`` values and their functions (names as Hugging Face's ``ACT2FN``).
ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for long context (hashable: part of a static config).

    Attributes:
      rope_type: ``"linear"`` (position interpolation, Chen et al. 2023: every frequency
        divided by ``factor``) or ``"llama3"`` (Llama 3.1: low frequencies divided by
        ``factor``, high ones kept, a smooth ramp between; as Meta's reference and
        transformers' ``_compute_llama3_parameters``).
      factor: the scaling factor (> 0).
      low_freq_factor, high_freq_factor, original_max_position_embeddings: ``llama3`` only;
        wavelengths above ``original / low_freq_factor`` are scaled, below
        ``original / high_freq_factor`` kept.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(
                f"RopeScaling.rope_type={self.rope_type!r} is not implemented; "
                "jmem implements 'linear' and 'llama3'."
            )
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0; got {self.factor}.")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 RoPE needs high_freq_factor > low_freq_factor; got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}."
            )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family model.

    Attributes:
      vocab_size: tokens in the vocabulary (V).
      hidden_size: model width (H).
      intermediate_size: SwiGLU MLP width (F).
      num_layers: decoder layers (L).
      num_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention when < num_heads).
      head_dim: per-head width; defaults to hidden_size // num_heads.
      rope_theta: RoPE base frequency.
      rms_norm_eps: epsilon inside RMSNorm.
      tie_embeddings: reuse the embedding matrix as the output head.
      max_seq_len: longest sequence the config is meant for (informational).
      rope_scaling: None (plain RoPE) or a ``RopeScaling`` (Llama 3.1+, linear).
      sliding_window: None, or W: each token attends itself and the W - 1 before it, in
        every layer (Mistral 7B v0.1).
      biases: names (from ``LINEAR_NAMES``) of the projections with an additive bias
        ``layers[name]["bias"] [L, out]``: Qwen2 has ``("q_proj", "k_proj", "v_proj")``.
      hidden_act: the MLP's gate activation, a key of ``ACTIVATIONS`` (SwiGLU: ``silu``;
        GeGLU: ``gelu_pytorch_tanh``, Gemma).

    How the model is run (attention implementation, loss and token chunks, the layer
    loop's unroll, remat, FP8) is not part of its identity: pass a ``jmem.Levers`` to
    ``forward``/``loss_fn`` (``levers=``), resolved by ``jmem.resolve_levers``.

    Family options (Gemma 2/3, Qwen3, Phi-3, OLMo 2 are these settings, see
    ``docs/families.md``; the defaults are Llama):
      layer_types: None (every layer as ``sliding_window`` says) or one of ``LAYER_TYPES``
        per layer: ``"sliding_attention"`` layers use ``sliding_window``,
        ``"full_attention"`` layers attend the whole prefix (Gemma 2 alternates, Gemma 3
        has five local layers per global one).
      local_rope_theta: RoPE base of the sliding layers, which take no ``rope_scaling``
        (Gemma 3: 10k locally, ``rope_theta`` 1M with linear scaling globally); None:
        every layer uses ``rope_theta``/``rope_scaling``.
      norm_offset: RMSNorm multiplies by ``norm_offset + scale`` (Gemma: 1.0, weights
        stored around 0).
      norm_placement: ``"pre"`` (Llama: norm before attention and MLP), ``"sandwich"``
        (Gemma 2/3: also a norm on each sublayer's output before the residual add:
        ``post_attn_norm``, ``post_mlp_norm``), or ``"post"`` (OLMo 2: only the output
        norms, no ``attn_norm``/``mlp_norm``).
      qk_norm: None, ``"head"`` (RMSNorm over each head of q and k before RoPE, weights
        ``q_norm``/``k_norm`` ``[L, D]``: Qwen3, Gemma 3) or ``"proj"`` (over the whole q
        and k projections, ``[L, nH*D]``/``[L, nKV*D]``: OLMo 2).
      attn_scale: attention scores' scale; None is ``1/sqrt(head_dim)`` (Gemma:
        ``query_pre_attn_scalar ** -0.5``).
      attn_logit_softcap: None or c: scores become ``c * tanh(scores / c)`` before
        masking (Gemma 2: 50).
      final_logit_softcap: None or c: logits become ``c * tanh(logits / c)`` (Gemma 2: 30).
      scale_embeddings: multiply the embeddings by ``sqrt(hidden_size)`` (in the
        activation dtype; Gemma).
      fused_projections: q/k/v in one kernel ``qkv_proj [L, H, (nH + 2 nKV) D]`` and gate/up
        in one ``gate_up_proj [L, H, 2F]`` (Phi-3; LoRA adapts each fused kernel as one
        module, as PEFT does).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    biases: tuple[str, ...] = ()
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    norm_offset: float = 0.0
    norm_placement: str = "pre"
    qk_norm: str | None = None
    attn_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    scale_embeddings: bool = False
    fused_projections: bool = False

    def __post_init__(self):
        object.__setattr__(self, "biases", tuple(self.biases))
        names = linear_names(self)
        unknown = sorted(set(self.biases) - set(names))
        if unknown:
            raise ValueError(f"biases {unknown} are not projections; choose from {names}.")
        _check_family_options(self)
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not implemented; choose from "
                f"{sorted(ACTIVATIONS)}."
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1; got {self.sliding_window}.")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads="
                    f"{self.num_heads}; pass head_dim explicitly."
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} for grouped-query attention."
            )


def _check_family_options(c: LlamaConfig) -> None:
    """ValueError naming a family option whose value the decoder does not implement."""
    if c.norm_placement not in NORM_PLACEMENTS:
        raise ValueError(f"norm_placement={c.norm_placement!r}; choose from {NORM_PLACEMENTS}.")
    if c.qk_norm not in (None, "head", "proj"):
        raise ValueError(f"qk_norm={c.qk_norm!r}; choose None, 'head' or 'proj'.")
    for name in ("attn_scale", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta"):
        value = getattr(c, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be None or > 0; got {value}.")
    if c.layer_types is None:
        return
    object.__setattr__(c, "layer_types", tuple(c.layer_types))
    bad = sorted(set(c.layer_types) - set(LAYER_TYPES))
    if bad or len(c.layer_types) != c.num_layers:
        raise ValueError(
            f"layer_types must hold num_layers={c.num_layers} entries from {LAYER_TYPES}; "
            f"got {len(c.layer_types)} entries{f', unknown {bad}' if bad else ''}."
        )
    if "sliding_attention" in c.layer_types and c.sliding_window is None:
        raise ValueError("layer_types has sliding_attention layers: set sliding_window too.")


CONFIGS: dict[str, LlamaConfig] = {
    # A few million parameters: trains on a CPU in minutes (byte-level vocabulary).
    "tiny": LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_seq_len=512,
    ),
    # About 1.1B parameters (TinyLlama-1.1B shapes).
    "llama_1b": LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        max_seq_len=2048,
    ),
    "llama2_7b": LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        max_seq_len=4096,
    ),
    "llama3_8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # Llama 3.1 8B: Llama 3 shapes, llama3 RoPE scaling to 128K context.
    "llama3_1_8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=500000.0,
        max_seq_len=131072,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
    ),
    # Llama 3.2 1B: tied embeddings, llama3 RoPE scaling with factor 32.
    "llama3_2_1b": LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=500000.0,
        tie_embeddings=True,
        max_seq_len=131072,
        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
    ),
    # Mistral 7B v0.1: sliding-window attention (4096 tokens) in every layer.
    "mistral_7b": LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=10000.0,
        max_seq_len=32768,
        sliding_window=4096,
    ),
    # Qwen2.5 7B: biases on q/k/v, 28 heads of 128, untied 152K vocabulary.
    "qwen2_5_7b": LlamaConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_seq_len=32768,
        biases=("q_proj", "k_proj", "v_proj"),
    ),
}


def _alternating(n: int, period: int) -> tuple[str, ...]:
    """Gemma's layer types: every ``period``-th layer global, the others sliding."""
    return tuple("sliding_attention" if (i + 1) % period else "full_attention" for i in range(n))


def _gemma(n_layers: int, period: int, **kwargs) -> LlamaConfig:
    """A Gemma 2 (``period=2``) or Gemma 3 (``period=6``, QK-norm, local RoPE base 10k)
    preset with the family's fixed options."""
    gemma3 = period == 6
    return LlamaConfig(
        num_layers=n_layers,
        head_dim=256,
        rms_norm_eps=1e-6,
        tie_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        layer_types=_alternating(n_layers, period),
        norm_offset=1.0,
        norm_placement="sandwich",
        scale_embeddings=True,
        attn_scale=256**-0.5,
        qk_norm="head" if gemma3 else None,
        rope_theta=1e6 if gemma3 else 10000.0,
        local_rope_theta=1e4 if gemma3 else None,
        attn_logit_softcap=None if gemma3 else 50.0,
        final_logit_softcap=None if gemma3 else 30.0,
        **kwargs,
    )


_GEMMA3_LONG = dict(max_seq_len=131072, rope_scaling=RopeScaling("linear", 8.0), vocab_size=262208)

# Published families (shapes from each model's config.json on the Hugging Face Hub;
# tests/test_families.py loads those config.json files into these presets).
CONFIGS.update(
    {
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
        "qwen3_0_6b": LlamaConfig(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_embeddings=True,
            max_seq_len=40960,
            qk_norm="head",
        ),
        "qwen3_8b": LlamaConfig(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            max_seq_len=40960,
            qk_norm="head",
        ),
        # Phi-3 mini 4K: fused qkv_proj / gate_up_proj, a 2047-token window in every layer.
        "phi3_mini": LlamaConfig(
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_layers=32,
            num_heads=32,
            num_kv_heads=32,
            max_seq_len=4096,
            sliding_window=2047,
            fused_projections=True,
        ),
        # OLMo 2 7B (1124): norms after each sublayer only, QK-norm over the projections.
        "olmo2_7b": LlamaConfig(
            vocab_size=100352,
            hidden_size=4096,
            intermediate_size=11008,
            num_layers=32,
            num_heads=32,
            num_kv_heads=32,
            rope_theta=500000.0,
            rms_norm_eps=1e-6,
            max_seq_len=4096,
            qk_norm="proj",
            norm_placement="post",
        ),
    }
)


#: Former ``LlamaConfig`` fields that are now ``jmem.Levers`` fields (old name -> new).
EXECUTION_FIELDS = {
    "attention": "attention",
    "loss_chunk": "loss_chunk",
    "mlp_chunk": "token_chunk",
    "scan_unroll": "scan_unroll",
}


def get_config(name: str | LlamaConfig, **overrides) -> LlamaConfig:
    """Returns a named config from ``CONFIGS`` (``tiny``, ``llama2_7b``, ``llama3_2_1b``,
    ``mistral_7b``, ``qwen2_5_7b``, ...), with ``overrides`` replaced.

    Raises:
      ValueError: for an unknown name (the message lists the known ones), or an execution
        setting among ``overrides`` (``attention``, ``loss_chunk``, ``mlp_chunk``,
        ``scan_unroll``: they are ``jmem.Levers``, not the model's identity).
    """
    moved = sorted(set(overrides) & set(EXECUTION_FIELDS))
    if moved:
        raise ValueError(
            f"{moved} are execution settings, not the model's identity: pass "
            f"levers=jmem.Levers({', '.join(EXECUTION_FIELDS[m] + '=...' for m in moved)}) "
            "to forward/loss_fn (or jmem.train_step) instead."
        )
    if isinstance(name, LlamaConfig):
        cfg = name
    else:
        try:
            cfg = CONFIGS[name]
        except KeyError:
            raise ValueError(
                f"Unknown model config {name!r}; choose one of {sorted(CONFIGS)}."
            ) from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _layer_shapes(c: LlamaConfig) -> Params:
    """Shapes of one layer's weights (without the leading ``L``)."""
    H, F, D = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * D, c.num_kv_heads * D
    if c.fused_projections:
        shapes = {
            "qkv_proj": {"kernel": (H, q + 2 * kv)},
            "o_proj": {"kernel": (q, H)},
            "gate_up_proj": {"kernel": (H, 2 * F)},
            "down_proj": {"kernel": (F, H)},
        }
    else:
        shapes = {
            "q_proj": {"kernel": (H, q)},
            "k_proj": {"kernel": (H, kv)},
            "v_proj": {"kernel": (H, kv)},
            "o_proj": {"kernel": (q, H)},
            "gate_proj": {"kernel": (H, F)},
            "up_proj": {"kernel": (H, F)},
            "down_proj": {"kernel": (F, H)},
        }
    norms = {}
    if c.norm_placement != "post":
        norms.update(attn_norm=(H,), mlp_norm=(H,))
    if c.norm_placement != "pre":
        norms.update(post_attn_norm=(H,), post_mlp_norm=(H,))
    if c.qk_norm == "head":
        norms.update(q_norm=(D,), k_norm=(D,))
    elif c.qk_norm == "proj":
        norms.update(q_norm=(q,), k_norm=(kv,))
    shapes.update({name: {"scale": shape} for name, shape in norms.items()})
    for name in c.biases:
        shapes[name]["bias"] = shapes[name]["kernel"][-1:]
    return shapes


def param_shapes(config: LlamaConfig) -> Params:
    """Shapes of every parameter, as a pytree of tuples (same structure as ``init``).

    Layer weights carry a leading ``num_layers`` axis; which ones exist follows the
    config's family options (``norm_placement``, ``qk_norm``, ``fused_projections``,
    ``biases``, ``tie_embeddings``)."""
    c = config
    layer = jax.tree.map(lambda s: (c.num_layers, *s), _layer_shapes(c), is_leaf=_is_shape)
    shapes: Params = {
        "embed": {"embedding": (c.vocab_size, c.hidden_size)},
        "layers": layer,
        "final_norm": {"scale": (c.hidden_size,)},
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = {"kernel": (c.hidden_size, c.vocab_size)}
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def num_params(config: LlamaConfig) -> int:
    """Number of parameters (elements) of the model."""
    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(config), is_leaf=_is_shape))


def abstract_params(config: LlamaConfig, dtype=jnp.float32) -> Params:
    """``jax.ShapeDtypeStruct`` leaves: measure or plan a model without allocating it."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(config), is_leaf=_is_shape
    )


def init(key: jax.Array, config: LlamaConfig, dtype=jnp.float32) -> Params:
    """Random parameters: normal(0, 0.02) weights (as HF's ``initializer_range``), unit
    norms (weights ``1 - norm_offset``), zero biases.

    Returns:
      The params pytree described in the module docstring, every leaf of ``dtype``.
    """
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]
    ]
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, shape, path in zip(keys, leaves, paths):
        if "norm" in path:  # the scale that multiplies is norm_offset + weight
            out.append(jnp.full(shape, 1.0 - config.norm_offset, dtype))
        elif "bias" in path:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


@jax.named_scope("rms_norm")
def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis, multiplied by ``offset + scale``
    (Gemma's ``(1 + w)`` with ``offset=1``), computed in float32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (offset + scale.astype(jnp.float32))).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """Inverse frequencies ``[head_dim // 2]`` float32 of RoPE, scaled per ``scaling``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(positions, head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """cos/sin tables (float32) for rotary embeddings (Su et al. 2021, "RoFormer").

    Args:
      positions: an ``int`` sequence length (positions ``0..n-1``) or an integer array of
        positions, ``[S]`` or ``[B, S]`` (e.g. reset to 0 at each packed example).
      head_dim: per-head width D (even).
      theta: RoPE base frequency.
      scaling: optional ``RopeScaling`` (``config.rope_scaling``).

    Returns:
      ``(cos, sin)``, each ``positions.shape + (D // 2,)`` float32.
    """
    if isinstance(positions, int):
        positions = jnp.arange(positions)
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


@jax.named_scope("rope")
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x [B, S, heads, D]`` by position, half-split layout as in HF Llama.
    ``cos``/``sin``: ``[S, D // 2]`` or ``[B, S, D // 2]`` from ``rope_tables``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _dense(x: jax.Array, kernel: jax.Array, meta=None) -> jax.Array:
    """``x @ kernel`` in the activation dtype (the kernel is cast to it if needed); an FP8
    delayed-scaling matmul (``jmem.fp8.fp8_dot``) when an ``Fp8Meta`` ``meta`` is given."""
    if meta is not None:
        return fp8_lib.fp8_dot(x, kernel.astype(x.dtype), meta)
    return jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype))


def _meta(fp8: Params | None, name: str):
    """This layer's ``Fp8Meta`` for projection ``name``, or None (no FP8)."""
    return None if fp8 is None or fp8.get(name) is None else fp8[name]["kernel"]


def _proj(h: jax.Array, layer: Params, name: str, fp8: Params | None) -> jax.Array:
    """Projection ``name`` of ``h``: ``h @ kernel`` (+ ``bias`` when the params have one)."""
    y = _dense(h, layer[name]["kernel"], _meta(fp8, name))
    bias = layer[name].get("bias")
    return y if bias is None else y + bias.astype(y.dtype)


def _norm(x, layer: Params, name: str, config: LlamaConfig) -> jax.Array:
    """RMSNorm of ``x`` with layer weight ``name``, tagged ``name`` for remat policies."""
    y = rms_norm(x, layer[name]["scale"], config.rms_norm_eps, config.norm_offset)
    return checkpoint_name(y, name)


def _qkv(h, layer, config: LlamaConfig, fp8):
    """Query, key and value projections ``[B, S, heads, D]`` before RoPE (QK-norm applied)."""
    c = config
    b, s, _ = h.shape
    if c.fused_projections:  # Phi-3: [q | k | v] along the output axis
        qkv = _proj(h, layer, "qkv_proj", fp8)
        q_end, k_end = c.num_heads * c.head_dim, (c.num_heads + c.num_kv_heads) * c.head_dim
        q, k, v = qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    else:
        q, k, v = (_proj(h, layer, n, fp8) for n in ("q_proj", "k_proj", "v_proj"))
    q, k, v = (checkpoint_name(t, n) for t, n in zip((q, k, v), _QKV_TAGS))
    if c.qk_norm == "proj":  # OLMo 2: over the whole projection
        q, k = _norm(q, layer, "q_norm", c), _norm(k, layer, "k_norm", c)
    q = q.reshape(b, s, c.num_heads, c.head_dim)
    k = k.reshape(b, s, c.num_kv_heads, c.head_dim)
    if c.qk_norm == "head":  # Qwen3, Gemma 3: over each head
        q, k = _norm(q, layer, "q_norm", c), _norm(k, layer, "k_norm", c)
    return q, k, v.reshape(b, s, c.num_kv_heads, c.head_dim)


_QKV_TAGS = ("query_proj", "key_proj", "value_proj")


def _mlp(h, layer, config: LlamaConfig, fp8) -> jax.Array:
    """Gated MLP ``down(act(gate(h)) * up(h))``; Phi-3's fused ``gate_up_proj`` is
    ``[gate | up]``."""
    if config.fused_projections:
        gate_up = _proj(h, layer, "gate_up_proj", fp8)
        gate, up = jnp.split(gate_up, 2, axis=-1)
    else:
        gate, up = _proj(h, layer, "gate_proj", fp8), _proj(h, layer, "up_proj", fp8)
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    hidden = checkpoint_name(ACTIVATIONS[config.hidden_act](gate) * up, "mlp_hidden")
    return checkpoint_name(_proj(hidden, layer, "down_proj", fp8), "mlp_down")


def _normed(x, layer, config: LlamaConfig, pre: str, post: str, fn):
    """``post_norm(fn(pre_norm(x)))`` with the norms ``norm_placement`` asks for; ``fn``
    returns ``(out, extra)``."""
    h = x if config.norm_placement == "post" else _norm(x, layer, pre, config)
    out, extra = fn(h)
    if config.norm_placement != "pre":
        out = _norm(out, layer, post, config)
    return out, extra


def _mlp_block(x, layer, config: LlamaConfig, fp8) -> jax.Array:
    """The MLP sublayer without its residual: norms (``norm_placement``) around ``_mlp``."""
    mlp = lambda h: (_mlp(h, layer, config, fp8), None)
    return _normed(x, layer, config, "mlp_norm", "post_mlp_norm", mlp)[0]


def _attend(q, k, v, config: LlamaConfig, attn: dict, lv) -> jax.Array:
    """``attention`` with the config's scale and soft-cap and the resolved levers'
    implementation (``lv.attention``); ``attn`` holds
    the index arguments (``q_index``, optional ``kv_index``, ``segment_ids``) and this
    layer's ``sliding_window`` (default: the config's, for every layer)."""
    attn = {"sliding_window": _uniform_window(config), **attn}
    return attention(
        q,
        k,
        v,
        **attn,
        scale=config.attn_scale,
        logit_softcap=config.attn_logit_softcap,
        implementation=lv.attention,
    )


def _layer(x, layer, config, rope, attn, fp8=None, cache=None, index=None, lv=None):
    """``decoder_layer`` that also writes this call's keys/values into ``cache`` (a pair
    ``[B, T, nKV, D]``) at row index ``index`` and attends over the whole cache.

    The token-local parts (norms, projections, RoPE, the MLP) run over chunks of
    ``lv.token_chunk`` tokens (``_over_tokens``); only attention sees every token. ``lv``:
    the ``ResolvedLevers`` (None: decoding, ``_DECODE``)."""
    c = config
    lv = _DECODE if lv is None else lv
    b, s, _ = x.shape
    cos, sin = (jnp.broadcast_to(t, (b, s, t.shape[-1])) for t in rope)
    q, k, v = _over_tokens(
        functools.partial(_attn_in, layer=layer, config=c, fp8=fp8), lv, fp8, x, cos, sin
    )
    kv = cache
    if kv is not None:
        kv = tuple(
            jax.lax.dynamic_update_slice_in_dim(full, new.astype(full.dtype), index, axis=1)
            for full, new in zip(kv, (k, v))
        )
        k, v = kv
    ctx = checkpoint_name(_attend(q, k, v, c, attn, lv).reshape(b, s, -1), "attn_context")
    out = _over_tokens(
        functools.partial(_attn_out_mlp, layer=layer, config=c, fp8=fp8), lv, fp8, x, ctx
    )
    return out[0], kv


def _attn_in(x, cos, sin, *, layer, config, fp8):
    """The attention sublayer's token-local input half: pre-norm, q/k/v projections
    (QK-norm) and RoPE; ``[B, S, H]`` -> q ``[B, S, nH, D]``, k/v ``[B, S, nKV, D]``."""
    h = x if config.norm_placement == "post" else _norm(x, layer, "attn_norm", config)
    q, k, v = _qkv(h, layer, config, fp8)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _attn_out_mlp(x, ctx, *, layer, config, fp8):
    """The rest of the layer, token-local: ``x + post_norm(o_proj(ctx))``, then the MLP
    sublayer with its residual; ``x [B, S, H]``, ``ctx [B, S, nH * D]``."""
    out = checkpoint_name(_proj(ctx, layer, "o_proj", fp8), "attn_out")
    if config.norm_placement != "pre":
        out = _norm(out, layer, "post_attn_norm", config)
    x = x + out
    return (x + _mlp_block(x, layer, config, fp8),)


def _over_tokens(fn, lv, fp8, *arrays):
    """``fn(*arrays)``, token-local, over chunks of ``lv.token_chunk`` tokens
    (``jmem._src.token_chunks.over_tokens``: its ``[chunk, F]`` MLP tensors and float32
    norms and projections exist for one chunk at a time and are recomputed per chunk in
    the backward pass); ``arrays`` are ``[B, S, ...]``, returns ``fn``'s tuple of
    ``[B, S, ...]`` outputs. Whole (no loop) when the tokens fit one chunk or with
    ``token_chunk=0`` (the resolver sets 0 with FP8, whose scaling state is a per-call
    gradient). Checkpoint names inside a chunk are not seen by an outer remat policy."""
    if not lv.token_chunk:
        return tuple(fn(*arrays))
    return over_tokens(fn, lv.token_chunk, *arrays)


def decoder_layer(
    x: jax.Array,
    layer: Params,
    config: LlamaConfig,
    cos,
    sin,
    attn: dict,
    fp8: Params | None = None,
    levers: Any = None,
) -> jax.Array:
    """One decoder layer. x ``[B, S, H]`` -> ``[B, S, H]``, same dtype.

    ``cos``/``sin`` from ``rope_tables``; ``attn``: the index keyword arguments of
    ``jmem.ops.attention`` (``q_index`` int ``[S]`` or ``[B, S]``, optional
    ``kv_index`` and ``segment_ids``), from which the mask is built inside attention, and
    optionally this layer's ``sliding_window`` (needed with mixed ``layer_types``);
    ``fp8``: this layer's slice of ``forward``'s ``fp8["layers"]`` (or None); ``levers``:
    a ``jmem.Levers`` or ``ResolvedLevers`` (None: ``jmem.Levers()``)."""
    lv = _resolved(levers, config, x.shape[:2], x.dtype, fp8, attn.get("segment_ids"))
    return _layer(x, layer, config, (cos, sin), attn, fp8, lv=lv)[0]


def _head_kernel(params: Params, config: LlamaConfig) -> jax.Array:
    """The output head ``[H, V]``: ``lm_head`` or, tied, the embedding transposed."""
    return params["embed"]["embedding"].T if config.tie_embeddings else params["lm_head"]["kernel"]


def _final_norm(params: Params, x: jax.Array, config: LlamaConfig) -> jax.Array:
    return rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps, config.norm_offset)


def _head(params: Params, x: jax.Array, config: LlamaConfig) -> jax.Array:
    """Final norm and output head: ``[B, S, H]`` -> float32 logits ``[B, S, V]``
    (soft-capped with ``final_logit_softcap``)."""
    x = _final_norm(params, x, config)
    head = _head_kernel(params, config)
    logits = jnp.einsum("bsh,hv->bsv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
    cap = config.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def _embed(params: Params, tokens: jax.Array, config: LlamaConfig) -> jax.Array:
    """Token embeddings ``[B, S, H]`` (times ``sqrt(H)`` in their dtype for Gemma)."""
    x = jnp.take(params["embed"]["embedding"], tokens, axis=0)
    if config.scale_embeddings:
        x = x * jnp.asarray(math.sqrt(config.hidden_size), jnp.float32).astype(x.dtype)
    return x


def _is_local(config: LlamaConfig) -> jax.Array | None:
    """bool ``[L]``: which layers are sliding-window layers, when layers differ (None when
    every layer is the same: the window and RoPE are then Python constants)."""
    c = config
    if c.layer_types is None or (len(set(c.layer_types)) == 1 and c.local_rope_theta is None):
        return None
    return jnp.asarray([t == "sliding_attention" for t in c.layer_types])


def _uniform_window(config: LlamaConfig) -> int | None:
    """The window of every layer when layers do not differ (see ``_is_local``)."""
    c = config
    if c.layer_types is not None and "sliding_attention" not in c.layer_types:
        return None
    return c.sliding_window


def _layer_rope(config: LlamaConfig, positions):
    """RoPE tables of every layer, or a pair ``(global, local)`` when layers differ
    (selected per layer inside the scan by ``_per_layer``)."""
    c = config
    rope = rope_tables(positions, c.head_dim, c.rope_theta, c.rope_scaling)
    if _is_local(c) is None:
        return rope
    local = rope
    if c.local_rope_theta is not None:
        local = rope_tables(positions, c.head_dim, c.local_rope_theta, None)
    return rope, local


def _per_layer(local, rope, attn: dict, config: LlamaConfig):
    """This layer's ``(rope, attn)``: with mixed layers (``local``, a traced bool scalar
    scanned with the layer params) its RoPE tables and window (a traced int32, 0 for
    global attention); else the shared ones."""
    if local is None:
        return rope, attn
    rope = jax.tree.map(lambda g, loc: jnp.where(local, loc, g), *rope)
    window = jnp.where(local, config.sliding_window or 0, 0).astype(jnp.int32)
    return rope, {**attn, "sliding_window": window}


def _check_row_arrays(tokens, **arrays) -> None:
    """ValueError unless each given array is an integer ``[B, S]`` like ``tokens``."""
    for name, a in arrays.items():
        if a is not None and (a.shape != tokens.shape or not jnp.issubdtype(a.dtype, jnp.integer)):
            raise ValueError(
                f"{name} must be an integer array shaped like tokens {tokens.shape}; "
                f"got {a.dtype}{a.shape}."
            )


def _check_fp8(fp8) -> None:
    """ValueError for fp8 metas outside ``"layers"`` (they would go unused and be reset)."""
    if fp8 is not None and any(
        fp8_lib.is_meta(m)
        for k, v in fp8.items()
        if k != "layers"
        for m in jax.tree.leaves(v, is_leaf=fp8_lib.is_meta)
    ):
        raise ValueError(
            "fp8 metas are only used for the projections under 'layers'; "
            "build them with fp8.init_metas(params, LINEAR_NAMES)."
        )


#: The levers of a KV-cache decoding step: attention picked per call (a cache is not
#: self-attention, so never cuDNN), no token chunks, one layer loop.
_DECODE = levers_lib.ResolvedLevers("none", "auto", 0, 0, 1, False, "any", None)


def _resolved(levers, config, shape, dtype, fp8, segment_ids) -> levers_lib.ResolvedLevers:
    """``levers`` resolved for this call's batch ``shape`` ``(B, S)`` on the running
    backend, unless already resolved (for a compile target: ``jmem.resolve_levers``).
    FP8 metas make the levers FP8 (token chunks off, named in the reason).

    Raises:
      ValueError: FP8 metas with levers already resolved with token chunks on.
    """
    if isinstance(levers, levers_lib.ResolvedLevers):
        if fp8 is not None and levers.token_chunk:
            raise ValueError(
                "fp8 metas were given but the levers were resolved without fp8=True (token "
                f"chunks of {levers.token_chunk}); resolve jmem.Levers(fp8=True, ...)."
            )
        return levers
    levers = levers_lib.Levers() if levers is None else levers
    if fp8 is not None and not levers.fp8:
        levers = dataclasses.replace(levers, fp8=True)
    batch = {"inputs": jax.ShapeDtypeStruct(tuple(shape), jnp.int32)}
    if segment_ids is not None:
        batch["segment_ids"] = segment_ids
    return levers_lib.resolve(levers, config, batch, dtype=dtype)


def _hidden(params, tokens, config, *, positions, segment_ids, layer_transform, fp8, levers):
    """The last layer's output ``[B, S, H]`` (before the final norm); see ``forward``."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be an integer array [batch, seq]; got {tokens.dtype}{tokens.shape}."
        )
    _check_row_arrays(tokens, positions=positions, segment_ids=segment_ids)
    _check_fp8(fp8)
    c = config
    x = _embed(params, tokens, c)
    lv = _resolved(levers, c, tokens.shape, x.dtype, fp8, segment_ids)
    seq = tokens.shape[1]
    rope = _layer_rope(c, seq if positions is None else positions)
    attn = {"q_index": jnp.arange(seq), "segment_ids": segment_ids}
    is_local = _is_local(c)

    def body(x, xs):
        if is_local is not None:  # layers differ: this layer's flag is scanned last
            *xs, local = xs
            xs = tuple(xs) if fp8 is not None else xs[0]
        else:
            local = None
        layer, layer_fp8 = xs if fp8 is not None else (xs, None)
        # Named so that remat's "offload" policy saves the layer input in host memory.
        x = checkpoint_name(x, "layer_input")
        layer_rope, layer_attn = _per_layer(local, rope, attn, c)
        return _layer(x, layer, c, layer_rope, layer_attn, layer_fp8, lv=lv)[0], None

    if layer_transform is not None:
        body = layer_transform(body)
    xs = params["layers"] if fp8 is None else (params["layers"], fp8["layers"])
    if is_local is not None:
        xs = (*xs, is_local) if fp8 is not None else (xs, is_local)
    return jax.lax.scan(body, x, xs, unroll=lv.scan_unroll)[0], lv


def forward(
    params: Params,
    tokens: jax.Array,
    config: LlamaConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    layer_transform: Callable | None = None,
    fp8: Params | None = None,
    levers: Any = None,
) -> jax.Array:
    """Logits of a causal LM.

    Args:
      params: the params pytree (see ``init``); activations take the embedding's dtype.
      tokens: int32 ``[B, S]``.
      config: the model's ``LlamaConfig``.
      positions: optional int32 ``[B, S]`` RoPE positions; default ``0..S-1`` in every row.
        For packed rows, restart at 0 at each example.
      segment_ids: optional int32 ``[B, S]``: packed examples (a row holding several
        sequences), one id per example; attention never crosses ids (see
        ``attention_mask``). Default: one sequence per row.
      layer_transform: optional wrapper applied to the scan body ``(x, layer) -> (x, None)``,
        e.g. ``lambda f: jmem.remat(f, "selective")``. ``jmem.remat`` around the whole loss
        reaches the scan body without it.
      fp8: optional FP8 scaling states from ``jmem.fp8.init_metas(params, LINEAR_NAMES)``
        (one ``Fp8Meta`` per layer, stacked, scanned with the layer params): projections
        with a meta run as FP8 matmuls (E4M3 forward, E5M2 gradients, delayed scaling).
        The new states are the gradient w.r.t. ``fp8`` (see ``jmem.fp8``). With ``fp8``
        the scan body's second argument is ``(layer, layer_fp8)``.
      levers: how the model is run: a ``jmem.Levers`` (resolved here for this batch on
        the running backend; None: ``jmem.Levers()``) or a ``jmem.ResolvedLevers`` (from
        ``jmem.resolve_levers``, e.g. for a compile target). ``loss_chunk`` is unused
        here: the logits are returned whole.

    Returns:
      float32 logits ``[B, S, V]``.

    Raises:
      ValueError: if ``tokens`` is not a 2-D integer array, ``positions``/``segment_ids``
        are not integer arrays shaped like it, or ``fp8`` holds metas outside ``"layers"``
        (they would go unused and be reset).
    """
    x = _hidden(
        params,
        tokens,
        config,
        positions=positions,
        segment_ids=segment_ids,
        layer_transform=layer_transform,
        fp8=fp8,
        levers=levers,
    )[0]
    return _head(params, x, config)


@jax.named_scope("cross_entropy")
def cross_entropy(
    logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """Mean token cross-entropy (nats). logits ``[B,S,V]`` float, targets int ``[B,S]``."""
    nll = token_nll(logits, targets)
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def loss_fn(
    params: Params,
    batch: dict[str, jax.Array],
    config: LlamaConfig,
    *,
    levers: Any = None,
    **kwargs,
) -> jax.Array:
    """Mean next-token cross-entropy of ``batch = {"inputs": [B,S], "targets": [B,S]}``.

    Optional batch entries, int32/float ``[B, S]``: ``"mask"`` (loss weight per target),
    ``"positions"`` and ``"segment_ids"`` (packed rows; passed to ``forward``). Extra
    keyword arguments go to ``forward``. ``levers``: as ``forward``'s (None:
    ``jmem.Levers()``). The loss is computed ``levers.loss_chunk`` tokens at a time
    (``linear_cross_entropy``, with ``final_logit_softcap``), never holding the
    ``[B, S, V]`` logits unless ``loss_chunk=0``."""
    kwargs = {"layer_transform": None, "fp8": None, **kwargs}
    x, lv = _hidden(
        params,
        batch["inputs"],
        config,
        positions=batch.get("positions"),
        segment_ids=batch.get("segment_ids"),
        levers=levers,
        **kwargs,
    )
    return linear_cross_entropy(
        _final_norm(params, x, config),
        _head_kernel(params, config),
        batch["targets"],
        batch.get("mask"),
        chunk=lv.loss_chunk,
        logit_softcap=config.final_logit_softcap,
    )


def _cached_forward(params, tokens, config, cache, index):
    """Logits of the last of ``tokens [B, S]`` (row indices ``index..index+S-1``) and the
    updated cache; ``cache``: a pair ``[L, B, T, nKV, D]`` of keys and values."""
    c = config
    q_index = index + jnp.arange(tokens.shape[1])
    rope = _layer_rope(c, q_index)
    attn = {"q_index": q_index, "kv_index": jnp.arange(cache[0].shape[2])}
    is_local = _is_local(c)
    x = _embed(params, tokens, c)

    def body(x, xs):
        layer, kv, local = xs
        layer_rope, layer_attn = _per_layer(local, rope, attn, c)
        return _layer(x, layer, c, layer_rope, layer_attn, None, kv, index)

    x, cache = jax.lax.scan(body, x, (params["layers"], cache, is_local))
    return _head(params, x[:, -1:], c)[:, 0], cache


def _sample(logits: jax.Array, temperature: float, top_p: float, key) -> jax.Array:
    """Next tokens int32 ``[B]`` from float32 logits ``[B, V]``: argmax at temperature 0,
    else nucleus sampling (Holtzman et al. 2020) at ``temperature``."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # keep the most likely tokens until their mass reaches top_p (at least one)
        kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("config", "max_new_tokens", "temperature", "top_p", "apply")
)
def _generate(params, adapters, prompt, key, *, config, max_new_tokens, temperature, top_p, apply):
    c = config
    b, p = prompt.shape
    if apply is None:
        run = lambda t, cache, i: _cached_forward(params, t, c, cache, i)
    else:
        step = lambda prm, t, cache, i: _cached_forward(prm, t, c, cache, i)
        run = lambda t, cache, i: apply(step)(params, adapters, t, cache, i)
    dtype = params["embed"]["embedding"].dtype
    shape = (c.num_layers, b, p + max_new_tokens, c.num_kv_heads, c.head_dim)
    cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    logits, cache = run(prompt, cache, 0)
    keys = jax.random.split(key, max_new_tokens)
    out = jnp.zeros((b, p + max_new_tokens), jnp.int32).at[:, :p].set(prompt)
    out = out.at[:, p].set(_sample(logits, temperature, top_p, keys[0]))

    def step_fn(i, carry):
        out, cache = carry
        index = p + i
        token = jax.lax.dynamic_slice_in_dim(out, index, 1, axis=1)
        logits, cache = run(token, cache, index)
        nxt = _sample(logits, temperature, top_p, keys[i + 1])
        return jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], index + 1, axis=1), cache

    out, _ = jax.lax.fori_loop(0, max_new_tokens - 1, step_fn, (out, cache))
    return out


def _check_token_ids(tokens, vocab_size: int) -> None:
    """Raises for ids outside ``[0, vocab_size)`` in a concrete ``tokens`` (a tracer is
    not checked): ``jnp.take`` would clamp or wrap them silently."""
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"prompt_tokens hold ids outside [0, {vocab_size}) (the model's vocab_size): "
            f"{sorted(set(bad.tolist()))[:8]}; is the tokenizer the checkpoint's?"
        )


def generate(
    params: Params,
    prompt_tokens: jax.Array,
    config: LlamaConfig,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    key: jax.Array | None = None,
    adapters: Any = None,
    apply: Callable | None = None,
) -> jax.Array:
    """Autoregressive decoding with a KV cache, compiled once per shape (``jax.jit``).

    The prompt is run in one pass (prefill), then one token per step in a ``fori_loop``;
    keys and values of every layer live in a cache ``[L, B, P + max_new_tokens, nKV, D]``
    of the activation dtype. Greedy output equals transformers' ``generate(do_sample=False)``
    on the same checkpoint. All rows share the prompt length (no padding); decoding does
    not stop at an end-of-sequence token: cut the output after it.

    On an NF4 base with LoRA adapters, pass the frozen params, the adapters and the
    transform that runs a function on them, ``apply=jmem.qlora.apply`` (or
    ``jmem.lora.apply``): each decoding step is then ``apply(step)(params, adapters, ...)``,
    the same calling convention as training (``x·W + s·(x·a)·b``, W never materialized).

    Args:
      params: the params pytree (``init``, ``hf.load_params``), dense or NF4.
      prompt_tokens: int32 ``[B, P]``, P >= 1.
      config: the model's ``LlamaConfig``.
      max_new_tokens: tokens to generate (>= 1).
      temperature: 0 for greedy (argmax), else the softmax temperature of sampling.
      top_p: nucleus sampling mass in (0, 1]; 1 samples from the whole distribution.
      key: PRNG key, required when ``temperature > 0``.
      adapters: LoRA adapters for ``apply`` (with ``apply`` only).
      apply: None, or a transform ``apply(fn)(params, adapters, *args)`` such as
        ``jmem.qlora.apply``.

    Returns:
      int32 ``[B, P + max_new_tokens]``: the prompt followed by the new tokens.

    Raises:
      ValueError: a prompt that is not int ``[B, P]``, ``max_new_tokens < 1``, a negative
        temperature, ``top_p`` outside (0, 1], sampling without ``key``, or ``adapters``
        without ``apply``, or (for a concrete prompt) token ids outside ``[0, vocab_size)``.
    """
    if prompt_tokens.ndim != 2 or not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
        raise ValueError(
            f"prompt_tokens must be int [batch, len]; got {prompt_tokens.dtype}"
            f"{prompt_tokens.shape}."
        )
    if prompt_tokens.shape[1] < 1 or max_new_tokens < 1:
        raise ValueError(
            f"need a prompt of >= 1 token and max_new_tokens >= 1; got prompt "
            f"{prompt_tokens.shape} and max_new_tokens={max_new_tokens}."
        )
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1; got {temperature}, {top_p}.")
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key: pass key=.")
    if adapters is not None and apply is None:
        raise ValueError("adapters need apply= (e.g. jmem.qlora.apply) to be used.")
    _check_token_ids(prompt_tokens, config.vocab_size)
    return _generate(
        params,
        adapters,
        prompt_tokens.astype(jnp.int32),
        jax.random.key(0) if key is None else key,
        config=config,
        max_new_tokens=int(max_new_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        apply=apply,
    )
