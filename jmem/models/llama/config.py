"""The reference decoder's identity: ``LlamaConfig`` (shape and family options),
``RopeScaling``, and the names a layer's weights and intermediates go by.

Llama as in Touvron et al. 2023 ("Llama 2") and Hugging Face's ``LlamaForCausalLM``; the
family options make it Mistral, Qwen2/3, Gemma 2/3, Phi-3 and OLMo 2 (``docs/families.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Callable

import jax

from jmem._src import model_table

Params = dict[str, Any]


#: Names given with ``checkpoint_name`` inside each layer, in execution order.
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
    "router_logits",
    "expert_gate",
    "expert_up",
    "expert_hidden",
    "expert_down",
    "post_mlp_norm",
)


#: The weight names of one layer that are matmul kernels ``[in, out]``.
LINEAR_NAMES = model_table.LINEAR_NAMES


#: The kernels of a ``fused_projections`` layer (Phi-3): q/k/v and gate/up in one each.
FUSED_LINEAR_NAMES = model_table.FUSED_LINEAR_NAMES


#: The weights of a mixture-of-experts layer's MLP (``num_experts > 0``), in place of
#: ``gate_proj``/``up_proj``/``down_proj``: the router kernel ``[H, E]`` and the experts'
#: stacked kernels ``[E, H, F]``, ``[E, H, F]``, ``[E, F, H]``.
MOE_NAMES = ("router", "expert_gate", "expert_up", "expert_down")


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

    Mixture of experts (Mixtral, Jiang et al. 2024; Qwen3-MoE; ``docs/families.md``):
      num_experts: E, routed experts per layer; 0 (default) is the dense MLP. With E > 0
        every layer's MLP is routed: a ``router`` kernel ``[H, E]`` and experts
        ``expert_gate``/``expert_up`` ``[E, H, F_e]``, ``expert_down`` ``[E, F_e, H]``
        (``MOE_NAMES``) replace ``gate_proj``/``up_proj``/``down_proj``.
      num_experts_per_tok: k, the experts each token is routed to (1 <= k <= E).
      moe_intermediate_size: F_e, each expert's MLP width; None: ``intermediate_size``.
      norm_topk_prob: renormalise the k routing weights to sum to 1 (Mixtral always does;
        Qwen3-MoE's ``norm_topk_prob``); else they are the softmax probabilities.
      router_aux_loss_coef: weight of the load-balancing loss (Fedus et al. 2021, as
        transformers' ``load_balancing_loss_func``) that ``loss_fn`` adds; 0 turns it off.
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
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        object.__setattr__(self, "biases", tuple(self.biases))
        names = linear_names(self)
        unknown = sorted(set(self.biases) - set(names))
        if unknown:
            raise ValueError(f"biases {unknown} are not projections; choose from {names}.")
        _check_family_options(self)
        _check_experts(self)
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


def _check_experts(c: LlamaConfig) -> None:
    """ValueError for mixture-of-experts fields the routed MLP cannot run."""
    if c.num_experts < 0:
        raise ValueError(f"num_experts must be >= 0 (0: dense MLP); got {c.num_experts}.")
    if c.num_experts == 0:
        return
    if not 1 <= c.num_experts_per_tok <= c.num_experts:
        raise ValueError(
            f"num_experts_per_tok={c.num_experts_per_tok} must be in 1..num_experts="
            f"{c.num_experts}: each token is routed to that many distinct experts."
        )
    if c.moe_intermediate_size is not None and c.moe_intermediate_size < 1:
        raise ValueError(f"moe_intermediate_size must be >= 1; got {c.moe_intermediate_size}.")
    if c.fused_projections:
        raise ValueError("num_experts > 0 with fused_projections is not implemented.")
    if c.router_aux_loss_coef < 0:
        raise ValueError(f"router_aux_loss_coef must be >= 0; got {c.router_aux_loss_coef}.")
    if set(c.biases) & {"gate_proj", "up_proj", "down_proj"}:
        raise ValueError("MLP biases with num_experts > 0 are not implemented (experts have none).")


def expert_size(config: LlamaConfig) -> int:
    """F_e, one expert's MLP width: ``moe_intermediate_size``, else ``intermediate_size``."""
    c = config
    return c.intermediate_size if c.moe_intermediate_size is None else c.moe_intermediate_size


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
