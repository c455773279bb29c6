"""Memory planner: the five ledgers of a training step, before you run it.

``estimate(model, ...)`` returns a :class:`Ledger` of device bytes split the way the
memory is spent (Rajbhandari et al. 2020, "ZeRO"; the "five ledgers" accounting):

============== ==========================================================================
params         the weights the forward pass reads (``param_dtype``; NF4 when quantized)
grads          one gradient per *trainable* parameter (``grad_dtype``, default param dtype)
optimizer      the optimizer's per-parameter state (Adam: m and v)
masters        fp32 master copies of 16-bit trainable weights (Micikevicius et al. 2017)
activations    residuals kept for the backward pass, plus the logits and their gradient
============== ==========================================================================

and answers the usual questions: :func:`largest_model`, :func:`largest_batch`,
:func:`largest_seq_len`, :func:`advise` (does it fit, which ledger is short, which levers
help, ordered by cost).

Two accounting conventions (``accounting=``):

* ``"stored"`` (default): the bytes jmem actually stores. Block-quantized optimizer
  states carry one fp32 absmax per block (8-bit: ``1 + 4/256`` bytes per state element,
  4-bit: ``0.5 + 4/128``), NF4 carries its double-quantized absmax (4.127 bits per
  weight, Dettmers et al. 2023), and fp32 LoRA adapters have no separate master copy
  (they *are* fp32).
* ``"nominal"``: the textbook convention of the usual tables: 8-bit states are 1 byte,
  4-bit 0.5 byte, NF4 0.5 byte per weight, and LoRA adapters are charged the full five
  fp32 ledgers (params, grads, m, v, master = 20 bytes per adapter parameter). This
  reproduces the classic figures: 7B mixed-precision Adam 112 GB, 8-bit states 70 GB,
  QLoRA ~3.6 GB, and the largest 24 GB full fine-tune of 1.0B / 1.6B / 2.0B parameters.
  The two conventions differ by < 2% except for NF4 (+3%).

A model is a config object with the attributes of ``jmem.models.llama.LlamaConfig``
(duck typed: ``vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
num_kv_heads, head_dim, tie_embeddings``), a name from :data:`MODEL_SHAPES` (the shapes of
``jmem.models.llama.CONFIGS``, mirrored here so this leaf imports no model code), or a
parameter count (``int``/``float``). For a count, the shape used for activations and LoRA
adapters is taken from the ``hidden_size=``/``num_layers=``/... keywords where given and
otherwise from :func:`standard_shape` (a Llama-like shape with ``hidden = 128 * layers``),
and *all* parameters count as linear weights (quantized by NF4, as the textbook tables do).

All byte figures are ints; ``GB`` means 1e9 bytes and ``GiB`` 2**30 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Mapping, Sequence

from jmem._src import dtypes as _dtypes

__all__ = [
    "Ledger",
    "ModelShape",
    "Advice",
    "Lever",
    "MODEL_SHAPES",
    "OPTIMIZERS",
    "REMAT_MODES",
    "estimate",
    "activation_bytes",
    "standard_shape",
    "resolve_shape",
    "parse_memory",
    "largest_model",
    "largest_batch",
    "largest_seq_len",
    "advise",
    "GB",
    "GiB",
]

GB = 10**9
GiB = 2**30

#: Linear weights of one decoder layer (the names of ``jmem.models.llama.LINEAR_NAMES``).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: Remat modes, as named by ``jmem.remat.REMAT_POLICIES``.
REMAT_MODES = ("none", "dots", "selective", "full", "offload")


# --------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape facts the planner needs from a Llama-family model (see ``LlamaConfig``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False
    name: str | None = None

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

    @property
    def norm_params(self) -> int:
        return (2 * self.num_layers + 1) * self.hidden_size

    def leaf_sizes(self) -> list[int]:
        """Elements of each params leaf of ``jmem.models.llama`` (layers stacked on L)."""
        L, h = self.num_layers, self.hidden_size
        sizes = [self.vocab_size * h, L * h, L * h, h]
        sizes += [L * i * o for i, o in self.linear_shapes().values()]
        if not self.tie_embeddings:
            sizes.append(h * self.vocab_size)
        return sizes

    @property
    def n_params(self) -> int:
        """Total parameters; equals ``jmem.models.llama.num_params(config)``."""
        return self.linear_params + self.embedding_params + self.norm_params


def _shape(name, V, H, F, L, nH, nKV, tie=False):
    return ModelShape(V, H, F, L, nH, nKV, H // nH, tie, name)


#: Shapes of ``jmem.models.llama.CONFIGS`` (tests check they agree).
MODEL_SHAPES: dict[str, ModelShape] = {
    "tiny": _shape("tiny", 256, 256, 688, 4, 8, 4),
    "llama_1b": _shape("llama_1b", 32000, 2048, 5632, 22, 32, 4),
    "llama2_7b": _shape("llama2_7b", 32000, 4096, 11008, 32, 32, 32),
    "llama3_8b": _shape("llama3_8b", 128256, 4096, 14336, 32, 32, 8),
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
    )
    if s.name is None:  # name a config that matches a known shape
        for known in MODEL_SHAPES.values():
            if dataclasses.replace(known, name=None) == s:
                s = known
                break
    return s, s.n_params


# ----------------------------------------------------------------------- optimizers


@dataclasses.dataclass(frozen=True)
class _Opt:
    states: int  # per-parameter state tensors (Adam: m and v)
    bits: float  # bits per state element
    block: int | None  # quantization block (one fp32 absmax per block) or None
    about: str


#: Optimizer state layouts: name -> (states per parameter, bits each, quant block, note).
OPTIMIZERS: dict[str, _Opt] = {
    "adamw": _Opt(2, 32, None, "fp32 m and v (Kingma & Ba 2015; optax.adamw)"),
    "adam": _Opt(2, 32, None, "fp32 m and v"),
    "adamw_8bit": _Opt(2, 8, 256, "block-wise 8-bit m and v (Dettmers et al. 2022)"),
    "adam_8bit": _Opt(2, 8, 256, "block-wise 8-bit m and v"),
    "adamw_4bit": _Opt(2, 4, 128, "block-wise 4-bit m and v (Li et al. 2023)"),
    "adam_4bit": _Opt(2, 4, 128, "block-wise 4-bit m and v"),
    "sgd": _Opt(0, 0, None, "no state"),
    "sgd_momentum": _Opt(1, 32, None, "fp32 momentum"),
    "lion": _Opt(1, 32, None, "fp32 momentum (Chen et al. 2023)"),
}

_MIN_QUANTIZED_SIZE = 4096  # jmem.optimizers min_8bit_size / min_4bit_size

_OFFLOAD = {
    False: (),
    None: (),
    "none": (),
    "optimizer": ("optimizer_state",),
    "optimizer+masters": ("optimizer_state", "master_weights"),
    True: ("optimizer_state",),
}


def _state_bytes_per_param(opt: _Opt, accounting: str, block: int | None) -> float:
    per = opt.bits / 8
    b = block or opt.block
    if accounting == "stored" and b:
        per += 4 / b
    return opt.states * per


def _dtype_bytes(name: Any, what: str) -> int:
    return _dtypes.itemsize(name, what)


# ---------------------------------------------------------------------- activations


def activation_bytes(
    shape: ModelShape,
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    activation_dtype: Any = "bf16",
    remat: str | None = None,
) -> dict[str, int]:
    """Bytes of activations kept for the backward pass of one micro-batch, by part.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", Sec. 4) count, per GPT layer with 16-bit activations, ``s b h (34 + 5 a s/h)``
    bytes: attention 11 sbh (LayerNorm-out 2, Q 2, K 2, V 2, context 2, dropout mask 1)
    + 5 a s^2 b (softmax out 2, its dropout mask 1, dropout out 2), MLP 19 sbh (input 2,
    GeLU in 8, GeLU out 8, mask 1), two LayerNorm inputs 4 sbh. Selective recomputation
    drops the ``5 a s^2 b`` term (34 sbh); full recomputation keeps 2 sbh (the layer input).

    The jmem reference Llama (pre-norm RMSNorm computed in fp32, RoPE, GQA, SwiGLU, no
    dropout, ``lax.scan`` over layers) saves, per layer and per token (``t = b s``), with
    ``A`` = activation bytes (2 for bf16, 4 for fp32), ``h`` hidden, ``qd = nH*D``,
    ``kv = nKV*D`` (GQA: K and V are ``nKV/nH`` the size of Q), ``F`` intermediate,
    ``a = nH``; read off ``jax.ad_checkpoint.print_saved_residuals`` of its loss:

    * two RMSNorms, each ``(4 + 4 + A) h``: the fp32 copy of its input, the fp32
      normalised value (both saved because the norm runs in fp32) and its output;
    * Q and K after RoPE ``A (qd + kv)``, V ``A kv``, the attention context ``A qd``;
    * softmax ``(4 + A) a s``: fp32 probabilities and their ``A``-byte cast for ``P V``;
    * SwiGLU ``6 A F``: gate, up, sigmoid(gate), silu(gate), their product (the down
      projection's input) and one more F-wide intermediate of silu's derivative.

    ``none`` = the sum of these (for Llama-2-7B in bf16: ``t h (56.4 + 6 a s / h)`` vs.
    Korthikanti's 34 + 5 a s/h: fp32 norm copies and the SwiGLU intermediates cost more).
    Remat modes follow ``jmem.remat`` (JAX checkpoint policies on the scan body):

    * ``dots``: the layer input and the matmul outputs the backward pass needs: q, k, v,
      scores (``A a s``), context, o_proj out, gate, up (the down projection's output is
      not needed: the next layer's input is saved instead): ``A (2h + 2qd + 2kv + 2F + a s)``;
    * ``selective`` (``dots_with_no_batch_dims_saveable``, Korthikanti's selective):
      weight matmuls only: ``A (2h + qd + 2kv + 2F)``;
    * ``full``: the layer input ``A h``;
    * ``offload``: ``selective``'s residuals go to host memory (reported as
      ``host_activations``), the layer input stays.

    Under any remat the backward pass recomputes one layer at a time, so one layer's
    ``none`` residuals are added once (``recompute``). Outside the layers: the logits
    ``4 b s V`` (fp32, kept by log-softmax) plus their gradient ``4 b s V``, the
    embedding output ``A b s h``, and the causal mask broadcast to the scores' shape
    (``5 b a s^2``: fp32 fill + bool, hoisted out of the scan once).

    Args:
      shape: a :class:`ModelShape` (see :func:`resolve_shape`).
      batch_size: sequences per micro-batch on this device (``b``).
      seq_len: tokens per sequence (``s``).
      activation_dtype: dtype of activations (the compute dtype).
      remat: one of :data:`REMAT_MODES` (``None`` = ``"none"``).

    Returns:
      ``{"layers", "recompute", "logits", "other", "host_activations"}`` in bytes.

    Raises:
      ValueError: for an unknown remat mode or non-positive sizes.
    """
    remat = "none" if remat is None else remat
    if remat not in REMAT_MODES:
        raise ValueError(f"remat={remat!r} is not one of {REMAT_MODES}.")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1; got {batch_size}, {seq_len}.")
    A = _dtype_bytes(activation_dtype, "activation_dtype")
    h, F, a, L = shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_layers
    qd, kv, s, t = (
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        seq_len,
        batch_size * seq_len,
    )
    none = 2 * (8 + A) * h + A * (2 * qd + 2 * kv) + (4 + A) * a * s + 6 * A * F
    per_token = {
        "none": none,
        "dots": A * (2 * h + 2 * qd + 2 * kv + 2 * F + a * s),
        "selective": A * (2 * h + qd + 2 * kv + 2 * F),
        "full": A * h,
        "offload": A * h,
    }[remat]
    host = L * t * (A * (h + qd + 2 * kv + 2 * F)) if remat == "offload" else 0
    return {
        "layers": L * t * per_token,
        "recompute": 0 if remat == "none" else t * none,
        "logits": 2 * 4 * t * shape.vocab_size,
        "other": A * t * h + 5 * batch_size * a * s * s,
        "host_activations": host,
    }


# --------------------------------------------------------------------------- ledger


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Device bytes of one training configuration, by ledger (all ints, bytes).

    Attributes:
      params, grads, optimizer_state, master_weights, activations: device bytes.
      host: bytes kept in host memory (offloaded optimizer state, masters, activations).
      n_params: parameters of the model; trainable_params: those that get gradients.
      detail: finer split (``activation:layers``, ``lora:params``, ...), bytes.
      notes: assumptions and caveats that apply to this configuration.
      config: the arguments that produced it.
    """

    params: int
    grads: int
    optimizer_state: int
    master_weights: int
    activations: int
    host: Mapping[str, int] = dataclasses.field(default_factory=dict)
    n_params: int = 0
    trainable_params: int = 0
    detail: Mapping[str, int] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    LEDGERS = ("params", "grads", "optimizer_state", "master_weights", "activations")

    @property
    def static(self) -> int:
        """Model-state bytes (everything but activations)."""
        return self.params + self.grads + self.optimizer_state + self.master_weights

    @property
    def total(self) -> int:
        """Device bytes: the five ledgers summed."""
        return self.static + self.activations

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def as_dict(self) -> dict[str, int]:
        d = {k: getattr(self, k) for k in self.LEDGERS}
        d["total"] = self.total
        return d

    def __str__(self) -> str:
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items() if v not in (None, False))
        head = (
            f"{self.n_params / 1e9:.3g}B params ({self.trainable_params / 1e6:.4g}M trainable)"
            + (f"; {cfg}" if cfg else "")
        )
        rows = [(k.replace("_", " "), getattr(self, k)) for k in self.LEDGERS]
        rows.append(("total (device)", self.total))
        for k, v in self.host.items():
            rows.append((f"host: {k.replace('_', ' ')}", v))
        w = max(len(r[0]) for r in rows)
        lines = [
            head,
            f"{'ledger':<{w}}  {'GB':>10}  {'GiB':>10}",
            f"{'-' * w}  {'-' * 10}  {'-' * 10}",
        ]
        for name, v in rows:
            if name == "total (device)":
                lines.append(f"{'-' * w}  {'-' * 10}  {'-' * 10}")
            lines.append(f"{name:<{w}}  {v / GB:>10.3f}  {v / GiB:>10.3f}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _lora_spec(lora: Any) -> tuple[int, tuple[str, ...]] | None:
    if lora is None or lora is False:
        return None
    if isinstance(lora, bool):
        raise TypeError("lora must be None, a rank, (rank, targets) or a dict, not True.")
    if isinstance(lora, int):
        rank, targets = lora, ("q_proj", "v_proj")
    elif isinstance(lora, Mapping):
        rank, targets = lora.get("rank"), lora.get("targets", ("q_proj", "v_proj"))
    elif isinstance(lora, Sequence) and len(lora) == 2:
        rank, targets = lora
    else:
        raise TypeError(
            f"lora must be a rank, (rank, targets) or {{'rank', 'targets'}}; got {lora!r}."
        )
    if isinstance(targets, str):
        targets = LINEAR_NAMES if targets == "all" else (targets,)
    targets = tuple(targets)
    bad = [t for t in targets if t not in LINEAR_NAMES]
    if bad or not targets:
        raise ValueError(
            f"LoRA targets {bad or targets} unknown; choose from {LINEAR_NAMES} or 'all'."
        )
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive int; got {rank!r}.")
    return rank, targets


def estimate(
    model: Any,
    *,
    param_dtype: Any = "bf16",
    optimizer: str = "adamw",
    master_weights: bool | None = None,
    grad_dtype: Any = None,
    activation_dtype: Any = None,
    offload: bool | str = False,
    lora: Any = None,
    adapter_dtype: Any = "fp32",
    quantization: str | None = None,
    quantize_embeddings: bool = False,
    double_quant: bool = True,
    remat: str | None = None,
    batch_size: int = 1,
    seq_len: int = 2048,
    num_shards: int = 1,
    zero_stage: int | None = None,
    accounting: str = "stored",
    state_block_size: int | None = None,
    activations: int | None = None,
    **shape_kwargs,
) -> Ledger:
    """Estimates the device memory of one training step, ledger by ledger.

    Args:
      model: a ``LlamaConfig``-like object, a name in :data:`MODEL_SHAPES`, or a parameter
        count (``7e9``, ``"7B"``; shape keywords below refine the activation estimate).
      param_dtype: dtype of the weights the forward pass uses (``"bf16"``, ``"fp32"``...).
      optimizer: a key of :data:`OPTIMIZERS` (``adamw``, ``adamw_8bit``, ``adamw_4bit``,
        ``sgd``, ``sgd_momentum``, ``lion``, ...).
      master_weights: keep fp32 masters of trainable weights. Default: True when
        ``param_dtype`` is 16-bit (mixed precision), False for fp32 (they would be the
        params themselves).
      grad_dtype: gradient dtype; default ``param_dtype``.
      activation_dtype: activation dtype; default ``param_dtype`` (the jmem Llama computes
        in its embedding's dtype).
      offload: ``False``, ``"optimizer"`` (m, v to host) or ``"optimizer+masters"``;
        offloaded ledgers are reported under ``Ledger.host``.
      lora: ``None``, a rank (targets q_proj, v_proj), ``(rank, targets)`` or
        ``{"rank": r, "targets": [...]}``; targets from ``LINEAR_NAMES`` or ``"all"``.
        The base is frozen (no grads, state or masters); each adapter ``A [in, r]``,
        ``B [r, out]`` per layer and target gets grads and optimizer state in
        ``adapter_dtype`` (and, under ``nominal`` accounting, a master copy).
      quantization: ``None`` or ``"nf4"`` (frozen base in NF4; requires ``lora``). With a
        config, only the layers' linear weights are quantized (embeddings, head and norms
        stay ``param_dtype`` unless ``quantize_embeddings``); with a count, all are.
      double_quant: NF4 absmax double quantization (4.127 vs 4.5 bits per weight).
      remat: one of :data:`REMAT_MODES` (``None`` = ``"none"``); see :func:`activation_bytes`.
      batch_size, seq_len: per-device micro-batch (sequences) and sequence length (tokens).
      num_shards: data-parallel devices the state is sharded over (ZeRO / FSDP).
      zero_stage: 1 shards optimizer state and masters, 2 adds grads, 3 adds params
        (default 3 when ``num_shards > 1``). Activations are per device and not divided.
      accounting: ``"stored"`` (jmem's real bytes) or ``"nominal"`` (textbook tables);
        see the module docstring.
      state_block_size: override the quantization block of 8-/4-bit optimizer states.
      activations: fix the activation ledger to this many bytes (a budget) instead of
        computing it.
      **shape_kwargs: ``hidden_size``, ``num_layers``, ``intermediate_size``,
        ``num_heads``, ``num_kv_heads``, ``head_dim``, ``vocab_size``, ``tie_embeddings``
        for a model given as a parameter count.

    Returns:
      A :class:`Ledger` (bytes).

    Raises:
      ValueError: unknown optimizer, dtype, remat mode, offload mode, quantization,
        accounting, or inconsistent options (NF4 without LoRA, bad shard counts).
      TypeError: a model or LoRA spec of the wrong type.

    Sources: ZeRO (Rajbhandari et al. 2020) for the 2+2+12 bytes/param Adam ledger and the
    sharding stages; Micikevicius et al. 2017 (masters); Dettmers et al. 2022 (8-bit
    states), 2023 (QLoRA, NF4); Hu et al. 2021 (LoRA); Korthikanti et al. 2022 (activations).
    """
    if accounting not in ("stored", "nominal"):
        raise ValueError(f"accounting must be 'stored' or 'nominal'; got {accounting!r}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {optimizer!r}; choose from {sorted(OPTIMIZERS)}.")
    if offload not in _OFFLOAD:
        raise ValueError(
            f"offload must be False, 'optimizer' or 'optimizer+masters'; got {offload!r}."
        )
    if quantization not in (None, "none", "nf4"):
        raise ValueError(f"quantization must be None or 'nf4'; got {quantization!r}.")
    quantization = None if quantization == "none" else quantization
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int; got {num_shards!r}.")
    zero_without_shards = zero_stage not in (None, 0) and num_shards == 1
    if zero_stage is None:
        zero_stage = 3 if num_shards > 1 else 0
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3; got {zero_stage!r}.")
    spec = _lora_spec(lora)
    if quantization and spec is None:
        raise ValueError(
            "quantization='nf4' freezes the base weights; pass lora=(rank, targets) "
            "for the trainable adapters (QLoRA)."
        )
    count_given = (isinstance(model, (int, float)) and not isinstance(model, bool)) or (
        isinstance(model, str) and model not in MODEL_SHAPES
    )
    if shape_kwargs and not count_given:
        raise ValueError(
            f"Shape keywords {sorted(shape_kwargs)} apply only to a model given as "
            "a parameter count; for a config, change the config instead."
        )
    shape, n = resolve_shape(model, **shape_kwargs)

    P = _dtype_bytes(param_dtype, "param_dtype")
    if P < 2:
        raise ValueError(
            f"param_dtype={param_dtype!r}: trained weights must be fp32, bf16 or fp16. For "
            f"frozen 4-bit base weights use quantization='nf4' with lora=(rank, targets) "
            f"(QLoRA); FP8 matmuls (jmem.fp8) keep the weights in bf16/fp32."
        )
    G = _dtype_bytes(grad_dtype, "grad_dtype") if grad_dtype is not None else P
    act_dtype = activation_dtype if activation_dtype is not None else param_dtype
    if master_weights is None:
        master_weights = P < 4
    opt = OPTIMIZERS[optimizer]
    S = _state_bytes_per_param(opt, accounting, state_block_size)
    notes: list[str] = []
    detail: dict[str, int] = {}
    if opt.bits < 32:
        notes.append(
            "not counted: float32 transients of the quantized update, one group of "
            "tensors or one chunk at a time (jmem.optimizers: about 8 bytes x "
            "chunk_size=2**24 elements, ~128 MiB)"
        )

    if spec is None:
        trainable = n
        params = n * P
        grads = n * G
        state = n * S
        if accounting == "stored" and opt.bits < 32 and not count_given:
            # jmem.optimizers (as bitsandbytes) keeps fp32 moments for leaves < 4096 elements.
            small = sum(x for x in shape.leaf_sizes() if x < _MIN_QUANTIZED_SIZE)
            state += small * (opt.states * 4 - S)
        masters = n * 4 if master_weights else 0
    else:
        rank, targets = spec
        lin = shape.linear_shapes()
        trainable = shape.num_layers * rank * sum(sum(lin[t]) for t in targets)
        AD = _dtype_bytes(adapter_dtype, "adapter_dtype")
        if quantization == "nf4":
            if accounting == "nominal":
                nf4 = 0.5
            else:
                nf4 = (4 + 8 / 64 + 32 / (64 * 256)) / 8 if double_quant else (4 + 32 / 64) / 8
            q_n = n if (count_given or quantize_embeddings) else shape.linear_params
            if quantize_embeddings and not count_given:
                q_n = shape.linear_params + shape.embedding_params
            base = q_n * nf4 + (n - q_n) * P
            notes.append(
                f"NF4 base at {nf4:.4g} B/weight over {q_n / 1e9:.3g}B weights"
                + (
                    ""
                    if q_n == n
                    else f"; {(n - q_n) / 1e6:.4g}M embedding/norm weights stay {param_dtype}"
                )
            )
            notes.append(
                "a layer's weights are dequantized to the compute dtype during its "
                "matmuls (transient, not counted)"
            )
        else:
            base = n * P
        adapter_master = 4 if (accounting == "nominal" or (master_weights and AD < 4)) else 0
        detail.update(
            {
                "base:params": int(base),
                "lora:params": trainable * AD,
                "lora:grads": trainable * AD,
                "lora:optimizer_state": int(trainable * S),
                "lora:master_weights": trainable * adapter_master,
            }
        )
        params = base + trainable * AD
        grads = trainable * AD
        state = trainable * S
        masters = trainable * adapter_master
        notes.append(
            f"LoRA r={rank} on {', '.join(targets)}: {trainable / 1e6:.4g}M adapter "
            "params; activations counted as for full fine-tuning (an upper bound)"
        )

    # ZeRO sharding of the state ledgers.
    k = num_shards
    if k > 1:
        div = lambda x: math.ceil(x / k)
        if zero_stage >= 1:
            state, masters = div(state), div(masters)
        if zero_stage >= 2:
            grads = div(grads)
        if zero_stage >= 3:
            params = div(params)
            layer = sum(i * o for i, o in shape.linear_shapes().values()) * P
            notes.append(
                f"ZeRO-3 gathers one layer's weights at a time (~{layer / GB:.3g} GB, "
                "twice with prefetch; not counted)"
            )
        notes.append(f"ZeRO-{zero_stage} over {k} shards")
    elif zero_without_shards:
        notes.append(
            f"ZeRO-{zero_stage} over 1 shard divides nothing; pass num_shards "
            "(CLI: --shards) for the number of devices"
        )

    host: dict[str, int] = {}
    moved = _OFFLOAD[offload]
    if "optimizer_state" in moved:
        host["optimizer_state"], state = int(state), 0
    if "master_weights" in moved:
        host["master_weights"], masters = int(masters), 0

    if activations is not None:
        act = int(activations)
        detail["activation:budget"] = act
    else:
        parts = activation_bytes(
            shape, batch_size=batch_size, seq_len=seq_len, activation_dtype=act_dtype, remat=remat
        )
        act = parts["layers"] + parts["recompute"] + parts["logits"] + parts["other"]
        detail.update({f"activation:{k_}": v for k_, v in parts.items() if v})
        if parts["host_activations"]:
            host["activations"] = parts["host_activations"]
        if count_given:
            notes.append(
                f"activations from the shape h={shape.hidden_size}, "
                f"L={shape.num_layers}, F={shape.intermediate_size}, "
                f"V={shape.vocab_size}"
            )

    config = {
        "model": shape.name or (f"{n / 1e9:.3g}B" if count_given else "config"),
        "param_dtype": param_dtype,
        "optimizer": optimizer,
        "remat": remat,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "offload": offload,
        "lora": spec,
        "quantization": quantization,
        "num_shards": k if k > 1 else None,
        "accounting": accounting if accounting != "stored" else None,
    }
    return Ledger(
        params=int(round(params)),
        grads=int(round(grads)),
        optimizer_state=int(round(state)),
        master_weights=int(round(masters)),
        activations=int(act),
        host=host,
        n_params=int(n),
        trainable_params=int(trainable),
        detail=detail,
        notes=tuple(notes),
        config=config,
    )


# -------------------------------------------------------------------------- answers


_MEM_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(memory: Any) -> int:
    """Bytes from ``24e9``, ``"24GB"`` (1e9), ``"24GiB"`` (2**30), ``"80G"``, ``"512MiB"``.

    Raises:
      ValueError: for an unparsable string or a non-positive amount.
    """
    if isinstance(memory, bool):
        raise TypeError("memory must be a number of bytes or a string like '24GB'.")
    if isinstance(memory, (int, float)):
        value = float(memory)
    elif isinstance(memory, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", memory)
        if not m or m.group(2).lower() not in _MEM_UNITS:
            raise ValueError(
                f"Cannot read memory {memory!r}; write e.g. '24GB', '24GiB', "
                "'80G' or a number of bytes."
            )
        value = float(m.group(1)) * _MEM_UNITS[m.group(2).lower()]
    else:
        raise TypeError(
            f"memory must be bytes or a string like '24GB'; got {type(memory).__name__}."
        )
    if value <= 0:
        raise ValueError(f"memory must be positive; got {memory!r}.")
    if isinstance(memory, str) and not re.search(r"[A-Za-z]", memory) and value < 2**20:
        raise ValueError(
            f"memory {memory!r} has no unit and is under 1 MiB; write e.g. "
            f"'{memory}GB' or '{memory}GiB' (a bare number means bytes)."
        )
    return int(value)


def _bisect(fits, lo: int, hi: int) -> int:
    """Largest x in [lo, hi] with fits(x), assuming monotone; lo - 1 if none."""
    if not fits(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_model(
    memory: Any, *, activation_budget: float | None = 6e9, reserve: float = 2e9, **config
) -> int:
    """Largest parameter count whose training step fits in ``memory``.

    Constraint: ``static(N) + activations + reserve <= memory``, with activations either
    the fixed ``activation_budget`` (bytes) or, when it is ``None``, computed for
    :func:`standard_shape` ``(N)`` at the given ``batch_size``/``seq_len``/``remat``.

    Example (nominal accounting, 24 GB, 6 GB activations, 2 GB reserve): mixed-precision
    Adam 16 N <= 16 GB gives 1.0e9; 8-bit states 10 N gives 1.6e9; 8-bit with the moments
    offloaded 8 N gives 2.0e9.

    Args:
      memory: device bytes or a string (see :func:`parse_memory`).
      activation_budget: bytes set aside for activations, or None to compute them.
      reserve: bytes left for fragmentation, workspace and the runtime.
      **config: keywords of :func:`estimate` (``optimizer``, ``offload``, ...).

    Returns:
      Parameters (int); 0 if nothing fits.

    Raises:
      ValueError: as :func:`estimate`, or if ``config`` names a ``model``.
    """
    if "model" in config:
        raise ValueError("largest_model searches over the parameter count; do not pass model.")
    mem = parse_memory(memory)

    def fits(n: int) -> bool:
        if n < 1:
            return True
        kw = dict(config)
        if activation_budget is not None:
            kw["activations"] = int(activation_budget)
        return estimate(n, **kw).total + reserve <= mem

    return max(0, _bisect(fits, 1, int(mem)))


def largest_batch(
    memory: Any, model: Any, *, reserve: float = 2e9, max_batch: int = 1 << 20, **config
) -> int:
    """Largest per-device ``batch_size`` (sequences) whose step fits in ``memory - reserve``.

    Returns 0 when even one sequence does not fit. ``config``: keywords of :func:`estimate`.

    Raises:
      ValueError: as :func:`estimate`.
    """
    mem = parse_memory(memory)
    config.pop("batch_size", None)
    return max(
        0,
        _bisect(
            lambda b: estimate(model, batch_size=b, **config).total + reserve <= mem, 1, max_batch
        ),
    )


def largest_seq_len(
    memory: Any,
    model: Any,
    *,
    reserve: float = 2e9,
    multiple_of: int = 1,
    max_seq_len: int = 1 << 22,
    **config,
) -> int:
    """Largest ``seq_len`` (a multiple of ``multiple_of``) whose step fits; 0 if none.

    Raises:
      ValueError: as :func:`estimate`.
    """
    mem = parse_memory(memory)
    config.pop("seq_len", None)
    m = int(multiple_of)
    if m < 1:
        raise ValueError(f"multiple_of must be >= 1; got {multiple_of!r}.")
    k = _bisect(
        lambda j: estimate(model, seq_len=j * m, **config).total + reserve <= mem,
        1,
        max(1, max_seq_len // m),
    )
    return max(0, k) * m


@dataclasses.dataclass(frozen=True)
class Lever:
    """One way to cut memory: the estimate after applying it and what it costs."""

    name: str
    cost: str
    changes: Mapping[str, Any]
    total: int
    fits: bool


@dataclasses.dataclass(frozen=True)
class Advice:
    """Verdict of :func:`advise` (bytes).

    Attributes:
      fits: ``ledger.total + reserve <= memory``.
      short: ``None`` when it fits, ``"states"`` when the model state alone (params, grads,
        optimizer, masters) does not fit, else ``"activations"``.
      short_by: bytes missing (0 when it fits).
      levers: options ordered by cost (cheapest first), each applied alone, with its
        new total.
      plan: levers applied cumulatively in cost order (states first, then activations)
        until the configuration fits; ``plan_total`` is the total after the last one
        (the plan is empty when it fits already; it may end short of fitting).
    """

    fits: bool
    short: str | None
    short_by: int
    memory: int
    reserve: int
    ledger: Ledger
    levers: tuple[Lever, ...]
    plan: tuple[Lever, ...] = ()

    def __str__(self) -> str:
        avail = self.memory - self.reserve
        lines = [str(self.ledger), ""]
        if self.fits:
            lines.append(
                f"verdict: FITS: {self.ledger.total / GB:.2f} GB of {avail / GB:.2f} GB "
                f"usable ({self.memory / GB:.3g} GB - {self.reserve / GB:.3g} GB reserve)"
            )
        else:
            lines.append(
                f"verdict: DOES NOT FIT: {self.ledger.total / GB:.2f} GB > {avail / GB:.2f} GB "
                f"usable; short by {self.short_by / GB:.2f} GB in the {self.short} ledger(s)"
            )
        if self.levers:
            lines.append("levers, cheapest first:")
            for i, lv in enumerate(self.levers, 1):
                mark = "fits" if lv.fits else "still short"
                lines.append(f"  {i}. {lv.name}: {lv.total / GB:.2f} GB ({mark}); cost: {lv.cost}")
        if self.plan:
            lines.append("cumulative plan:")
            for lv in self.plan:
                lines.append(f"  + {lv.name}: {lv.total / GB:.2f} GB")
            lines.append("  => fits" if self.plan[-1].fits else "  => still does not fit")
        return "\n".join(lines)


def advise(memory: Any, model: Any, *, reserve: float = 2e9, **config) -> Advice:
    """Does ``model`` train in ``memory``? If not, which ledger is short and what helps.

    States short (params + grads + optimizer + masters + reserve > memory): remat cannot
    help; levers in cost order are 8-bit optimizer states, 4-bit states, offloading the
    moments, offloading the masters too, ZeRO sharding over the fewest devices that fit,
    and LoRA / QLoRA (changes what is trained). Activations short: gradient accumulation
    (smaller micro-batch, same math), selective then full remat (a few % / ~33% more
    FLOPs), activation offload, shorter sequences.

    Args:
      memory: device bytes or a string (``"24GB"``).
      model: as in :func:`estimate`.
      reserve: bytes kept free (fragmentation, workspace, runtime).
      **config: keywords of :func:`estimate`.

    Returns:
      An :class:`Advice`; ``str(advice)`` prints the table and verdict.

    Raises:
      ValueError: as :func:`estimate`.
    """
    mem = parse_memory(memory)
    reserve = int(reserve)
    if reserve < 0 or reserve >= mem:
        raise ValueError(
            f"reserve ({reserve} bytes) must be >= 0 and below the memory ({mem} "
            "bytes); did you forget a unit, e.g. '24GB'?"
        )
    led = estimate(model, **config)
    avail = mem - reserve
    fits = led.total <= avail
    if fits:
        return Advice(True, None, 0, mem, reserve, led, ())
    short = "states" if led.static > avail else "activations"
    cands: list[tuple[str, str, dict]] = []
    opt = config.get("optimizer", "adamw")
    trainable_full = config.get("lora") is None
    if short == "states":
        if opt in ("adamw", "adam"):
            cands.append(
                (
                    "8-bit optimizer states",
                    "a few quantize/dequantize kernels per step",
                    {"optimizer": opt + "_8bit"},
                )
            )
            cands.append(
                (
                    "4-bit optimizer states",
                    "more quantization error than 8-bit",
                    {"optimizer": opt + "_4bit"},
                )
            )
        if config.get("offload") in (None, False):
            cands.append(
                (
                    "offload optimizer state to host",
                    "host<->device copies of the moments every step (PCIe-bound)",
                    {"offload": "optimizer"},
                )
            )
        if config.get("offload") != "optimizer+masters":
            cands.append(
                (
                    "offload optimizer state and masters to host",
                    "more PCIe traffic: moments and fp32 masters every step",
                    {"offload": "optimizer+masters"},
                )
            )
        base_k = config.get("num_shards", 1)
        for k in (2, 4, 8, 16, 32, 64):
            if k > base_k and estimate(model, **{**config, "num_shards": k}).total <= avail:
                cands.append(
                    (
                        f"ZeRO-3 sharding over {k} devices",
                        f"{k} devices; ~1.5x the all-reduce traffic",
                        {"num_shards": k},
                    )
                )
                break
        if trainable_full:
            cands.append(
                (
                    "LoRA r=8 on q/v (frozen base)",
                    "trains adapters only, not the full model",
                    {"lora": (8, ("q_proj", "v_proj"))},
                )
            )
            cands.append(
                (
                    "QLoRA: NF4 base + LoRA r=8",
                    "adapters only; 4-bit base dequantized per matmul",
                    {"lora": (8, ("q_proj", "v_proj")), "quantization": "nf4"},
                )
            )
    else:
        b = config.get("batch_size", 1)
        if b > 1:
            cands.append(
                (
                    f"gradient accumulation ({b} micro-batches of 1)",
                    "same math, more sequential steps",
                    {"batch_size": 1},
                )
            )
        order = ["selective", "full", "offload"]
        cur = config.get("remat") or "none"
        costs = {
            "selective": "a few % more FLOPs (recompute attention and element-wise ops)",
            "full": "~33% more FLOPs (recompute each layer's forward)",
            "offload": "host<->device copies of the saved residuals",
        }
        for r in order:
            if REMAT_MODES.index(r) > REMAT_MODES.index(cur):
                cands.append((f"remat '{r}'", costs[r], {"remat": r}))
        s = config.get("seq_len", 2048)
        if s > 256:
            cands.append(
                (
                    f"shorter sequences ({s // 2})",
                    "changes the training data layout",
                    {"seq_len": s // 2},
                )
            )
    levers = []
    for name, cost, changes in cands:
        try:
            t = estimate(model, **{**config, **changes}).total
        except ValueError:
            continue
        if t >= led.total:  # a lever that saves nothing here is no advice
            continue
        levers.append(Lever(name, cost, changes, t, t <= avail))
    return Advice(
        False,
        short,
        led.total - avail,
        mem,
        reserve,
        led,
        tuple(levers),
        _plan(model, config, avail),
    )


def _more_shards(k: int, config: dict) -> dict | None:
    """The lever "ZeRO-3 over k devices": None when the config already has as many."""
    return {"num_shards": k} if config.get("num_shards", 1) < k else None


def _plan(model: Any, config: dict, avail: int) -> tuple[Lever, ...]:
    """Greedy cumulative plan: cheapest lever that lowers the total, until it fits."""
    steps = [
        (
            "8-bit optimizer states",
            "quantize/dequantize kernels",
            lambda c: (
                {"optimizer": c.get("optimizer", "adamw") + "_8bit"}
                if c.get("optimizer", "adamw") in ("adamw", "adam")
                else None
            ),
        ),
        (
            "gradient accumulation (micro-batch 1)",
            "more sequential steps",
            lambda c: {"batch_size": 1} if c.get("batch_size", 1) > 1 else None,
        ),
        (
            "remat 'selective'",
            "a few % FLOPs",
            lambda c: (
                {"remat": "selective"} if (c.get("remat") or "none") in ("none", "dots") else None
            ),
        ),
        (
            "offload optimizer state",
            "PCIe copies of the moments",
            lambda c: {"offload": "optimizer"} if c.get("offload") in (None, False) else None,
        ),
        (
            "remat 'full'",
            "~33% FLOPs",
            lambda c: (
                {"remat": "full"}
                if (c.get("remat") or "none") in ("none", "dots", "selective")
                else None
            ),
        ),
        (
            "offload masters too",
            "PCIe copies of the masters",
            lambda c: {"offload": "optimizer+masters"} if c.get("offload") == "optimizer" else None,
        ),
    ] + [
        (
            f"ZeRO-3 over {k} devices",
            f"{k} devices",
            functools.partial(_more_shards, k),
        )
        for k in (2, 4, 8, 16, 32, 64)
    ]
    cfg, plan = dict(config), []
    total = estimate(model, **cfg).total
    for name, cost, change in steps:
        if total <= avail:
            break
        ch = change(cfg)
        if not ch:
            continue
        new = {**cfg, **ch}
        t = estimate(model, **new).total
        if t < total:
            cfg, total = new, t
            plan.append(Lever(name, cost, ch, t, t <= avail))
    return tuple(plan)
