"""Activation bytes of a Llama training step under each remat mode.

Per-layer residuals as read off ``jax.ad_checkpoint.print_saved_residuals`` of
``jmem.models.llama.loss_fn`` (after Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"); the derivation is in ``docs/planner.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jmem._src import dtypes as _dtypes
from jmem._src import grouped_matmul as _gmm
from jmem._src.attention import pick_implementation
from jmem._src.names import REMAT_NAMES
from jmem._src.planner.shapes import ModelShape

__all__ = [
    "COMPILER_TERMS",
    "CPU_TERMS",
    "GPU_TERMS",
    "REMAT_MODES",
    "CompilerTerms",
    "activation_bytes",
    "compiler_terms",
    "is_long_context",
    "moe_layer_bytes",
]

#: Remat modes (``jmem.REMAT_POLICIES``' names), from most to least memory.
REMAT_MODES = REMAT_NAMES


@dataclasses.dataclass(frozen=True)
class CompilerTerms:
    """The constants of the long-context activation model for one compiler, in bytes.

    Attributes:
      compiler: ``"cpu"`` (XLA:CPU) or ``"gpu"`` (XLA:GPU).
      layer_work_per_token_h: what one layer's backward pass holds beyond its saved input,
        per token and hidden unit (bf16 hidden-sized arrays: the layer input, q/k/v, the
        attention output, the residual and their gradients; on XLA:CPU float32 copies).
      mlp_work_per_token_f: per chunk token (``min(t, token_chunk)``) and intermediate unit:
        one chunk's ``[chunk, F]`` MLP buffers.
      layer_weight_bytes: per linear weight of one layer: its NF4 weights dequantized to
        the compute dtype for the chunk loops (XLA:GPU keeps them live across a layer).
      loss_chunk_buffers: float32 ``[loss_chunk, V]`` buffers live at once in the chunked
        loss's backward pass.
      loss_work_per_token_h: the loss phase's per-token bytes per hidden unit (the final
        hidden states and their gradient).
      tied_head_copies: copies of a tied embedding (``A V h`` bytes each) the loss phase
        holds (XLA:GPU: the head as the embedding's transpose, and part of another).
      saved_copy: how many layers' worth of the saved residuals the layer phase holds
        beyond the saved stack (XLA:GPU: the layer's input being written into, or read
        from, the stack; none with the inputs offloaded).
      source: what the constants were fitted to.
      unrolled_weight_copies: copies of the layer stack's stored weights (``layer_param_bytes``:
        the packed NF4 layers of a QLoRA base) that ``remat="none"`` holds: the job
        inlines the layer loop under ``none`` (``scan_unroll``) and XLA:GPU slices each
        layer's weights out of the stacked arrays into buffers kept until that layer's
        backward (1 on XLA:GPU; 0 on XLA:CPU: not measured there).
      unrolled_blockwise_per_pair: under ``remat="none"`` with blockwise attention, bytes
        per layer and query-key pair (``b s^2``) the inlined layers hold beyond their
        saved residuals (XLA:GPU: fitted, not read off its buffers; 0 on XLA:CPU).
      offload_mlp_per_token_f: under ``remat="offload"``, which the job runs without
        token chunks (``jmem.resolve_levers``), the layer phase's bytes per token and
        intermediate unit instead of ``mlp_work_per_token_f`` per chunk token: the whole
        ``[t, F]`` gate and up read back from host and the SwiGLU backward's bf16
        temporaries (XLA:GPU; None: ``mlp_work_per_token_f``, XLA:CPU, not measured).
    """

    compiler: str
    layer_work_per_token_h: float
    mlp_work_per_token_f: float
    layer_weight_bytes: float
    loss_chunk_buffers: float
    loss_work_per_token_h: float
    tied_head_copies: float
    saved_copy: float
    source: str
    unrolled_weight_copies: float = 0
    offload_mlp_per_token_f: float | None = None
    unrolled_blockwise_per_pair: float = 0


#: XLA:CPU: fitted to the compiled peaks of the main job's dry run (Llama-3.1-8B, QLoRA
#: r=32, full remat, 2k-48k tokens and 2,048/4,096-token chunks, within 4%): XLA:CPU keeps
#: bf16 temporaries in float32, so the layer's hidden-sized arrays and the float32
#: ``[chunk, F]`` MLP buffers are the working set. See docs/long_context.md.
CPU_TERMS = CompilerTerms(
    "cpu", 22, 24, 0, 2.5, 0, 0, 0, "XLA:CPU compiles of the 8B QLoRA job, 2k-48k tokens"
)
#: XLA:GPU: fitted to the h100_sxm compiles of the same job (deviceless, no GPU;
#: ``benchmarks/gpu_calibration.py``, ``benchmarks/results/gpu_compile/calibration.json``:
#: 2k-128k tokens, full remat and offload_inputs, within 0.4%; twelve presets at 4k within
#: 10%, -8.4% to +5.1%). bf16 temporaries stay bf16 (13.1 h per token, plus the saved input
#: being written, instead of 22 h); the layer phase holds one layer's dequantized NF4
#: weights (counted for a bf16 base too: not fitted there) and about three float32
#: ``[chunk, F]`` buffers; the loss phase adds the final hidden states per token and a
#: tied embedding's head copy. See docs/planner.md.
GPU_TERMS = CompilerTerms(
    "gpu",
    13.1,
    12.4,
    2.3,
    1.84,
    4.1,
    1.6,
    1,
    "XLA:GPU compiles for h100_sxm of the 8B QLoRA job, 2k-128k tokens",
    unrolled_weight_copies=1,
    offload_mlp_per_token_f=9.2,
    unrolled_blockwise_per_pair=0.85,
)
COMPILER_TERMS = {"cpu": CPU_TERMS, "gpu": GPU_TERMS}

#: The XLA:CPU constants under their earlier names.
LAYER_WORK_PER_TOKEN_H = CPU_TERMS.layer_work_per_token_h
MLP_WORK_PER_TOKEN_F = CPU_TERMS.mlp_work_per_token_f
LOSS_CHUNK_BUFFERS = CPU_TERMS.loss_chunk_buffers


def compiler_terms(platform: str | None) -> CompilerTerms:
    """The terms for a compile platform: XLA:GPU's for ``"gpu"``, else XLA:CPU's (TPU is
    not calibrated: its step is modelled with XLA:CPU's terms)."""
    return GPU_TERMS if platform == "gpu" else CPU_TERMS


def _saved_per_token(shape: ModelShape, A: int, s: int, t: int) -> dict[str, int]:
    """Bytes one layer saves per token under each remat mode (``A``: activation itemsize;
    ``t``: tokens of the micro-batch).

    With blockwise attention (:func:`is_long_context`) no ``[S, T]`` array is saved: the
    score term ``A a s`` is its float32 log-sum-exp, ``4 a``. With the token-local parts in
    chunks (``mlp_chunk < t``) a chunk's internals are recomputed per chunk under every
    mode, so a layer keeps what crosses the chunks (``_chunked_saved_per_token``).
    """
    h, F, a = shape.hidden_size, shape.active_mlp_width, shape.num_heads
    qd, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    long = is_long_context(shape, s)
    if long and shape.mlp_chunk and shape.mlp_chunk < t:
        return _chunked_saved_per_token(shape, A)
    scores = 4 * a if long else A * a * s
    return {
        "none": 2 * (8 + A) * h + A * (2 * qd + 2 * kv) + scores + 6 * A * F,
        "dots": A * (2 * h + 2 * qd + 2 * kv + 2 * F) + scores,
        "selective": A * (2 * h + qd + 2 * kv + 2 * F),
        "full": A * h,
        "offload": 0,
        "offload_inputs": 0,
    }


def _chunked_saved_per_token(shape: ModelShape, A: int) -> dict[str, int]:
    """Bytes one layer saves per token with the token-local parts in chunks, as
    ``print_saved_residuals`` lists them for the job's step (``jmem.models.llama``'s two
    chunk loops around attention; ``docs/planner.md``). ``dots`` and ``selective``: the
    layer input and the first loop's outputs q, k, v (``A (h + qd + 2 kv)``), and with
    blockwise attention its output and float32 log-sum-exp, saved by name (``A qd + 4 a``;
    cuDNN's are recomputed). ``none``: the layer input, q, k, v, the attention output and
    its log-sum-exp (``A (h + 2 qd + 2 kv) + 4 a``; with cuDNN, XLA:GPU aliases the
    second loop's copy of the layer input and the context, a reshape of the output, to
    their first buffers); with blockwise attention the second loop's copies of the
    input and the context too (``A (h + qd)``; not counted: the float32 RoPE tables,
    ``4 D`` a token, that a model whose layers differ, as Gemma 2's, selects per layer)."""
    h, a = shape.hidden_size, shape.num_heads
    qd, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    crossing = A * (h + qd + 2 * kv)
    blockwise = shape.attention == "blockwise"
    named = A * qd + 4 * a if blockwise else 0
    none = A * (h + 2 * qd + 2 * kv) + 4 * a
    if blockwise:
        none += A * (h + qd)
    return {
        "none": none,
        "dots": crossing + named,
        "selective": crossing + named,
        "full": A * h,
        "offload": 0,
        "offload_inputs": 0,
    }


def _offloaded_per_token(shape: ModelShape, A: int) -> int:
    """Bytes one layer sends to host per token under ``offload``: its input and
    selective's residuals."""
    h, F = shape.hidden_size, shape.active_mlp_width
    qd, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return A * (2 * h + qd + 2 * kv + 2 * F)


def is_long_context(shape: ModelShape, seq_len: int) -> bool:
    """Whether ``shape``'s step holds no ``[S, T]`` scores at ``seq_len``: blockwise or
    cuDNN attention (``shape.attention`` as ``jmem.resolve_levers`` resolved it; an
    unresolved ``"auto"`` is taken as off the GPU, by ``jmem.ops.attention``'s rule)."""
    attention = shape.attention
    if attention == "auto":
        attention = pick_implementation("auto", "not resolved", seq_len)
    return attention != "dense"


def _long_context_parts(shape: ModelShape, b, s, terms: CompilerTerms, remat, A, moe=(0, 0)):
    """``recompute`` and ``logits`` of the long-context paths (no ``[S, T]`` scores, no
    ``[B, S, V]`` logits, no ``[B, S, F]`` MLP temporaries), with ``terms``' constants.
    The layer phase holds the layer input being written into (read from) the saved stack
    when ``remat`` keeps the inputs on the device (``saved_copy``); under ``offload`` its
    MLP term is ``offload_mlp_per_token_f`` per token. A routed layer's MLP is
    ``moe_layer_bytes`` (``moe``: its ``(stored, expert_lora)``) instead of the dense
    MLP's chunk buffers and weights."""
    t, h, V = b * s, shape.hidden_size, shape.vocab_size
    held = 0 if remat in ("offload", "offload_inputs") else terms.saved_copy * A * h
    m = min(t, shape.mlp_chunk) if shape.mlp_chunk else t
    f = terms.mlp_work_per_token_f
    if remat == "offload" and terms.offload_mlp_per_token_f is not None:
        f = terms.offload_mlp_per_token_f
    if shape.loss_chunk:
        logits = int(terms.loss_chunk_buffers * 4 * min(t, shape.loss_chunk) * V)
    else:
        logits = 2 * 4 * t * V
    logits += int(terms.loss_work_per_token_h * t * h)
    if shape.tie_embeddings:
        logits += int(terms.tied_head_copies * A * V * h)
    linear = shape.linear_shapes()
    if shape.num_experts:  # the MLP's names stand for the experts
        linear = {k: v for k, v in linear.items() if k not in _MLP_NAMES}
        mlp = moe_layer_bytes(shape, m, A, *moe, weight_bytes=terms.layer_weight_bytes)
    else:
        mlp = m * f * shape.active_mlp_width
    weights = terms.layer_weight_bytes * sum(i * o for i, o in linear.values())
    work = t * (terms.layer_work_per_token_h * h + held) + mlp + weights
    return {"recompute": int(work), "logits": logits}


_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def moe_layer_bytes(
    shape: ModelShape, m: int, A: int, stored: float = 0, expert_lora: int = 0, weight_bytes=0
) -> int:
    """One routed layer's MLP in its backward working set (0 without experts), for the ``m``
    tokens of one token chunk (the routed block runs inside the layer's token-chunk loop),
    as XLA:GPU's buffers at the layer's peak show them (Mixtral 8x7B and Qwen3-30B-A3B
    QLoRA, h100_sxm compiles; docs/planner.md, "Mixture of experts"). With ``rows = m k``
    (token, expert) pairs, ``tile = tile_rows(rows, E)`` and ``n`` the grouped matmul's
    static tile bound (``jmem._src.grouped_matmul``):

    * the tiled rows: three ``[n tile, H]`` and three ``[n tile, F_e]`` copies (the rows
      and their gradients placed into tiles, as the compiles hold them);
    * the expert hidden ``[rows, F_e]`` and its gradient;
    * each adapted expert projection's ``F_e``-side LoRA factor gathered per tile,
      ``[n, r, F_e]`` (``expert_lora``: the rank summed over the adapted projections);
    * the weights. NF4 experts (``stored``: bytes per stored expert weight): the layer's
      packed slice of its three ``[E, H, F_e]`` stacks, and one stack dequantized twice in
      the backward pass (the rematted forward's and the backward's copies of the same
      projection, which XLA fuses into one two-output fusion: two bf16 stacks and their
      4-bit codes unpacked to a byte each, ``2 (A + 1) E H F_e``). Unquantized experts
      (``stored`` 0; not measured): ``weight_bytes`` per weight of the three stacks (the
      dense layers' ``layer_weight_bytes``) and one cast stack ``A E H F_e``.
    """
    e, k, fe, h = shape.num_experts, shape.num_experts_per_tok, shape.expert_size, shape.hidden_size
    if not e:
        return 0
    rows = m * k
    tile = _gmm.tile_rows(rows, e)
    tiles = -(-(rows + e * (tile - 1)) // tile)
    stack = e * h * fe  # one projection's experts
    routed = 3 * A * tiles * tile * (h + fe) + 2 * A * rows * fe + A * tiles * expert_lora * fe
    if stored:
        weights = 3 * stored * stack + 2 * (A + 1) * stack
    else:
        weights = 3 * weight_bytes * stack + A * stack
    return int(routed + weights)


def activation_bytes(
    shape: ModelShape,
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    activation_dtype: Any = "bf16",
    remat: str | None = None,
    compiler: str = "cpu",
    layer_param_bytes: int = 0,
    expert_lora: int = 0,
) -> dict[str, int]:
    """Bytes of activations kept for the backward pass of one micro-batch, by part.

    ``layers``: the residuals the layer scan saves (per layer and token, ``none`` is
    ``2 (8 + A) h + A (2 qd + 2 kv) + A a s + 6 A F``; ``full`` keeps the layer
    input ``A h``); ``recompute``: the ``none`` residuals of one layer that the mode does not
    save, live while the backward pass recomputes them (so the total ranks the modes as
    their saved bytes do); ``logits``: fp32 logits and their gradient
    ``8 b s V``; ``other``: the embedding output and the causal mask ``5 b a s^2``;
    ``host_activations``: what ``offload`` keeps in host memory (each layer's input and
    selective's residuals). With the long-context paths (``shape.attention`` blockwise at
    this length, see :func:`is_long_context`) ``recompute`` is one layer's backward working
    set ``t (w h) + min(t, mlp_chunk) f F + c W`` bytes (``W``: one layer's linear
    weights; a routed layer's MLP and expert weights are ``moe_layer_bytes`` instead of
    the last two terms' MLP part), ``logits`` the chunked loss's ``k * 4 loss_chunk V + l t h``, there is no
    mask, and ``phased`` is 1: the loss and the layers' backward pass run one after the
    other, so the step holds the larger of the two. With the token-local parts in chunks
    ``layers`` counts what crosses the chunks under each mode (``docs/planner.md``, "Every
    remat policy on the GPU compiler"). The constants are the compiler's
    (:class:`CompilerTerms`): XLA:CPU's ``w=22, f=24, c=0, k=2.5, l=0`` (it keeps bf16
    temporaries in float32) or XLA:GPU's (fitted to h100_sxm compiles; docs/planner.md).
    The derivation and the table of modes are in ``docs/planner.md``.

    Args:
      shape: a :class:`ModelShape` (see :func:`resolve_shape`).
      batch_size: sequences per micro-batch on this device (``b``).
      seq_len: tokens per sequence (``s``).
      activation_dtype: dtype of activations (the compute dtype; ``A`` bytes).
      remat: one of :data:`REMAT_MODES` (``None`` = ``"none"``).
      compiler: ``"cpu"`` or ``"gpu"``: whose buffer assignment the long-context paths
        model (:data:`COMPILER_TERMS`; ``planner.estimate`` picks it from its target).
      layer_param_bytes: bytes of the layer stack's weights as stored (the packed NF4
        layers of a QLoRA base; ``planner.estimate`` passes them for an NF4 base): with
        the long-context paths, ``remat="none"`` adds ``unrolled_weight_copies`` of them to
        ``layers`` (:class:`CompilerTerms`); on a mixture of experts, the bytes per stored
        weight they give price a routed layer's packed expert slice (``moe_layer_bytes``).
      expert_lora: the LoRA rank summed over the adapted expert projections (``3 r`` with
        all three adapted; 0: none): the grouped matmul gathers their factors per tile.

    Returns:
      ``{"layers", "recompute", "logits", "other", "host_activations", "phased"}`` in
      bytes (``phased``: 0 or 1).

    Raises:
      ValueError: for an unknown remat mode or compiler, or non-positive sizes.

    Source: Korthikanti et al. 2022, Sec. 4 (``s b h (34 + 5 a s / h)`` per GPT layer),
    adapted to jmem's Llama (fp32 RMSNorm, GQA, SwiGLU, no dropout).
    """
    remat = "none" if remat is None else remat
    if remat not in REMAT_MODES:
        raise ValueError(f"remat={remat!r} is not one of {REMAT_MODES}.")
    if compiler not in COMPILER_TERMS:
        raise ValueError(f"compiler={compiler!r} is not one of {sorted(COMPILER_TERMS)}.")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1; got {batch_size}, {seq_len}.")
    A = _dtypes.itemsize(activation_dtype, "activation_dtype")
    L, s, t, h = shape.num_layers, seq_len, batch_size * seq_len, shape.hidden_size
    saved = _saved_per_token(shape, A, s, t)
    host = {"offload": L * t * _offloaded_per_token(shape, A), "offload_inputs": L * t * A * h}
    host = host.get(remat, 0)
    parts = {
        "layers": L * t * saved[remat],
        "recompute": t * (saved["none"] - saved[remat]),
        "logits": 2 * 4 * t * shape.vocab_size,
        "other": A * t * shape.hidden_size + 5 * batch_size * shape.num_heads * s * s,
        "host_activations": host,
        "phased": 0,
    }
    if is_long_context(shape, s):
        terms = COMPILER_TERMS[compiler]
        stored = layer_param_bytes / max(shape.linear_params, 1)  # bytes per stored weight
        moe = (stored, expert_lora)
        parts.update(_long_context_parts(shape, batch_size, s, terms, remat, A, moe))
        parts.update(other=A * t * shape.hidden_size, phased=1)
        if remat == "none":  # the inlined layers' weight slices, held to their backward
            parts["layers"] += int(terms.unrolled_weight_copies * layer_param_bytes)
            if shape.attention == "blockwise":
                pairs = L * batch_size * s * s
                parts["layers"] += int(terms.unrolled_blockwise_per_pair * pairs)
    return parts
