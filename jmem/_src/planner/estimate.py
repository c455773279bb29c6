"""``estimate``: the device bytes of one training step, ledger by ledger (a ``Ledger``), as
one helper per ledger: the options, the model's shape, full fine-tuning or LoRA states on a
frozen (NF4) base, ZeRO sharding, the offload rungs and the activations. Accounting
conventions and sources are in ``docs/planner.md``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any
from typing import Mapping
from typing import Sequence

from jmem._src import dtypes as _dtypes
from jmem._src import levers as _levers
from jmem._src.planner.activations import activation_bytes
from jmem._src.planner.activations import compiler_terms
from jmem._src.planner.ledger import Ledger
from jmem._src.planner.offload import PARAMS
from jmem._src.planner.offload import Offload
from jmem._src.planner.shapes import LINEAR_NAMES
from jmem._src.planner.shapes import ModelShape
from jmem._src.planner.shapes import is_count
from jmem._src.planner.shapes import resolve_shape
from jmem._src.planner.tables import MIN_QUANTIZED_SIZE
from jmem._src.planner.tables import OPTIMIZERS
from jmem._src.planner.tables import OptimizerLayout
from jmem._src.planner.tables import state_bytes_per_param
from jmem._src.units import GB
from jmem._src.units import format_count

__all__ = ["PLAIN_LEVERS", "estimate", "remat_of", "with_remat"]


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


@dataclasses.dataclass(frozen=True)
class _States:
    """The four model-state ledgers (bytes; floats until rounded) and the trainable count."""

    params: float
    grads: float
    optimizer_state: float
    master_weights: float
    trainable: float


def _check_options(accounting, optimizer, offload, quantization, num_shards, zero_stage, lora):
    """Validates the scalar options; returns ``(Offload, quantization, zero_stage, lora
    spec)``."""
    if accounting not in ("stored", "nominal"):
        raise ValueError(f"accounting must be 'stored' or 'nominal'; got {accounting!r}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {optimizer!r}; choose from {sorted(OPTIMIZERS)}.")
    offload = Offload.parse(offload)
    if quantization not in (None, "none", "nf4"):
        raise ValueError(f"quantization must be None or 'nf4'; got {quantization!r}.")
    quantization = None if quantization == "none" else quantization
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int; got {num_shards!r}.")
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
    return offload, quantization, zero_stage, spec


def _resolve(model: Any, count_given: bool, shape_kwargs: dict) -> tuple[ModelShape, float]:
    """``resolve_shape``, refusing shape keywords for anything but a parameter count."""
    if shape_kwargs and not count_given:
        raise ValueError(
            f"Shape keywords {sorted(shape_kwargs)} apply only to a model given as "
            "a parameter count; for a config, change the config instead."
        )
    return resolve_shape(model, **shape_kwargs)


def _param_itemsize(param_dtype: Any) -> int:
    """Bytes per trained weight; refuses dtypes that cannot be trained (int8, fp8)."""
    P = _dtypes.itemsize(param_dtype, "param_dtype")
    if P < 2:
        raise ValueError(
            f"param_dtype={param_dtype!r}: trained weights must be fp32, bf16 or fp16. For "
            f"frozen 4-bit base weights use quantization='nf4' with lora=(rank, targets) "
            f"(QLoRA); FP8 matmuls (jmem.fp8) keep the weights in bf16/fp32."
        )
    return P


def _optimizer_notes(opt: OptimizerLayout) -> list[str]:
    if opt.bits >= 32:
        return []
    return [
        "not counted: float32 transients of the quantized update, one group of "
        "tensors or one chunk at a time (jmem's quantized Adam: about 8 bytes x "
        "chunk_size=2**24 elements, ~128 MiB)"
    ]


def _full_states(n, shape, P, G, S, opt, accounting, count_given, master_weights) -> _States:
    """Full fine-tuning: every parameter has a gradient, optimizer state and master."""
    state = n * S
    if accounting == "stored" and opt.bits < 32 and not count_given:
        # jmem's quantized Adam (as bitsandbytes) keeps fp32 moments for leaves < 4096 elements.
        small = sum(x for x in shape.leaf_sizes() if x < MIN_QUANTIZED_SIZE)
        state += small * (opt.states * 4 - S)
    return _States(n * P, n * G, state, n * 4 if master_weights else 0, n)


def _frozen_base(n, shape, P, param_dtype, nf4, quantize_embeddings, count_given):
    """Bytes of the frozen LoRA base (``param_dtype``, or NF4 at ``nf4`` bytes per weight
    for QLoRA; ``nf4`` None: no quantization), and its notes."""
    if nf4 is None:
        return n * P, []
    q_n = n if (count_given or quantize_embeddings) else shape.linear_params
    if quantize_embeddings and not count_given:
        q_n = shape.linear_params + shape.embedding_params
    rest = (
        "" if q_n == n else f"; {format_count(n - q_n)} embedding/norm weights stay {param_dtype}"
    )
    notes = [
        f"NF4 base at {nf4:.4g} B/weight over {format_count(q_n)} weights" + rest,
        "a layer's weights are dequantized to the compute dtype during its "
        "matmuls (transient, not counted)",
    ]
    return q_n * nf4 + (n - q_n) * P, notes


def _nf4_rate(accounting: str, double_quant: bool) -> float:
    """Bytes per NF4 weight: 0.5 nominal; stored, 4 bits plus the absmax (fp32 per 64
    weights, or 8 bits per 64 and fp32 per 256 x 64 with double quantization)."""
    if accounting == "nominal":
        return 0.5
    return (4 + 8 / 64 + 32 / (64 * 256)) / 8 if double_quant else (4 + 32 / 64) / 8


def _resident_bytes(shape, n, P, nf4, count_given, quantize_embeddings) -> tuple[float, float]:
    """``(resident, head)``: bytes of the weights outside the layer stack (embedding, final
    norm, LM head), which cross host-to-device once a step under the params rung, and of
    the head among them (the LM head, or the embedding when tied), which the loss phase
    fetches to the device. ``nf4``: bytes per quantized weight, None for an unquantized
    base (``P`` bytes each)."""
    rest = shape.embedding_params + shape.hidden_size
    head = shape.vocab_size * shape.hidden_size
    if count_given:  # a count is quantized whole: the shape's fraction of its n
        rate = (P if nf4 is None else nf4) * n / max(shape.n_params, 1)
        return rest * rate, head * rate
    if nf4 is None:
        return rest * P, head * P
    emb = nf4 if quantize_embeddings else P
    return shape.embedding_params * emb + shape.hidden_size * P, head * emb


def _stream_params(st: _States, base: float, weights: tuple, shape, shards: tuple[int, int]):
    """The params rung on states sharded as ``shards`` (``(num_shards, zero_stage)``): the
    whole base lives in host memory between steps (the job puts every frozen leaf in
    ``pinned_host``), so the device's arguments hold none of it. In the step each layer's
    slice is fetched into a buffer of the layer loop, where XLA also slices a device-resident
    stack's layer (the activations' layer working set counts it either way), and the loss
    phase fetches the head (``weights``: ``(resident, head)`` bytes, ``_resident_bytes``).
    Returns ``(states, host bytes, {"stack": bytes streamed per pass, "resident": bytes},
    head bytes the loss phase holds, detail)``."""
    k, zero_stage = shards
    base, resident, head = (_divide_from(x, k, zero_stage, 3) for x in (base, *weights))
    stack = base - resident
    detail = {"params:layer_slice": int(round(stack / shape.num_layers))}
    st = dataclasses.replace(st, params=st.params - base)
    return st, int(round(base)), {"stack": stack, "resident": resident}, head, detail


def _params_notes(spec, streamed: dict) -> list[str]:
    """What the params rung's figures assume (and, for full fine-tuning, what jmem lacks)."""
    notes = [
        f"params streamed from host: the layer stack ({streamed['stack'] / GB:.3g} GB) "
        "crosses host-to-device 3x per micro-batch (forward, remat recomputation, "
        "backward), the embedding/final norm/head once; on the device one layer's slice at a "
        "time and the head for the loss"
    ]
    if spec is None:
        notes.append(
            "full fine-tuning with streamed params: the backward pass writes each layer's "
            "gradient to host memory (host grads), the update reads them back leaf by leaf"
        )
    return notes


