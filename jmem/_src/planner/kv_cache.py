"""The KV-cache ledger and the device peak of a GRPO rollout's generation phase: the weights
as stored (NF4 base and adapters), the keys and values of every layer for a generation
micro-batch of prompt + completion tokens, and the compiler's other buffers (one layer's
dequantized weights, attention over the cache, the prefill, the per-step logits). Formula
and calibration are in ``docs/planner.md`` ("The GRPO phases").
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Mapping

from jmem._src import dtypes as _dtypes
from jmem._src import levers as _levers
from jmem._src import model_table
from jmem._src.measure import format_bytes
from jmem._src.planner.estimate import estimate
from jmem._src.planner.offload import Offload
from jmem._src.planner.shapes import ModelShape
from jmem._src.planner.shapes import is_count
from jmem._src.planner.shapes import resolve_shape
from jmem._src.units import GiB

__all__ = [
    "GENERATION_TERMS",
    "GenerationTerms",
    "Phase",
    "generation_phase",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "layer_windows",
]


@dataclasses.dataclass(frozen=True)
class GenerationTerms:
    """The constants of the generation phase's buffers for one compiler (multiples of the
    named arrays' bytes).

    Attributes:
      compiler: ``"cpu"`` (XLA:CPU) or ``"gpu"`` (XLA:GPU).
      cache_copies: KV caches live at once: the one the layer scan reads and the one it
        writes (XLA:CPU adds float32 copies of the bf16 keys and values it attends over).
      layer_weights: one layer's linear weights at the compute dtype (NF4 dequantized for
        the matmuls).
      attention_per_token: per cache token, ``nH D A`` bytes (one layer's keys and values
        at the query heads, attended over; not per row).
      prefill_per_token: per prefill token (``rows x prompt``), ``H A`` bytes.
      logits_copies: float32 ``[rows, V]`` logits live at once (raw, warped, log-softmax).
      source: what the constants were fitted to.
    """

    compiler: str
    cache_copies: float
    layer_weights: float
    attention_per_token: float
    prefill_per_token: float
    logits_copies: float
    source: str


#: XLA:GPU: fitted to h100_sxm compiles of ``llama.rollout``'s micro-batch program
#: (Llama-3.1-8B, NF4 + LoRA, 1-4 rows, 16-4,096 prompt and 1,024-19,456 completion tokens;
#: ``benchmarks/grpo_memory.py``): the layer scan writes a second cache next to the one it
#: reads.
GPU_GENERATION = GenerationTerms(
    "gpu", 2.0, 0.36, 1.5, 1.0, 3.0, "XLA:GPU compiles for h100_sxm of the 8B rollout"
)
#: XLA:CPU: fitted to compiles of the tiny preset's rollout (1-8 rows, 16-64 prompt and
#: 64-512 completion tokens): float32 copies of the bf16 cache as well.
CPU_GENERATION = GenerationTerms(
    "cpu", 4.0, 1.0, 2.0, 4.0, 6.0, "XLA:CPU compiles of the tiny preset's rollout"
)
GENERATION_TERMS = {"cpu": CPU_GENERATION, "gpu": GPU_GENERATION}


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of a GRPO step as the planner sees it (bytes, ints).

    Attributes:
      name: ``"generation"`` (the rollout of one micro-batch) or ``"training"``.
      total: the device peak of the phase.
      parts: its terms by name (``weights``, ``kv_cache``, ``other`` for generation;
        ``sft``, the SFT ledger's total, and ``grpo_extras`` for training).
      config: the sizes it was computed for (rows, tokens, remat, ...).
      notes: assumptions.
    """

    name: str
    total: int
    parts: Mapping[str, int]
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def line(self) -> str:
        """``generation: rows=2, tokens=1024+19456: device 16.02 GiB (weights ...)``: one line,
        beginning with the phase's name."""
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items() if v is not None)
        parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.parts.items())
        return f"{self.name}: {cfg}: device {format_bytes(self.total)} ({parts})"


