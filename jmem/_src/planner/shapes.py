"""Model shapes for the memory planner: Llama-family dimensions from a config, a name or a count.

The named shapes are the presets of ``jmem._src.model_table`` (the table
``jmem.models.llama.CONFIGS`` is built from too), so the planner imports no model code; see
``docs/planner.md``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Any

from jmem._src import model_table

__all__ = [
    "LINEAR_NAMES",
    "MODEL_SHAPES",
    "ModelShape",
    "is_count",
    "resolve_shape",
    "standard_shape",
]

#: Linear weights of one decoder layer (``model_table.LINEAR_NAMES``, as ``jmem.models.llama``).
LINEAR_NAMES = model_table.LINEAR_NAMES


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape facts the planner needs from a Llama-family model (see ``LlamaConfig``).

    ``norm_widths``: the width of each per-layer norm vector; None is Llama's two of
    ``hidden_size`` (Gemma 2/3 have four, Qwen3/Gemma 3 add QK-norms of ``head_dim``).
    ``fused_projections`` (Phi-3): ``leaf_sizes`` has one ``qkv_proj`` and one
    ``gate_up_proj`` leaf; ``linear_shapes`` still lists the separate projections (the
    same elements), so LoRA on a fused module is counted as on its parts (``2 r H`` more
    adapter elements per layer than PEFT's one adapter on the fused module). ``biases``: the
    projections with a bias ``[L, out]`` (as ``LlamaConfig.biases``). ``num_experts`` E > 0
    (mixture of experts, ``num_experts_per_tok`` k, each ``expert_size`` wide): the MLP's
    ``gate_proj``/``up_proj``/``down_proj`` entries of ``linear_shapes`` stand for the
    experts' stacks (``[H, E F_e]``: their elements, what NF4 quantizes), the router
    ``[H, E]`` is a float leaf, and activations count the k active experts' width
    (``active_mlp_width``; the ``T k`` sorted token copies are not counted). ``name`` does
    not take part in comparisons (Llama 3.1 8B has Llama 3 8B's shape)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False
    name: str | None = dataclasses.field(default=None, compare=False)
    norm_widths: tuple[int, ...] | None = None
    fused_projections: bool = False
    biases: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_size: int = 0
    #: The long-context paths as resolved from the step's ``jmem.Levers`` (attention,
    #: ``loss_chunk``, ``token_chunk``; set by ``estimate``): how the step computes, not the
    #: shape, so they do not take part in comparisons.
    attention: str = dataclasses.field(default="dense", compare=False)
    loss_chunk: int = dataclasses.field(default=0, compare=False)
    mlp_chunk: int = dataclasses.field(default=0, compare=False)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``[in, out]`` of each linear weight of one layer."""
        h, f = self.hidden_size, self.intermediate_size
        if self.num_experts:
            f = self.num_experts * self.expert_size  # every expert's weights, side by side
        qd, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (h, qd),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (qd, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

    @property
    def active_mlp_width(self) -> int:
        """The MLP width a token's activations see: F, or k experts of ``expert_size``."""
        if self.num_experts:
            return self.num_experts_per_tok * self.expert_size
        return self.intermediate_size

    @property
    def inactive_expert_params(self) -> int:
        """Elements of the experts a token does not run: ``L (E - k) 3 H F_e`` (0 for a
        dense MLP); the parameters minus these are the ones in a token's matmuls."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_layers * idle * 3 * self.hidden_size * self.expert_size

    @property
    def router_params(self) -> int:
        """Elements of the routers ``[L, H, E]`` (0 for a dense MLP)."""
        return self.num_layers * self.hidden_size * self.num_experts

    def lora_elements(self, targets, rank: int) -> int:
        """Elements of LoRA factors ``a [in, r]``, ``b [r, out]`` on the linear weights
        ``targets`` of every layer; on a mixture of experts the MLP's names stand for the
        experts, one pair per expert (``E r (H + F_e)`` per projection)."""
        lin, mlp = self.linear_shapes(), ("gate_proj", "up_proj", "down_proj")
        expert_pair = self.num_experts * (self.hidden_size + self.expert_size)
        per_layer = sum(
            expert_pair if (self.num_experts and t in mlp) else sum(lin[t]) for t in targets
        )
        return self.num_layers * rank * per_layer

    @property
    def linear_params(self) -> int:
        """Elements of all layers' linear weights (what NF4 quantizes)."""
        return self.num_layers * sum(i * o for i, o in self.linear_shapes().values())

    @property
    def embedding_params(self) -> int:
        """Elements of the embedding plus the (untied) output head."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    def layer_norm_widths(self) -> tuple[int, ...]:
        """Widths of one layer's norm vectors (``norm_widths``, default two of H)."""
        return self.norm_widths or (self.hidden_size, self.hidden_size)

    @property
    def norm_params(self) -> int:
        return self.num_layers * sum(self.layer_norm_widths()) + self.hidden_size

    def leaf_sizes(self) -> list[int]:
        """Elements of each params leaf of ``jmem.models.llama`` (layers stacked on L)."""
        L, h = self.num_layers, self.hidden_size
        sizes = [self.vocab_size * h, *(L * w for w in self.layer_norm_widths()), h]
        lin = {k: L * i * o for k, (i, o) in self.linear_shapes().items()}
        if self.fused_projections:
            lin = {
                "qkv_proj": lin.pop("q_proj") + lin.pop("k_proj") + lin.pop("v_proj"),
                "gate_up_proj": lin.pop("gate_proj") + lin.pop("up_proj"),
                **lin,
            }
        sizes += list(lin.values())
        sizes += list(self._bias_sizes().values())
        if self.num_experts:
            sizes.append(self.router_params)
        if not self.tie_embeddings:
            sizes.append(h * self.vocab_size)
        return sizes

    def _bias_sizes(self) -> dict[str, int]:
        """Elements of each bias leaf ``[L, out]`` (``biases``; fused names for Phi-3's)."""
        outs = {k: o for k, (_, o) in self.linear_shapes().items()}
        outs["qkv_proj"] = outs["q_proj"] + outs["k_proj"] + outs["v_proj"]
        outs["gate_up_proj"] = outs["gate_proj"] + outs["up_proj"]
        return {name: self.num_layers * outs[name] for name in self.biases}

    @property
    def n_params(self) -> int:
        """Total parameters; equals ``jmem.models.llama.num_params(config)``."""
        biases = sum(self._bias_sizes().values())
        embed_norms = self.embedding_params + self.norm_params + self.router_params
        return self.linear_params + embed_norms + biases


def norm_widths_of(model: Any) -> tuple[int, ...] | None:
    """``ModelShape.norm_widths`` of a ``LlamaConfig``-like object (its ``norm_placement``
    and ``qk_norm``; None when absent, as Llama)."""
    H, nH, nKV = model.hidden_size, model.num_heads, model.num_kv_heads
    D = getattr(model, "head_dim", None) or H // nH
    norms = 4 if getattr(model, "norm_placement", "pre") == "sandwich" else 2
    qk = getattr(model, "qk_norm", None)
    widths = (H,) * norms + {None: (), "head": (D, D), "proj": (nH * D, nKV * D)}[qk]
    return widths if widths != (H, H) else None


def _of_config(model: Any, name: str | None) -> ModelShape:
    """The ``ModelShape`` of a ``LlamaConfig``-like object (its attributes; absent optional
    ones take ``LlamaConfig``'s defaults)."""
    hd = getattr(model, "head_dim", None) or model.hidden_size // model.num_heads
    return ModelShape(
        int(model.vocab_size),
        int(model.hidden_size),
        int(model.intermediate_size),
        int(model.num_layers),
        int(model.num_heads),
        int(model.num_kv_heads),
        int(hd),
        bool(getattr(model, "tie_embeddings", False)),
        name,
        norm_widths_of(model),
        bool(getattr(model, "fused_projections", False)),
        tuple(getattr(model, "biases", ())),
        *_experts_of(model),
    )


def _experts_of(model: Any) -> tuple[int, int, int]:
    """``(num_experts, num_experts_per_tok, expert_size)`` of a config-like object (zeros
    for a dense one)."""
    e = int(getattr(model, "num_experts", 0) or 0)
    if not e:
        return 0, 0, 0
    fe = getattr(model, "moe_intermediate_size", None) or model.intermediate_size
    return e, int(getattr(model, "num_experts_per_tok", 2)), int(fe)


#: Shapes of the presets (``model_table.PRESETS``, as ``jmem.models.llama.CONFIGS``).
MODEL_SHAPES: dict[str, ModelShape] = {
    name: _of_config(types.SimpleNamespace(**model_table.preset_fields(name)), name)
    for name in model_table.PRESETS
}


def standard_shape(n_params: float, *, vocab_size: int = 32000, **overrides) -> ModelShape:
    """A Llama-like shape with about ``n_params`` parameters, for activation estimates.

    Per layer a Llama block with ``F = 8/3 h`` has ``12 h^2`` weights; Llama-2 7B/13B and
    TinyLlama keep ``h / L = 128``, so ``L = (N / (12 * 128^2))^(1/3)`` and ``h = 128 L``
    (rounded: ``L >= 1``, ``h`` a multiple of 128, ``F`` a multiple of 256, head_dim 128).
    Keywords (``hidden_size``, ``num_layers``, ``intermediate_size``, ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``tie_embeddings``) override the derived values; with
    ``hidden_size`` alone the layers are derived from the count at that width
    (``L = N / (12 h^2)``).

    Raises:
      ValueError: for a non-positive ``n_params``, an unknown keyword, a keyword that is
        not a positive int, or keywords that make a shape with less than half or more
        than twice ``n_params`` parameters.
    """
    if not n_params > 0:
        raise ValueError(f"n_params must be positive; got {n_params!r}.")
    known = {
        "hidden_size",
        "num_layers",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_embeddings",
    }
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int; got {vocab_size!r}.")
    bad = set(overrides) - known
    if bad:
        raise ValueError(f"Unknown shape keywords {sorted(bad)}; use {sorted(known)}.")
    for k, v in overrides.items():
        if (
            k != "tie_embeddings"
            and v is not None
            and (isinstance(v, bool) or not isinstance(v, int) or v < 1)
        ):
            raise ValueError(f"{k} must be a positive int; got {v!r}.")
    if overrides.get("hidden_size") and not overrides.get("num_layers"):
        # The layers that give about n_params at this width (not the default depth).
        h = overrides["hidden_size"]
        L = max(1, round(n_params / (12 * h * h)))
    else:
        L = overrides.get("num_layers") or max(1, round((n_params / (12 * 128**2)) ** (1 / 3)))
        h = overrides.get("hidden_size") or max(
            128, 128 * round(math.sqrt(n_params / (12 * L)) / 128)
        )
    f = overrides.get("intermediate_size") or max(256, 256 * round(8 * h / 3 / 256))
    hd = overrides.get("head_dim") or min(128, h)
    nh = overrides.get("num_heads") or max(1, h // hd)
    nkv = overrides.get("num_kv_heads") or nh
    shape = ModelShape(
        vocab_size,
        h,
        f,
        L,
        nh,
        nkv,
        hd,
        bool(overrides.get("tie_embeddings", False)),
        f"~{n_params / 1e9:.3g}B",
    )
    if overrides and not 0.5 <= shape.n_params / n_params <= 2.0:
        raise ValueError(
            f"The shape h={h}, L={L}, F={f} has {shape.n_params / 1e9:.3g}B parameters, not "
            f"about {n_params / 1e9:.3g}B: the shape keywords {sorted(overrides)} do not fit "
            f"the parameter count. Give one of hidden_size/num_layers and let the other be "
            f"derived, or pass a config."
        )
    return shape


def _parse_count(s: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", s)
    if not m:
        raise ValueError
    mult = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    return float(m.group(1)) * mult


def resolve_shape(model: Any, **shape_kwargs) -> tuple[ModelShape, float]:
    """``(shape, n_params)`` for a config object, a config name, or a parameter count.

    Raises:
      ValueError: for an unknown name (lists :data:`MODEL_SHAPES`) or a bad count.
      TypeError: for an object without the ``LlamaConfig`` attributes.
    """
    if isinstance(model, ModelShape):
        return model, model.n_params
    if isinstance(model, str):
        if model in MODEL_SHAPES:
            s = MODEL_SHAPES[model]
            return s, s.n_params
        try:
            n = _parse_count(model)
        except ValueError:
            raise ValueError(
                f"Unknown model {model!r}: pass a config object, a name from "
                f"{sorted(MODEL_SHAPES)}, or a parameter count such as 7e9 or '7B'."
            ) from None
        return standard_shape(n, **shape_kwargs), n
    if isinstance(model, bool):
        raise TypeError("model must be a config, a name or a parameter count, not a bool.")
    if isinstance(model, (int, float)):
        if not model > 0:
            raise ValueError(f"Parameter count must be positive; got {model!r}.")
        return standard_shape(model, **shape_kwargs), float(model)
    attrs = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
    )
    missing = [a for a in attrs if not hasattr(model, a)]
    if missing:
        raise TypeError(
            f"model {type(model).__name__} lacks {missing}; pass a LlamaConfig-like object, a "
            f"name from {sorted(MODEL_SHAPES)}, or a parameter count."
        )
    s = _of_config(model, getattr(model, "name", None))
    if s.name is None:  # name a config that matches a known shape
        for known in MODEL_SHAPES.values():
            if known == s:
                s = dataclasses.replace(s, name=known.name)
                break
    return s, s.n_params


def is_count(model: Any) -> bool:
    """Whether ``model`` is a parameter count (a number, or a string not in the table)."""
    if isinstance(model, bool):
        return False
    return isinstance(model, (int, float)) or (isinstance(model, str) and model not in MODEL_SHAPES)