def _lora_states(spec, shape, S, AD, base, accounting, master_weights):
    """LoRA on a frozen base: adapters get grads, state and (maybe) masters; with detail."""
    rank, targets = spec
    trainable = shape.lora_elements(targets, rank)
    adapter_master = 4 if (accounting == "nominal" or (master_weights and AD < 4)) else 0
    detail = {
        "base:params": int(base),
        "lora:params": trainable * AD,
        "lora:grads": trainable * AD,
        "lora:optimizer_state": int(trainable * S),
        "lora:master_weights": trainable * adapter_master,
    }
    note = (
        f"LoRA r={rank} on {', '.join(targets)}: {trainable / 1e6:.4g}M adapter "
        "params; activations counted as for full fine-tuning (an upper bound)"
    )
    states = _States(
        base + trainable * AD, trainable * AD, trainable * S, trainable * adapter_master, trainable
    )
    return states, detail, note


def _divide_from(x: float, k: int, zero_stage: int, stage: int) -> float:
    """``ceil(x / k)`` when ``zero_stage`` shards this ledger (from ``stage`` on), else ``x``."""
    return math.ceil(x / k) if zero_stage >= stage else x


def _shard(st: _States, k: int, zero_stage: int, explicit_stage: bool, shape, P, adapters=0.0):
    """ZeRO stage 1/2/3 over ``k`` shards (ceil-divided), and its notes. ``adapters``: the
    LoRA adapters' bytes (their params and, as many, their grads), which jmem's FSDP
    shardings replicate (``jmem._src.sharding``: ``LoraWeight`` nodes and their gradients;
    their optimizer state is split)."""
    if k == 1:
        if not explicit_stage:
            return st, []
        return st, [
            f"ZeRO-{zero_stage} over 1 shard divides nothing; pass num_shards "
            "(CLI: --shards) for the number of devices"
        ]
    notes = []
    if zero_stage >= 3:
        counted = "counted once with the activations" if not adapters else "not counted"
        notes.append(
            f"ZeRO-3 gathers one layer's weights at a time (~{_gathered_layer(shape, P) / GB:.3g} "
            f"GB, twice with prefetch; {counted})"
        )
    notes.append(f"ZeRO-{zero_stage} over {k} shards")
    sharded = _States(
        _divide_from(st.params - adapters, k, zero_stage, 3) + adapters,
        _divide_from(st.grads - adapters, k, zero_stage, 2) + adapters,
        _divide_from(st.optimizer_state, k, zero_stage, 1),
        _divide_from(st.master_weights, k, zero_stage, 1),
        st.trainable,
    )
    return sharded, notes