def layer_windows(model: Any) -> tuple[int | None, ...]:
    """Per layer, the tokens its keys and values are attended over at most: the sliding
    window of a ``"sliding_attention"`` layer (or of every layer when ``layer_types`` is
    None and ``sliding_window`` is set), None for full attention. ``model``: a
    ``LlamaConfig``-like object, a preset name, a ``ModelShape`` or a count (no windows
    known: every layer None)."""
    if isinstance(model, ModelShape) and model.name in model_table.PRESETS:
        model = model.name
    if isinstance(model, str) and model in model_table.PRESETS:
        fields = model_table.preset_fields(model)
        get, layers = fields.get, fields["num_layers"]
    elif isinstance(model, (ModelShape, str)) or is_count(model):
        return (None,) * resolve_shape(model)[0].num_layers
    else:
        get, layers = (lambda k: getattr(model, k, None)), model.num_layers
    window, types = get("sliding_window"), get("layer_types")
    if types is None:
        return (window,) * layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def kv_bytes_per_token(model: Any, dtype: Any = "bf16") -> int:
    """Bytes of one token's keys and values in one layer: ``2 x num_kv_heads x head_dim x
    A`` (``A``: ``dtype``'s bytes; grouped-query attention stores the KV heads only).

    Raises:
      ValueError: an unknown model or dtype (``resolve_shape``, ``dtypes.itemsize``)."""
    shape = resolve_shape(model)[0]
    return 2 * shape.num_kv_heads * shape.head_dim * _dtypes.itemsize(dtype, "cache dtype")


def kv_cache_bytes(
    model: Any, *, rows: int, tokens: int, dtype: Any = "bf16", capped: bool = False
) -> int:
    """Bytes of a KV cache: ``rows x sum over layers of min(tokens, window) x
    kv_bytes_per_token``.

    Args:
      model: a ``LlamaConfig``, a preset name, a ``ModelShape`` or a count.
      rows: the generation micro-batch (sequences decoded together).
      tokens: the cache's length per row (prompt + completion).
      dtype: the cache's dtype (the compute dtype).
      capped: sliding-window layers hold only their window (``layer_windows``); False is
        what ``llama.rollout`` allocates: every layer at ``tokens``.

    Raises:
      ValueError: non-positive ``rows`` or ``tokens``, or as ``kv_bytes_per_token``.

    Source: the cache layout ``[L, rows, tokens, nKV, D]`` of ``jmem.models.llama``'s
    ``rollout``; vLLM's per-token KV accounting (``2 L nKV D A``).
    """
    if rows < 1 or tokens < 1:
        raise ValueError(f"rows and tokens must be >= 1; got {rows}, {tokens}.")
    per = kv_bytes_per_token(model, dtype)
    windows = layer_windows(model)
    if not capped:
        windows = (None,) * len(windows)
    return rows * per * sum(tokens if w is None else min(tokens, w) for w in windows)


def _weights(model: Any, lora: Any, quantization: Any, options: Mapping[str, Any]):
    """``(weights, state, trainable)``: the weights as stored (``estimate``'s params ledger:
    the NF4 base and the adapters), with an ``optimizer`` the training state that stays on
    the device during the rollout (its optimizer state and masters, unless offloaded), and
    the count of trained weights. The base counts on the device with the params rung
    (``offload="params"``) too: the rollout reads every layer's weights at every token, and
    ``llama.rollout`` does not stream them."""
    kw = {k: v for k, v in options.items() if v is not None}
    optimizer = kw.pop("optimizer", None)
    if optimizer is not None:
        kw["optimizer"] = optimizer
    if kw.get("offload") is not None:
        kw["offload"] = dataclasses.replace(Offload.parse(kw["offload"]), params=False)
    led = estimate(
        model, lora=lora, quantization=quantization, batch_size=1, seq_len=1, activations=0, **kw
    )
    state = led.optimizer_state + led.master_weights if optimizer is not None else 0
    return led.params, state, led.trainable_params


def _other(shape: ModelShape, terms: GenerationTerms, rows: int, prompt: int, T: int, A: int):
    """The compiler's other buffers of the generation phase (``GenerationTerms``), bytes."""
    layer = sum(i * o for i, o in shape.linear_shapes().values()) * A
    attn = terms.attention_per_token * T * shape.num_heads * shape.head_dim * A
    prefill = terms.prefill_per_token * rows * prompt * shape.hidden_size * A
    logits = terms.logits_copies * rows * shape.vocab_size * 4
    return int(terms.layer_weights * layer + attn + prefill + logits)


