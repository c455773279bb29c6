"""The memory levers of a step as one frozen value, and the one place their rules live.

``Levers`` holds how a model is *run* (remat policy, attention implementation, loss and
token chunks, the layer loop's unroll, FP8), apart from what the model *is* (its
``LlamaConfig``: shapes and family options), as MaxText keeps ``configs/models/*.yml``
apart from ``base.yml`` and jmp passes one frozen ``Policy`` to everything.

``resolve(levers, model, batch, target)`` applies every rule that combines the levers
with the model, the batch and the machine being compiled for (not necessarily the one
running), and returns a ``ResolvedLevers``: concrete choices, each with the reason it was
made. The model's ``forward``/``loss_fn``, ``jmem.train_step``, the planner and the
fine-tuning job all read the same resolved value, so there is no second ``"auto"`` rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jmem._src import attention as attention_lib
from jmem._src import targets as targets_lib
from jmem._src.names import REMAT_NAMES
from jmem._src.recompute import recompute_cost

__all__ = ["Levers", "ResolvedLevers", "resolve"]


_OFFLOAD_PARAMS_WHY = {
    False: "off: weights on the device",
    True: "layer weights streamed from host memory, one layer at a time",
}


def _check_chunk(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (0 = unchunked); got {value!r}.")


def _check_unroll(value) -> None:
    if value is None or value is True or (type(value) is int and value >= 1):
        return
    raise ValueError(
        f"scan_unroll must be None (resolved), True or an int >= 1 (lax.scan's unroll); "
        f"got {value!r}."
    )


@dataclasses.dataclass(frozen=True)
class Levers:
    """How a step is run: the execution settings that trade memory for compute.

    Frozen and hashable (a static argument under ``jax.jit``). Every field is checked at
    construction; ``resolve`` turns the value into concrete choices for a model, a batch
    and a compile target.

    Attributes:
      remat: remat policy name, one of ``REMAT_NAMES`` (``jmem.REMAT_POLICIES``), applied
        by ``jmem.train_step(levers=...)`` (a model's ``loss_fn`` does not remat by
        itself), or None (default): applied outside, if at all (``jmem.remat``).
      attention: ``"auto"``, ``"dense"``, ``"blockwise"`` or ``"cudnn"``
        (``jmem.ops.attention``): ``"auto"`` resolves to cuDNN on a GPU target where it
        can run, else dense up to 1024 keys and blockwise beyond.
      loss_chunk: tokens per chunk of the cross-entropy (``[loss_chunk, V]`` float32
        logits at a time, ``jmem.ops.linear_cross_entropy``); 0 computes all ``[B, S, V]``
        logits at once. On a mesh that splits the batch rows, per device: each device
        chunks its own rows (``jmem._src.mesh_batch``).
      token_chunk: tokens per chunk of each layer's token-local parts (norms, q/k/v and
        output projections, RoPE, the MLP; ``jmem._src.token_chunks``); 0, or fewer tokens
        than this, runs them whole. Only attention sees every token. On a mesh that splits
        the batch rows, per device, as ``loss_chunk``.
      scan_unroll: ``lax.scan``'s ``unroll`` for the layer loop: None resolves to True
        (every layer inlined) with ``remat="none"`` (a loop would stack each saved
        residual as ``[L, ...]``) and to 1 (a loop) otherwise; or an explicit True / int.
      fp8: FP8 matmuls with delayed scaling. They run only where the loss is wrapped in
        ``jmem.fp8.apply`` with ``Fp8Meta``s (the kernels carry them); this field does not
        switch them on: it records the choice for the planner and the printout, and the
        reference Llama (outside ``apply``) and ``jmem.train_step`` (a state without
        metas, or a loss with no FP8 matmul) refuse it with a ``ValueError`` rather than
        run in the compute dtype. Token chunks compose with it: each projection's
        per-chunk amaxes are max-reduced into one state update, the unchunked call's (see
        ``resolve``).
      offload_params: the layer-stacked weights may live in host memory (``pinned_host``):
        the layer scan copies each layer's slice to the device when that layer runs
        (forward, remat recomputation, backward), and the other weights (embedding, final
        norm, LM head) are copied to the device whole at the start of the call.
        ``jmem.train_step`` then keeps its ``frozen`` params in host memory between
        steps (``jmem._src.offload.params``, docs/offload.md). Needs a remat policy other
        than ``"none"`` (which would keep every layer's device copy for the backward pass).

    Raises:
      ValueError: an unknown remat or attention name, a negative or non-int chunk, a bad
        ``scan_unroll``, a non-bool ``fp8``/``offload_params``, or ``offload_params``
        with ``remat="none"``.
    """

    remat: str | None = None
    attention: str = "auto"
    loss_chunk: int = 2048
    token_chunk: int = 2048
    scan_unroll: int | bool | None = None
    fp8: bool = False
    offload_params: bool = False

    def __post_init__(self):
        if self.remat is not None and self.remat not in REMAT_NAMES:
            raise ValueError(f"remat={self.remat!r} is unknown; choose from {REMAT_NAMES}.")
        if self.attention not in attention_lib.IMPLEMENTATIONS:
            raise ValueError(
                f"attention={self.attention!r} is unknown; choose from "
                f"{attention_lib.IMPLEMENTATIONS}."
            )
        _check_chunk("loss_chunk", self.loss_chunk)
        _check_chunk("token_chunk", self.token_chunk)
        _check_unroll(self.scan_unroll)
        if not isinstance(self.fp8, bool):
            raise ValueError(f"fp8 must be a bool; got {self.fp8!r}.")
        if not isinstance(self.offload_params, bool):
            raise ValueError(f"offload_params must be a bool; got {self.offload_params!r}.")
        if self.offload_params and self.remat == "none":
            raise ValueError(
                "offload_params=True needs a remat policy (e.g. remat='full'): with "
                "remat='none' every layer's device copy of its weights is kept for the "
                "backward pass."
            )


@dataclasses.dataclass(frozen=True)
class ResolvedLevers:
    """``Levers`` made concrete for one model, batch shape and compile target.

    Attributes:
      remat, loss_chunk, token_chunk, fp8: as in ``Levers``, after the rules (``remat``
        None: applied outside the model, if at all).
      attention: ``"dense"``, ``"blockwise"`` or ``"cudnn"``; ``"auto"`` only when no
        sequence length was known (then ``jmem.ops.attention`` picks per call by the same
        rule, on the running backend).
      scan_unroll: True or an int >= 1 (never None).
      target: the platform compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``) or a named
        target (``jmem.targets``).
      seq_len: tokens per row the choices were made for (None: not known).
      reasons: ``((lever, reason), ...)``, one per lever, in field order.
      offload_params: as in ``Levers``.
    """

    remat: str | None
    attention: str
    loss_chunk: int
    token_chunk: int
    scan_unroll: int | bool
    fp8: bool
    target: str
    seq_len: int | None
    reasons: tuple[tuple[str, str], ...] = ()
    offload_params: bool = False

    def reason(self, lever: str) -> str:
        """Why ``lever`` has its value."""
        return dict(self.reasons)[lever]

    def describe(self) -> str:
        """One line per lever: ``name = value  (reason)``; what the dry run prints."""
        width = max(len(k) for k, _ in self.reasons)
        return "\n".join(
            f"  {k:<{width}} = {getattr(self, k)!s:<9}  ({why})" for k, why in self.reasons
        )

    def as_dict(self) -> dict[str, Any]:
        """The choices and their reasons (``summary.json``, the dry run's record)."""
        return {k: {"value": getattr(self, k), "reason": why} for k, why in self.reasons}


def _platform(target) -> tuple[str, str]:
    """``(name, platform)`` of a compile target: None (the running backend), a platform
    name, a named target (``jmem.targets``), or an object with ``name``/``platform``."""
    if target is None:
        backend = jax.default_backend()
        return backend, backend
    if isinstance(target, str) and target in ("cpu", "gpu", "cuda", "rocm", "tpu"):
        platform = "gpu" if target in ("cuda", "rocm") else target
        return target, platform
    if isinstance(target, str):
        target = targets_lib.get(target)
    return str(target.name), str(target.platform)


def _batch_facts(batch, seq_len) -> tuple[int | None, bool]:
    """``(seq_len, packed)`` from a batch dict of arrays/ShapeDtypeStructs or a length."""
    if batch is None:
        return seq_len, False
    if isinstance(batch, dict):
        inputs = batch.get("inputs", batch.get("tokens"))
        s = None if inputs is None else int(inputs.shape[-1])
        return s, batch.get("segment_ids") is not None
    shape = tuple(batch)
    return int(shape[-1]), False


def _attention(levers, model, seq, packed, platform, dtype) -> tuple[str, str]:
    """The attention implementation and why, by ``jmem.ops.attention``'s own rule."""
    if levers.attention not in ("auto", "cudnn"):
        return levers.attention, "as given"
    if seq is None:
        if levers.attention == "cudnn":
            return "cudnn", "as given"
        return "auto", "auto: picked per call by the same rule (no sequence length known)"
    d = model.head_dim
    q = jax.ShapeDtypeStruct((1, seq, model.num_heads, d), dtype)
    k = jax.ShapeDtypeStruct((1, seq, model.num_kv_heads, d), dtype)
    window = _layer_window(model)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if packed else None
    reason = attention_lib.cudnn_reason(
        q, k, seg, window, getattr(model, "attn_logit_softcap", None), None, platform=platform
    )
    choice = attention_lib.pick_implementation(levers.attention, reason, seq)
    if choice == "cudnn":
        return choice, f"{levers.attention}: cuDNN fused attention runs on {platform}"
    if choice == "dense":
        return choice, (
            f"auto: {seq} keys <= {attention_lib.AUTO_DENSE_MAX_KEYS}, dense (cuDNN: {reason})"
        )
    return choice, (
        f"auto: {seq} keys > {attention_lib.AUTO_DENSE_MAX_KEYS}, blockwise (cuDNN: {reason})"
    )


def _layer_window(model):
    """The sliding window every layer shares, or a traced-int stand-in when layers differ
    (Gemma's mixed layers: the window is selected per layer inside the scan)."""
    types = getattr(model, "layer_types", None)
    if types is not None and len(set(types)) > 1:
        return jax.ShapeDtypeStruct((), jnp.int32)
    if types is not None and "sliding_attention" not in types:
        return None
    return getattr(model, "sliding_window", None)


#: Why ``remat="offload"`` turns token chunks off on a GPU target.
_OFFLOAD_CHUNKS_WHY = (
    "0: remat offload inside the token-chunk loops fails XLA:GPU's layout assignment "
    "(jaxlib 0.10.2: the layer inputs' stack in host memory, the per-chunk residuals on the "
    "device); the token-local parts run whole"
)


def _chunks(levers, seq, batch_rows, platform=None) -> list[tuple[str, int, str]]:
    """``(lever, value, reason)`` for the loss and token chunks."""
    tokens = None if seq is None else seq * (batch_rows or 1)
    out = []
    if levers.loss_chunk == 0:
        out.append(("loss_chunk", 0, "as given: all [B, S, V] logits at once"))
    elif tokens is not None and tokens <= levers.loss_chunk:
        out.append(("loss_chunk", levers.loss_chunk, f"as given ({tokens} tokens: one chunk)"))
    else:
        out.append(("loss_chunk", levers.loss_chunk, "as given"))
    if levers.token_chunk and levers.remat == "offload" and platform == "gpu":
        out.append(("token_chunk", 0, _OFFLOAD_CHUNKS_WHY))
    elif levers.token_chunk and seq is not None and seq <= levers.token_chunk:
        out.append(("token_chunk", levers.token_chunk, f"as given ({seq} tokens: one chunk)"))
    elif levers.token_chunk and levers.fp8:
        why = "as given; with FP8 each projection's per-chunk amaxes are max-reduced into one"
        out.append(("token_chunk", levers.token_chunk, why + " state update"))
    else:
        out.append(("token_chunk", levers.token_chunk, "as given"))
    return out


#: Where a policy saves little or nothing below another on the program it runs.
_CHUNKED_WHY = (
    "; inside each token chunk ({chunk} tokens) every policy recomputes the token-local "
    "work, none included: {remat} keeps what crosses the chunks (q/k/v, the attention "
    "output), as none does, and saves less than none only by none's other residuals"
)
_CPU_OFFLOAD_WHY = (
    "; XLA:CPU has no separate host memory: the offloaded residuals stay in device memory, "
    "so on CPU it saves no device memory below {sibling}"
)


def _remat_why(remat, token_chunk, seq, platform, model=None, attention="dense") -> str:
    """The remat lever's reason, saying where the policy saves little below another on
    this program: ``dots``/``selective`` with token chunks (their internals are recomputed
    under ``none`` too), ``offload``/``offload_inputs`` on XLA:CPU (no host memory); and
    its recompute cost (``recompute.recompute_cost``)."""
    if not remat:
        return "applied outside the model, if at all"
    why = "as given" + _recompute_why(remat, token_chunk, seq, model, attention)
    if remat in ("dots", "selective") and token_chunk and seq is not None and seq > token_chunk:
        why += _CHUNKED_WHY.format(chunk=token_chunk, remat=remat)
    if remat in ("offload", "offload_inputs") and platform == "cpu":
        why += _CPU_OFFLOAD_WHY.format(sibling="selective" if remat == "offload" else "full")
    return why


def _recompute_why(remat, token_chunk, seq, model, attention) -> str:
    """``; recomputes ...: about +N% ...`` for the remat reason (empty without a shape)."""
    chunked = bool(token_chunk) and seq is not None and seq > token_chunk
    cost = recompute_cost(remat, model, seq, token_chunked=chunked, attention=attention)
    if cost is None:
        return ""
    share, what = cost
    if not share:
        return "; recomputes no matmul in the backward pass"
    why = f"; recomputes {what} in the backward pass: about +{share:.0%} of the step's "
    why += "minimum matmul work (a model; the dry run counts the compile's)"
    if remat in ("none", "dots") and chunked:
        why += f", because token chunks ({token_chunk} tokens) recompute their internals"
    return why


def resolve(
    levers: Levers | ResolvedLevers | None,
    model: Any,
    batch: Any = None,
    target: Any = None,
    *,
    dtype: Any = jnp.bfloat16,
) -> ResolvedLevers:
    """Applies every rule that combines the levers with a model, a batch and a target.

    The rules, all here:
      - ``attention="auto"``: cuDNN fused attention where ``jmem.ops.attention`` says it
        can run on the *target* (16-bit inputs, head dim a multiple of 8 up to 128, no
        packed rows, no soft-cap, one window for every layer), else dense up to 1024 keys
        and blockwise beyond.
      - ``scan_unroll=None``: True (inlined layers) with ``remat="none"``, else 1.
      - ``remat="offload"`` on a GPU target: token chunks 0 (XLA:GPU's layout assignment
        fails on the offloaded stack inside the chunk loops; named in the reason).
      - ``remat``'s reason names where the policy saves little below another:
        ``dots``/``selective`` with token chunks, ``offload``/``offload_inputs`` on a CPU
        target (``_remat_why``).
      - ``fp8=True`` keeps token chunks: under ``jmem.fp8.apply`` each projection's
        scaling state is fanned out over the chunks and the per-chunk amaxes are
        max-reduced into one history update, exactly the unchunked step's (named in the
        reason).

    Args:
      levers: a ``Levers`` (None: ``Levers()``), or an already ``ResolvedLevers``
        (returned unchanged).
      model: the model's ``LlamaConfig`` (or any object with its shape attributes).
      batch: a batch dict (``{"inputs": [B, S], ...}``, arrays or ShapeDtypeStructs; a
        ``"segment_ids"`` entry marks packed rows), a shape tuple ``(B, S)``, or None.
      target: what is compiled for: None (the running backend), ``"cpu"``/``"gpu"``/
        ``"tpu"``, or a ``jmem.targets`` name or ``Target``.
      dtype: the activation (compute) dtype; cuDNN needs a 16-bit one.

    Returns:
      A ``ResolvedLevers`` with one reason per lever (``describe()`` prints them).
    """
    if isinstance(levers, ResolvedLevers):
        return levers
    levers = Levers() if levers is None else levers
    if not isinstance(levers, Levers):
        raise TypeError(f"levers must be a jmem.Levers; got {type(levers).__name__}.")
    name, platform = _platform(target)
    seq, packed = _batch_facts(batch, None)
    rows = None
    if isinstance(batch, dict) and batch.get("inputs") is not None:
        rows = int(batch["inputs"].shape[0])
    elif isinstance(batch, tuple):
        rows = int(batch[0]) if len(batch) > 1 else None
    attn, attn_why = _attention(levers, model, seq, packed, platform, jnp.dtype(dtype))
    if levers.scan_unroll is None:
        unroll = True if levers.remat == "none" else 1
        unroll_why = (
            "remat none: layers inlined (a loop would stack each saved residual)"
            if unroll is True
            else f"remat {levers.remat or 'outside'}: one layer loop (compile time "
            "independent of depth)"
        )
    else:
        unroll, unroll_why = levers.scan_unroll, "as given"
    chunks = {k: (v, why) for k, v, why in _chunks(levers, seq, rows, platform)}
    fp8_why = "off"
    if levers.fp8:
        fp8_why = (
            "FP8 matmuls with delayed scaling through jmem.fp8.apply (the loss must be "
            "wrapped in it, with metas; without it the model and train_step refuse)"
        )
        if chunks["token_chunk"][0]:
            fp8_why += "; per-chunk amaxes max-reduced into one state update per step"
    return ResolvedLevers(
        remat=levers.remat,
        attention=attn,
        loss_chunk=chunks["loss_chunk"][0],
        token_chunk=chunks["token_chunk"][0],
        scan_unroll=unroll,
        fp8=levers.fp8,
        target=name,
        seq_len=seq,
        reasons=(
            (
                "remat",
                _remat_why(levers.remat, chunks["token_chunk"][0], seq, platform, model, attn),
            ),
            ("attention", attn_why),
            ("loss_chunk", chunks["loss_chunk"][1]),
            ("token_chunk", chunks["token_chunk"][1]),
            ("scan_unroll", unroll_why),
            ("fp8", fp8_why),
            ("offload_params", _OFFLOAD_PARAMS_WHY[levers.offload_params]),
        ),
        offload_params=levers.offload_params,
    )
