"""Model shapes for the memory planner: Llama-family dimensions from a config, a name or a count.

Mirrors ``jmem.models.llama.CONFIGS`` (tests check they agree) so the planner imports no
model code; see ``docs/planner.md``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Any

__all__ = [
    "LINEAR_NAMES",
    "MODEL_SHAPES",
    "ModelShape",
    "is_count",
    "resolve_shape",
    "standard_shape",
]

#: Linear weights of one decoder layer (the names of ``jmem.models.llama.LINEAR_NAMES``).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape facts the planner needs from a Llama-family model (see ``LlamaConfig``).

    ``norm_widths``: the width of each per-layer norm vector; None is Llama's two of
    ``hidden_size`` (Gemma 2/3 have four, Qwen3/Gemma 3 add QK-norms of ``head_dim``).
    ``fused_projections`` (Phi-3): ``leaf_sizes`` has one ``qkv_proj`` and one
    ``gate_up_proj`` leaf; ``linear_shapes`` still lists the separate projections (the
    same elements), so LoRA on a fused module is counted as on its parts (``2 r H`` more
    adapter elements per layer than PEFT's one adapter on the fused module)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False
    name: str | None = None
    norm_widths: tuple[int, ...] | None = None
    fused_projections: bool = False
    #: The long-context paths as resolved from the step's ``jmem.Levers`` (attention,
    #: ``loss_chunk``, ``token_chunk``; set by ``estimate``): how the step computes, not the
    #: shape, so they do not take part in comparisons.
    attention: str = dataclasses.field(default="dense", compare=False)
    loss_chunk: int = dataclasses.field(default=0, compare=False)
    mlp_chunk: int = dataclasses.field(default=0, compare=False)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``[in, out]`` of each linear weight of one layer."""
        h, f = self.hidden_size, self.intermediate_size
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
        if not self.tie_embeddings:
            sizes.append(h * self.vocab_size)
        return sizes

    @property
    def n_params(self) -> int:
        """Total parameters; equals ``jmem.models.llama.num_params(config)``."""
        return self.linear_params + self.embedding_params + self.norm_params


def _shape(name, V, H, F, L, nH, nKV, tie=False):
    return ModelShape(V, H, F, L, nH, nKV, H // nH, tie, name)


def _family(name, V, H, F, L, nH, nKV, D, tie, norms, qk):
    """A family preset's shape: ``norms`` per-layer norms of H (2, or 4 for Gemma's
    sandwich) and QK-norm ``qk`` (None, ``"head"`` or ``"proj"``), as ``LlamaConfig``."""
    placement = "sandwich" if norms == 4 else "pre"
    options = types.SimpleNamespace(
        hidden_size=H, num_heads=nH, num_kv_heads=nKV, head_dim=D, norm_placement=placement,
        qk_norm=qk,
    )  # fmt: skip
    fused = name.startswith("phi3")
    return ModelShape(V, H, F, L, nH, nKV, D, tie, name, norm_widths_of(options), fused)


def norm_widths_of(model: Any) -> tuple[int, ...] | None:
    """``ModelShape.norm_widths`` of a ``LlamaConfig``-like object (its ``norm_placement``
    and ``qk_norm``; None when absent, as Llama)."""
    H, nH, nKV = model.hidden_size, model.num_heads, model.num_kv_heads
    D = getattr(model, "head_dim", None) or H // nH
    norms = 4 if getattr(model, "norm_placement", "pre") == "sandwich" else 2
    qk = getattr(model, "qk_norm", None)
    widths = (H,) * norms + {None: (), "head": (D, D), "proj": (nH * D, nKV * D)}[qk]
    return widths if widths != (H, H) else None


#: Shapes of ``jmem.models.llama.CONFIGS`` (tests check they agree).
MODEL_SHAPES: dict[str, ModelShape] = {
    "tiny": _shape("tiny", 256, 256, 688, 4, 8, 4),
    "llama_1b": _shape("llama_1b", 32000, 2048, 5632, 22, 32, 4),
    "llama2_7b": _shape("llama2_7b", 32000, 4096, 11008, 32, 32, 32),
    "llama3_8b": _shape("llama3_8b", 128256, 4096, 14336, 32, 32, 8),
    "gemma2_2b": _family("gemma2_2b", 256000, 2304, 9216, 26, 8, 4, 256, True, 4, None),
    "gemma2_9b": _family("gemma2_9b", 256000, 3584, 14336, 42, 16, 8, 256, True, 4, None),
    "gemma3_1b": _family("gemma3_1b", 262144, 1152, 6912, 26, 4, 1, 256, True, 4, "head"),
    "gemma3_4b": _family("gemma3_4b", 262208, 2560, 10240, 34, 8, 4, 256, True, 4, "head"),
    "gemma3_12b": _family("gemma3_12b", 262208, 3840, 15360, 48, 16, 8, 256, True, 4, "head"),
    "qwen3_0_6b": _family("qwen3_0_6b", 151936, 1024, 3072, 28, 16, 8, 128, True, 2, "head"),
    "qwen3_8b": _family("qwen3_8b", 151936, 4096, 12288, 36, 32, 8, 128, False, 2, "head"),
    "phi3_mini": _family("phi3_mini", 32064, 3072, 8192, 32, 32, 32, 96, False, 2, None),
    "olmo2_7b": _family("olmo2_7b", 100352, 4096, 11008, 32, 32, 32, 128, False, 2, "proj"),
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
    hd = getattr(model, "head_dim", None) or model.hidden_size // model.num_heads
    s = ModelShape(
        int(model.vocab_size),
        int(model.hidden_size),
        int(model.intermediate_size),
        int(model.num_layers),
        int(model.num_heads),
        int(model.num_kv_heads),
        int(hd),
        bool(getattr(model, "tie_embeddings", False)),
        getattr(model, "name", None),
        norm_widths_of(model),
        bool(getattr(model, "fused_projections", False)),
    )
    if s.name is None:  # name a config that matches a known shape
        for known in MODEL_SHAPES.values():
            if dataclasses.replace(known, name=None) == s:
                s = dataclasses.replace(s, name=known.name)
                break
    return s, s.n_params


def is_count(model: Any) -> bool:
    """Whether ``model`` is a parameter count (a number, or a string not in the table)."""
    if isinstance(model, bool):
        return False
    return isinstance(model, (int, float)) or (isinstance(model, str) and model not in MODEL_SHAPES)