def generation_phase(
    model: Any,
    *,
    generation_batch: int,
    max_prompt_len: int,
    max_completion_len: int,
    lora: Any = None,
    quantization: str | None = None,
    param_dtype: Any = "bf16",
    adapter_dtype: Any = "fp32",
    activation_dtype: Any = None,
    double_quant: bool = True,
    quantize_embeddings: bool = False,
    optimizer: str | None = None,
    offload: Any = None,
    target: Any = None,
) -> Phase:
    """The device peak of one rollout micro-batch (``llama.rollout``'s program: the prefill,
    then the decoding loop over a KV cache of ``prompt + completion`` tokens).

    ``total = weights + state + adapter_copy + c x kv_cache_bytes(rows, P + C) + other``:
    the weights as stored (``estimate``'s params: the NF4 base and the adapters), the
    optimizer state and masters that stay on the device between training steps and the
    adapters cast to the compute dtype for sampling (both with ``optimizer``), ``c`` caches live at once
    (``GenerationTerms.cache_copies``: the layer scan reads one and writes the next), and the
    compiler's other buffers (one layer's dequantized weights, attention over the cache, the
    prefill's hidden states, the float32 ``[rows, V]`` logits and their sampling
    temporaries), with the constants of the target's compiler (``GENERATION_TERMS``).

    Args:
      model: a ``LlamaConfig``, a preset name, a ``ModelShape`` or a count.
      generation_batch: rows decoded together (the micro-batch).
      max_prompt_len, max_completion_len: tokens per prompt (left-padded) and completion.
      lora, quantization, param_dtype, adapter_dtype, double_quant, quantize_embeddings: as
        ``estimate`` (the weights: ``lora=(rank, targets)``, ``quantization="nf4"``).
      activation_dtype: the cache and compute dtype (default ``param_dtype``).
      optimizer, offload: the training state resident during the rollout (``estimate``'s
        optimizer and offload rungs; None: the weights only).
      target: the compile target whose compiler's constants apply (None: the running
        backend).

    Returns:
      a ``Phase`` named ``"generation"`` (bytes).

    Raises:
      ValueError: non-positive sizes, or as ``estimate``.

    Source: the buffers of XLA's compiles of ``llama.rollout`` (``docs/planner.md``).
    """
    for name, v in (
        ("generation_batch", generation_batch),
        ("max_prompt_len", max_prompt_len),
        ("max_completion_len", max_completion_len),
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1; got {v!r}.")
    shape = resolve_shape(model)[0]
    act = activation_dtype if activation_dtype is not None else param_dtype
    A = _dtypes.itemsize(act, "activation_dtype")
    terms = GENERATION_TERMS["gpu" if _levers._platform(target)[1] == "gpu" else "cpu"]  # noqa: SLF001
    T = max_prompt_len + max_completion_len
    options = dict(
        param_dtype=param_dtype,
        adapter_dtype=adapter_dtype,
        double_quant=double_quant,
        quantize_embeddings=quantize_embeddings,
        optimizer=optimizer,
        offload=offload,
    )
    weights, state, trainable = _weights(model, lora, quantization, options)
    # the job samples with the adapters cast to the compute dtype, beside their state
    copy = trainable * A if optimizer is not None and lora is not None else 0
    cache = kv_cache_bytes(model, rows=generation_batch, tokens=T, dtype=act)
    kv = int(terms.cache_copies * cache)
    other = _other(shape, terms, generation_batch, max_prompt_len, T, A)
    notes = [
        f"KV cache {cache / GiB:.3g} GiB: {generation_batch} rows x {T:,} tokens x "
        f"{kv_bytes_per_token(model, act) * shape.num_layers:,} B per token "
        f"(2 x {shape.num_kv_heads} KV heads x {shape.head_dim} x {A} B x "
        f"{shape.num_layers} layers), {terms.cache_copies:g} live ({terms.source})"
    ]
    capped = kv_cache_bytes(model, rows=generation_batch, tokens=T, dtype=act, capped=True)
    if capped < cache:
        notes.append(
            f"sliding-window layers could hold their window only ({capped / GiB:.3g} GiB); "
            "jmem's rollout allocates every layer at the full length"
        )
    config = {"rows": generation_batch, "tokens": f"{max_prompt_len}+{max_completion_len}"}
    parts = {"weights": weights, "state": state, "adapter_copy": copy, "kv_cache": kv}
    parts = {k: v for k, v in parts.items() if v or k in ("weights", "kv_cache")}
    parts["other"] = other
    return Phase("generation", sum(parts.values()), parts, config, tuple(notes))
