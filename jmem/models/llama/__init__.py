"""Reference Llama-family decoder as pure functions of a params pytree.

RMSNorm, rotary position embeddings (``rope_theta``, optional Llama 3.1 / linear
scaling), grouped-query attention (optional sliding window, packed rows via
``segment_ids``) and a gated MLP (SwiGLU by default), with optional projection biases, as
in Touvron et al. 2023 ("Llama 2") and Hugging Face's ``LlamaForCausalLM``. Named family
options (per-layer attention types and RoPE bases, norm form and placement, QK-norm,
attention scale and soft-caps, embedding scale, fused projections) make it Mistral, Qwen2/3,
Gemma 2/3, Phi-3, OLMo 2, and with routed experts (``num_experts``) Mixtral and
Qwen3-MoE too, whose checkpoints load into it (``jmem.models.hf``; the
mapping is ``jmem.models.families``). ``generate`` decodes with a KV cache;
``rollout`` samples G completions per prompt (GRPO's rollouts).

Why pure functions instead of Flax modules: every jmem transform (remat over scans,
NF4 leaves, LoRA adapters, FP8 scaling state, sharding rules) acts on a params pytree
and on the traced computation. A plain ``forward(params, tokens, config)`` keeps the
pytree the single source of truth, with no module state to split and merge.

The files, as flax's ``examples/gemma``: ``config`` (``LlamaConfig``, names), ``presets``
(``CONFIGS``, ``get_config``, from ``jmem._src.model_table``), ``layers`` (norms, RoPE,
projections, MLP, embedding, head), ``block`` (the residual block and its token chunks),
``decoder`` (params, the layer scan, ``hidden_states``, ``forward``), ``loss`` and ``generation``.
Intermediates carry ``checkpoint_name`` tags (``CHECKPOINT_NAMES``) for name-based remat
policies.
"""

from jmem._src.attention import attention
from jmem._src.attention import attention_mask
from jmem.models.llama.block import decoder_layer
from jmem.models.llama.config import ACTIVATIONS
from jmem.models.llama.config import CHECKPOINT_NAMES
from jmem.models.llama.config import FUSED_LINEAR_NAMES
from jmem.models.llama.config import LAYER_TYPES
from jmem.models.llama.config import LINEAR_NAMES
from jmem.models.llama.config import MOE_NAMES
from jmem.models.llama.config import NORM_PLACEMENTS
from jmem.models.llama.config import LlamaConfig
from jmem.models.llama.config import Params
from jmem.models.llama.config import RopeScaling
from jmem.models.llama.config import expert_size
from jmem.models.llama.config import linear_names
from jmem.models.llama.decoder import abstract_params
from jmem.models.llama.decoder import forward
from jmem.models.llama.decoder import hidden_states
from jmem.models.llama.decoder import init
from jmem.models.llama.decoder import num_params
from jmem.models.llama.decoder import param_shapes
from jmem.models.llama.generation import Rollout
from jmem.models.llama.generation import generate
from jmem.models.llama.generation import rollout
from jmem.models.llama.layers import apply_rope
from jmem.models.llama.layers import final_norm
from jmem.models.llama.layers import head_kernel
from jmem.models.llama.layers import rms_norm
from jmem.models.llama.layers import rope_frequencies
from jmem.models.llama.layers import rope_tables
from jmem.models.llama.loss import cross_entropy
from jmem.models.llama.loss import loss_fn
from jmem.models.llama.loss import loss_terms
from jmem.models.llama.presets import CONFIGS
from jmem.models.llama.presets import EXECUTION_FIELDS
from jmem.models.llama.presets import get_config

__all__ = [
    "ACTIVATIONS",
    "CHECKPOINT_NAMES",
    "CONFIGS",
    "EXECUTION_FIELDS",
    "FUSED_LINEAR_NAMES",
    "LAYER_TYPES",
    "LINEAR_NAMES",
    "MOE_NAMES",
    "NORM_PLACEMENTS",
    "LlamaConfig",
    "Params",
    "RopeScaling",
    "Rollout",
    "abstract_params",
    "apply_rope",
    "attention",
    "attention_mask",
    "cross_entropy",
    "decoder_layer",
    "expert_size",
    "final_norm",
    "forward",
    "generate",
    "get_config",
    "head_kernel",
    "hidden_states",
    "init",
    "linear_names",
    "loss_fn",
    "loss_terms",
    "num_params",
    "param_shapes",
    "rms_norm",
    "rope_frequencies",
    "rope_tables",
    "rollout",
]