def _gathered_layer(shape, P) -> float:
    """Bytes of one layer's weights, as ZeRO-3 gathers them on every device."""
    return sum(i * o for i, o in shape.linear_shapes().values()) * P


def _count_gather(detail: dict, shape, P, spec, shards: tuple[int, int], given) -> int:
    """ZeRO-3 full fine-tuning: the one layer's weights gathered on every device during the
    forward and backward passes (``detail["activation:zero3_layer"]``, set here), counted
    with the activations; 0 otherwise (LoRA on a frozen base: a note only) or when the
    activation ledger is ``given``."""
    k, zero_stage = shards
    if spec is not None or zero_stage < 3 or k <= 1 or given is not None:
        return 0
    detail["activation:zero3_layer"] = int(round(_gathered_layer(shape, P)))
    return detail["activation:zero3_layer"]


def _largest_units(shape) -> tuple[int, int]:
    """``(elements of the largest layer-stacked leaf [L, ...], of the largest other leaf)``:
    the units a leaf-by-leaf update works on (the other leaves: embedding, head, norm)."""
    whole = (shape.vocab_size * shape.hidden_size, shape.hidden_size)
    stacked = [x for x in shape.leaf_sizes() if x not in whole]
    return max(stacked, default=0), max(whole)


def _update_phase(shape, offload: Offload, spec, opt: OptimizerLayout, st: _States, per: tuple):
    """The leaf-by-leaf update of an offloaded optimizer state (full fine-tuning), after the
    backward pass: ``(device bytes, notes)``; ``(0, [])`` when not modelled.

    ``per``: ``(P, G, S, master_weights, (num_shards, zero_stage), accounting)``: bytes per
    element of a param, gradient and optimizer state, fp32 masters (M = 4 bytes) or not,
    the sharding; ``"nominal"`` accounting (textbook tables) models no update phase.
    The update of one unit holds about ``P + G + 2.5 (S + M)`` bytes per element (its param
    and gradient, its old and new state, one more copy of part of it; read off XLA:GPU's
    buffers for Llama-3.1-8B with 8-bit AdamW, docs/offload.md). A float32 optimizer
    (elementwise) updates a layer stack one row at a time (``offload/stack_rows.py``), so
    its unit is the larger of a stack's row and the largest other leaf (embedding, head);
    a quantized one (or the disk rung) a whole stack. Streamed params are in host memory
    during the update."""
    P, G, S, masters, (k, zero_stage), accounting = per
    if spec is not None or not offload.optimizer or accounting == "nominal":
        return 0, []
    M, k = 4 if masters else 0, k if zero_stage else 1
    rows = (opt.bits >= 32 or opt.states == 0) and not offload.disk
    stacked, whole = _largest_units(shape)
    unit = max(stacked / shape.num_layers if rows else stacked, whole) / k
    held = (P + G + 2.5 * (S + M)) * unit
    params = 0 if offload.params else st.params
    total = params + st.grads + st.optimizer_state + st.master_weights + held
    what = "a layer stack's row or the largest other leaf" if rows else "the largest leaf"
    return int(round(total)), [
        f"the leaf-by-leaf update of the offloaded state runs after the backward pass: "
        f"params and grads on the device then, plus ~{held / GB:.3g} GB for {what} "
        f"({total / GB:.3g} GB; the total is the larger of this and the backward pass)"
    ]


def _streamed_remat(streamed: dict, remat, offload: Offload):
    """``remat``, checked: the params rung needs remat, as ``Levers(offload_params=True)``."""
    if streamed and remat in (None, "none"):
        raise ValueError(
            f"offload={str(offload)!r} streams the params per layer and needs remat (e.g. "
            "remat='full'): with remat='none' every layer's device copy is kept for the backward."
        )
    return remat


def _offload(
    st: _States, offload: Offload, params_host: int = 0, grads: bool = False
) -> tuple[_States, dict[str, int]]:
    """Moves the offloaded state ledgers to host: ``(device states, host bytes)``;
    ``params_host``: the params rung's host bytes (``host["params"]``), if any; ``grads``:
    full fine-tuning with streamed params, whose backward pass writes each layer's gradient
    to host memory (``host["grads"]``)."""
    host: dict[str, int] = {PARAMS: params_host} if params_host else {}
    for name in offload.ledgers + (("grads",) if grads else ()):
        host[name], st = int(round(getattr(st, name))), dataclasses.replace(st, **{name: 0})
    return st, host


def _transfers(
    host: dict, offload: Offload, streamed: dict, host_activations: int = 0
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """``(host bytes, disk bytes, transfers per step)``: every offloaded state ledger goes to
    the device and back once per step (2 x its bytes); on disk, also from disk and back.
    ``streamed`` (the params rung: ``{"stack": bytes, "resident": bytes}``, else empty): the
    layer stack crosses host-to-device three times per micro-batch (forward, remat
    recomputation, backward), the resident weights once. Offloaded activations
    (``remat="offload"``/``"offload_inputs"``: ``host["activations"]``) go to host in the
    forward pass and back for the backward: 2 x their bytes (``"activations"``); so do
    the gradients of streamed full fine-tuning (``host["grads"]``: to host in the backward
    pass, back for the update). ``host_activations`` is added to ``host`` first."""
    if host_activations:
        host["activations"] = host_activations
    moved = {k: v for k, v in host.items() if k in ("optimizer_state", "master_weights")}
    transfers = {
        ("optimizer" if k == "optimizer_state" else k): 2 * v for k, v in moved.items() if v
    }
    if host.get("activations"):
        transfers["activations"] = 2 * int(host["activations"])
    if host.get("grads"):  # to host in the backward pass, back for the update
        transfers["grads"] = 2 * int(host["grads"])
    if streamed:
        transfers[PARAMS] = int(round(3 * streamed["stack"] + streamed["resident"]))
    if not offload.disk:
        return host, {}, transfers
    transfers["disk"] = 2 * sum(moved.values())
    return {k: v for k, v in host.items() if k not in moved}, moved, transfers


def _expert_lora(shape, spec) -> int:
    """The LoRA rank summed over the adapted expert projections (``activation_bytes``'
    ``expert_lora``): 0 without experts or without adapters on them."""
    if spec is None or not shape.num_experts:
        return 0
    rank, targets = spec
    return rank * len({"gate_proj", "up_proj", "down_proj"} & set(targets))


def _activations(shape, budget, batch_size, seq_len, act_dtype, remat, count_given, target, w):
    """The activation ledger: ``(bytes, detail, host bytes, notes)``; ``target``: the
    resolved levers' compile target (its platform's compiler terms, ``compiler_terms``);
    ``w``: ``(nf4, expert_lora, head)``: bytes per NF4 weight of a QLoRA base (None: none),
    for the layer stack's weight slices that ``remat="none"`` holds and a routed layer's
    expert slice; ``_expert_lora``; the head's bytes the params rung fetches for the loss
    phase (0 without it), held beside the chunked loss's buffers."""
    nf4, expert_lora, head = w
    if budget is not None:
        return int(budget), {"activation:budget": int(budget)}, 0, []
    platform = _levers._platform(target)[1]  # noqa: SLF001 (resolve's own rule)
    terms = compiler_terms(platform)
    parts = activation_bytes(
        shape,
        batch_size=batch_size,
        seq_len=seq_len,
        activation_dtype=act_dtype,
        remat=remat,
        compiler=terms.compiler,
        layer_param_bytes=int(shape.linear_params * nf4) if nf4 else 0,
        expert_lora=expert_lora,
    )
    phased = parts.pop("phased")
    parts["streamed_head"] = int(round(head))
    work = [parts["recompute"], parts["logits"] + parts["streamed_head"]]
    act = parts["layers"] + parts["other"] + (max(work) if phased else sum(work))
    detail = {f"activation:{k}": v for k, v in parts.items() if v}
    notes = []
    if count_given:
        notes.append(
            f"activations from the shape h={shape.hidden_size}, "
            f"L={shape.num_layers}, F={shape.intermediate_size}, "
            f"V={shape.vocab_size}"
        )
    if terms.compiler == "gpu" and phased:
        notes.append(f"activations: XLA:GPU's buffers (fitted to {terms.source})")
    return act, detail, parts["host_activations"], notes


#: The levers of a model given by name or parameter count: the plain paths (dense
#: attention, whole loss, no token chunks), as a textbook step runs them.
PLAIN_LEVERS = _levers.Levers(attention="dense", loss_chunk=0, token_chunk=0)


def _step_levers(model, count_given: bool, levers, remat):
    """The step's levers, the one source of its remat, attention and chunks: ``levers``, or
    the default for the kind of ``model`` (a ``ModelShape``'s paths; the plain ones for a
    name or a count; ``jmem.Levers()`` for a config), with ``remat`` (when given) in them."""
    given = levers is not None
    if isinstance(model, ModelShape) and not given:
        levers = _levers.Levers(
            attention=model.attention, loss_chunk=model.loss_chunk, token_chunk=model.mlp_chunk
        )
    elif not given:
        levers = PLAIN_LEVERS if count_given or isinstance(model, str) else _levers.Levers()
    if remat is None:
        return levers
    if given:
        warnings.warn(
            "estimate(remat=..., levers=...) is deprecated: the levers carry the remat; pass "
            "levers=dataclasses.replace(levers, remat=...) (or remat= alone)",
            DeprecationWarning,
            stacklevel=3,
        )
    return dataclasses.replace(levers, remat=remat)


def with_remat(config: Mapping[str, Any], remat) -> dict[str, Any]:
    """``estimate``'s keywords ``config`` with the step's remat set to ``remat``: in its
    ``levers`` when it has them, else as ``remat=``."""
    config = dict(config)
    if config.get("levers") is None:
        return {**config, "remat": remat}
    config.pop("remat", None)
    return {**config, "levers": dataclasses.replace(config["levers"], remat=remat)}


def remat_of(config: Mapping[str, Any]):
    """The step's remat in ``estimate``'s keywords ``config``: ``remat=``, else its levers'
    (None: none given)."""
    return config.get("remat") or getattr(config.get("levers"), "remat", None)


def _with_levers(shape, model, count_given, levers, batch_size, seq_len, act_dtype, target):
    """``shape`` with the long-context paths of ``levers`` resolved (``jmem.resolve_levers``,
    the same rules as the model and the job) for this batch and target."""
    source = shape if count_given or isinstance(model, (str, ModelShape)) else model
    dtype = _dtypes.parse_dtype(act_dtype) if isinstance(act_dtype, str) else act_dtype
    lv = _levers.resolve(levers, source, (batch_size, seq_len), target, dtype=dtype)
    shape = dataclasses.replace(
        shape, attention=lv.attention, loss_chunk=lv.loss_chunk, mlp_chunk=lv.token_chunk
    )
    return shape, lv


def _config(model: str, options: dict, quantization, num_shards: int, accounting: str) -> dict:
    """``Ledger.config``: the model's name and the options, those at their defaults as None
    (left out of the printout); the offload rungs in their text form."""
    offload = options["offload"]
    return {
        "model": model,
        **options,
        "offload": str(offload) if offload else None,
        "quantization": quantization,
        "num_shards": num_shards if num_shards > 1 else None,
        "accounting": accounting if accounting != "stored" else None,
    }


def _ledger(st: _States, act, host, n, detail, notes, config, **extra) -> Ledger:
    """Rounds the state ledgers to int bytes and assembles the :class:`Ledger`."""
    return Ledger(
        **extra,
        params=int(round(st.params)),
        grads=int(round(st.grads)),
        optimizer_state=int(round(st.optimizer_state)),
        master_weights=int(round(st.master_weights)),
        activations=int(act),
        host=host,
        n_params=int(n),
        trainable_params=int(st.trainable),
        detail=detail,
        notes=tuple(notes),
        config=config,
    )


def _states(spec, n, shape, sizes, accounting, count_given, master_weights, base_kw):
    """The state ledgers before sharding and offload: ``(states, base bytes, detail,
    notes)``; ``sizes``: ``(P, G, S, opt)``; ``base_kw``: ``(param_dtype, nf4 bytes per
    weight or None, quantize_embeddings, adapter_dtype)``. Full fine-tuning (``spec`` None)
    trains every weight; LoRA trains adapters on a frozen base."""
    P, G, S, opt = sizes
    param_dtype, nf4, quantize_embeddings, adapter_dtype = base_kw
    notes = _optimizer_notes(opt)
    if spec is None:
        st = _full_states(n, shape, P, G, S, opt, accounting, count_given, master_weights)
        return st, n * P, {}, notes
    base, base_notes = _frozen_base(n, shape, P, param_dtype, nf4, quantize_embeddings, count_given)
    AD = _dtypes.itemsize(adapter_dtype, "adapter_dtype")
    st, detail, lora_note = _lora_states(spec, shape, S, AD, base, accounting, master_weights)
    return st, base, detail, notes + [*base_notes, lora_note]


def estimate(
    model: Any,
    *,
    param_dtype: Any = "bf16",
    optimizer: str = "adamw",
    master_weights: bool | None = None,
    grad_dtype: Any = None,
    activation_dtype: Any = None,
    offload: Offload | bool | str = False,
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
    levers: Any = None,
    target: Any = None,
    **shape_kwargs,
) -> Ledger:
    """Estimates the device bytes of one training step, ledger by ledger (``docs/planner.md``).

    Args:
      model: a ``LlamaConfig``, a ``ModelShape``, a name in ``MODEL_SHAPES`` or a parameter
        count (``7e9``, ``"7B"``; ``**shape_kwargs`` refine its shape).
      param_dtype, grad_dtype, activation_dtype: the weights the forward pass reads, the
        gradients and the activations (the last two default to ``param_dtype``).
      optimizer: a key of ``OPTIMIZERS``.
      master_weights: fp32 masters of the trainable weights (default: for 16-bit params).
      offload: an ``Offload`` or its text (``False``, ``"optimizer"``,
        ``"optimizer+masters"``, ``"disk"``, ``"params"``, ``"optimizer,params"``, ...).
      lora: None, a rank, ``(rank, targets)`` or ``{"rank", "targets"}`` (names of
        ``LINEAR_NAMES`` or ``"all"``): a frozen base and adapters in ``adapter_dtype``.
      quantization, quantize_embeddings, double_quant: ``"nf4"`` for an NF4 base (with
        ``lora``), the embedding and head quantized too, NF4's double-quantized absmax.
      remat: a remat mode: shorthand for ``levers`` with that remat.
      batch_size, seq_len: per-device micro-batch (sequences) and tokens per sequence.
      num_shards, zero_stage: devices the state is sharded over and the ZeRO stage (default 3
        when ``num_shards > 1``).
      accounting: ``"stored"`` (jmem's bytes) or ``"nominal"`` (textbook tables).
      state_block_size: the quantization block of 8-/4-bit optimizer states.
      activations: the activation ledger in bytes, instead of computing it.
      levers: the step's ``jmem.Levers`` or ``ResolvedLevers``, the source of its remat,
        attention and chunks (default: ``jmem.Levers()`` for a config, ``PLAIN_LEVERS`` for
        a name or a count).
      target: the compile target the levers are resolved for, whose activation terms are
        used (None: the running backend).
      **shape_kwargs: ``ModelShape`` fields for a parameter count (``hidden_size``, ...).

    Returns:
      A ``Ledger`` (bytes).

    Raises:
      ValueError: an unknown name, dtype or mode, or options that do not go together (NF4
        without LoRA, the params rung without remat, bad shard counts).
      TypeError: a model or LoRA spec of the wrong type.
    """
    explicit_stage = zero_stage not in (None, 0)
    offload, quantization, zero_stage, spec = _check_options(
        accounting, optimizer, offload, quantization, num_shards, zero_stage, lora
    )
    count_given = is_count(model)
    shape, n = _resolve(model, count_given, shape_kwargs)
    P = _param_itemsize(param_dtype)
    G = _dtypes.itemsize(grad_dtype, "grad_dtype") if grad_dtype is not None else P
    master_weights = P < 4 if master_weights is None else master_weights
    opt = OPTIMIZERS[optimizer]
    S = state_bytes_per_param(opt, accounting, state_block_size)
    nf4 = _nf4_rate(accounting, double_quant) if quantization == "nf4" else None
    st, base, detail, notes = _states(
        spec,
        n,
        shape,
        (P, G, S, opt),
        accounting,
        count_given,
        master_weights,
        (param_dtype, nf4, quantize_embeddings, adapter_dtype),
    )
    adapters = st.grads if spec is not None else 0  # LoRA: the grads are the adapters'
    st, shard_notes = _shard(st, num_shards, zero_stage, explicit_stage, shape, P, adapters)
    shards = (num_shards, zero_stage)
    streamed, params_host, head = {}, 0, 0
    if offload.params:
        weights = _resident_bytes(shape, n, P, nf4, count_given, quantize_embeddings)
        st, params_host, streamed, head, rung = _stream_params(st, base, weights, shape, shards)
        detail, notes = {**detail, **rung}, notes + _params_notes(spec, streamed)
    st, host = _offload(st, offload, params_host, grads=bool(streamed) and spec is None)
    act_dtype = activation_dtype if activation_dtype is not None else param_dtype
    levers = _step_levers(model, count_given, levers, remat)
    shape, lv = _with_levers(
        shape, model, count_given, levers, batch_size, seq_len, act_dtype, target
    )
    remat = _streamed_remat(streamed, lv.remat, offload)
    w = (nf4, _expert_lora(shape, spec), head)
    act, act_detail, host_act, act_notes = _activations(
        shape, activations, batch_size, seq_len, act_dtype, remat, count_given, lv.target, w
    )
    act += _count_gather(act_detail, shape, P, spec, shards, activations)
    config = dict(param_dtype=param_dtype, optimizer=optimizer, remat=remat)
    config.update(batch_size=batch_size, seq_len=seq_len, offload=offload, lora=spec)
    model = shape.name or (f"{n / 1e9:.3g}B" if count_given else "config")
    config = _config(model, config, quantization, num_shards, accounting)
    host, disk, transfers = _transfers(host, offload, streamed, host_act)
    per = (P, G, S, master_weights, shards, accounting)
    up, up_notes = _update_phase(shape, offload, spec, opt, st, per)
    active = n if count_given else n - shape.inactive_expert_params  # k of E experts
    flops = int((6 if spec is None else 4) * active * batch_size * seq_len)
    notes += shard_notes + act_notes + up_notes
    extra = dict(transfers=transfers, disk=disk, flops=flops, update_phase=up)
    return _ledger(st, act, host, n, {**detail, **act_detail}, notes, config, **extra)
