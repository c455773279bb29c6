"""Advice from the planner: does a configuration fit, which ledger is short, and which
suggestions help (each a memory lever applied to the configuration), ordered by cost (memory
saved for speed or for what is trained); see ``docs/planner.md`` for the table.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any
from typing import Mapping

from jmem._src.planner.activations import REMAT_MODES
from jmem._src.planner.capacity import largest_seq_len
from jmem._src.planner.estimate import estimate
from jmem._src.planner.estimate import remat_of
from jmem._src.planner.estimate import with_remat
from jmem._src.planner.ledger import Ledger
from jmem._src.planner.offload import Offload
from jmem._src.units import GB
from jmem._src.units import parse_memory

__all__ = ["DEFAULT_RESERVE", "Advice", "Suggestion", "advise", "fits"]


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One item of ``advise``'s advice: a way to cut memory and what it costs.

    Attributes:
      name: what to do (``"8-bit optimizer states"``).
      cost: what it costs (speed, what is trained).
      changes: the ``estimate`` keywords it changes (``{"optimizer": "adamw_8bit"}``).
      total: the estimate's device bytes with the changes applied.
      fits: ``total`` fits the memory less the reserve.
      host: the estimate's host bytes with the changes applied (``Ledger.host_total``:
        offloaded state, streamed params, offloaded activations).
    """

    name: str
    cost: str
    changes: Mapping[str, Any]
    total: int
    fits: bool
    host: int = 0


@dataclasses.dataclass(frozen=True)
class Advice:
    """Verdict of :func:`advise` (bytes).

    Attributes:
      fits: ``ledger.total + reserve <= memory``.
      short: ``None`` when it fits, ``"states"`` when the model state alone (params, grads,
        optimizer, masters) does not fit, else ``"activations"``.
      short_by: bytes missing (0 when it fits).
      suggestions: ``Suggestion``s ordered by cost (cheapest first), each applied alone,
        with its new total.
      plan: suggestions applied cumulatively in cost order (states first, then activations)
        until the configuration fits; ``plan_total`` is the total after the last one
        (the plan is empty when it fits already; it may end short of fitting).
      host_memory: host memory (bytes) the printout judges each lever's host bytes
        against (``jmem estimate --host-memory``); None: not judged.

    The printout's figures are the planner's (no compile); GB = 1e9 bytes.
    """

    fits: bool
    short: str | None
    short_by: int
    memory: int
    reserve: int
    ledger: Ledger
    suggestions: tuple[Suggestion, ...]
    plan: tuple[Suggestion, ...] = ()
    host_memory: int | None = None

    @property
    def levers(self) -> tuple[Suggestion, ...]:
        """Deprecated: ``suggestions``."""
        warnings.warn(
            "Advice.levers is deprecated and will be removed in the next release: use "
            "Advice.suggestions",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.suggestions

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
        if self.suggestions:
            lines.append("levers, cheapest first (planner-only estimates, GB = 1e9 B):")
            for i, lv in enumerate(self.suggestions, 1):
                mark = "fits" if lv.fits else "still short"
                lines.append(
                    f"  {i}. {lv.name}: {lv.total / GB:.2f} GB ({mark}){self._host(lv)}; "
                    f"cost: {lv.cost}"
                )
        if self.plan:
            lines.append("cumulative plan:")
            for lv in self.plan:
                lines.append(f"  + {lv.name}: {lv.total / GB:.2f} GB")
            lines.append("  => fits" if self.plan[-1].fits else "  => still does not fit")
        return "\n".join(lines)

    def _host(self, lv: Suggestion) -> str:
        """``, host X GB`` for a lever with host bytes, and whether it exceeds
        ``host_memory``."""
        if not lv.host:
            return ""
        over = self.host_memory is not None and lv.host > self.host_memory
        above = f", above --host-memory {self.host_memory / GB:.2f} GB" if over else ""
        return f", host {lv.host / GB:.2f} GB{above}"


def _offload(config: Mapping[str, Any]) -> Offload:
    """The configuration's offload rungs (``estimate``'s ``offload=``, parsed)."""
    return Offload.parse(config.get("offload", False))


def _apply(config: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with one suggestion's ``changes``; a remat change goes into the levers."""
    new = {**config, **changes}
    return with_remat(new, changes["remat"]) if "remat" in changes else new


def _check_reserve(memory: Any, reserve: float) -> tuple[int, int]:
    """``(memory, reserve)`` in int bytes; the reserve must leave some memory."""
    mem = parse_memory(memory)
    reserve = int(reserve)
    if reserve < 0 or reserve >= mem:
        raise ValueError(
            f"reserve ({reserve / GB:.4g} GB) must be >= 0 and below the memory "
            f"({mem / GB:.4g} GB); pass both with a unit, e.g. '24GB' and '2GB'"
        )
    return mem, reserve


def _optimizer_levers(config: Mapping[str, Any]) -> list[tuple[str, str, dict]]:
    """Low-bit optimizer states (for Adam/AdamW) and optimizer/master offload."""
    opt = config.get("optimizer", "adamw")
    cands = []
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
    off = _offload(config)
    if not off.optimizer:
        cands.append(
            (
                "offload optimizer state to host",
                "host<->device copies of the moments every step (PCIe-bound)",
                {"offload": dataclasses.replace(off, state="optimizer")},
            )
        )
    if off.state != "optimizer+masters":
        cands.append(
            (
                "offload optimizer state and masters to host",
                "more PCIe traffic: moments and fp32 masters every step",
                {"offload": dataclasses.replace(off, state="optimizer+masters")},
            )
        )
    cands += _params_lever(config) + _disk_lever(config)
    return cands


def _params_lever(config: Mapping[str, Any]) -> list[tuple[str, str, dict]]:
    """The params rung, after the state rungs (it moves far more bytes per step: the
    weights 3x) and before disk, under remat, as jmem runs it: a frozen base (``lora``)
    streamed with the state where it is, or (full fine-tuning) the trained params streamed
    with the optimizer state and masters in host memory (the job's
    ``--offload optimizer,params``: it updates host params with a host state only)."""
    off = _offload(config)
    remat = remat_of(config)
    if off.params or remat in (None, "none"):
        return []
    cost = "backward; PCIe-bound: ~2 s per 50 GB at 25 GB/s)"
    if config.get("lora") is not None:
        return [
            (
                "stream the frozen base from host per layer (--offload params)",
                f"host-to-device copies of the base 3x per step (forward, remat recomputation, {cost}",
                {"offload": dataclasses.replace(off, params=True)},
            )
        ]
    if off.disk:  # the job streams full fine-tuning's params with a host state only
        return []
    return [
        (
            "stream the params from host per layer, with the optimizer state and masters in "
            "host memory (--offload optimizer,params)",
            "host-to-device copies of the params 3x per step (forward, remat recomputation, "
            f"{cost}, the gradients to host and back, the update leaf by leaf",
            {"offload": Offload("optimizer+masters", params=True)},
        )
    ]


def _disk_lever(config: Mapping[str, Any]) -> list[tuple[str, str, dict]]:
    """The last offload rung: state and masters on disk (the same device bytes as
    ``optimizer+masters``; it frees the host memory, at disk bandwidth)."""
    off = _offload(config)
    if off.disk:
        return []
    return [
        (
            "optimizer state and masters on disk (NVMe)",
            "as optimizer+masters, plus disk reads and writes of them every step "
            "(~3 GB/s NVMe: several times slower; for when host memory is short too)",
            {"offload": dataclasses.replace(off, state="disk")},
        )
    ]


def _sharding_lever(
    model: Any, config: Mapping[str, Any], avail: int
) -> list[tuple[str, str, dict]]:
    """ZeRO-3 over the fewest devices (a power of two up to 64) that makes it fit."""
    base_k = config.get("num_shards", 1)
    for k in (2, 4, 8, 16, 32, 64):
        if k > base_k and estimate(model, **{**config, "num_shards": k}).total <= avail:
            return [
                (
                    f"ZeRO-3 sharding over {k} devices",
                    f"{k} devices; ~1.5x the all-reduce traffic",
                    {"num_shards": k},
                )
            ]
    return []


def _lora_levers(config: Mapping[str, Any]) -> list[tuple[str, str, dict]]:
    """LoRA and QLoRA, for a full fine-tune (they change what is trained)."""
    if config.get("lora") is not None:
        return []
    qv = (8, ("q_proj", "v_proj"))
    return [
        ("LoRA r=8 on q/v (frozen base)", "trains adapters only, not the full model", {"lora": qv}),
        (
            "QLoRA: NF4 base + LoRA r=8",
            "adapters only; 4-bit base dequantized per matmul",
            {"lora": qv, "quantization": "nf4"},
        ),
    ]


_REMAT_COSTS = {
    "selective": "a few % more FLOPs (recompute attention and element-wise ops)",
    "full": "~33% more FLOPs (recompute each layer's forward)",
    "offload": "host<->device copies of the saved residuals",
    "offload_inputs": "~33% more FLOPs and host<->device copies of each layer's input",
}


def _activation_levers(model: Any, config: Mapping[str, Any], avail: int):
    """Gradient accumulation, stronger remat, and the longest shorter sequence (a multiple
    of 1,024 tokens, as ``largest_seq_len_by_remat``) that fits ``avail`` bytes: never a shorter one."""
    cands = []
    b = config.get("batch_size", 1)
    if b > 1:
        cands.append(
            (
                f"gradient accumulation ({b} micro-batches of 1)",
                "same math, more sequential steps",
                {"batch_size": 1},
            )
        )
    cur = remat_of(config) or "none"
    for r, cost in _REMAT_COSTS.items():
        if REMAT_MODES.index(r) > REMAT_MODES.index(cur):
            cands.append((f"remat '{r}'", cost, {"remat": r}))
    s = config.get("seq_len", 2048)
    rest = {k: v for k, v in config.items() if k != "seq_len"}
    longest = largest_seq_len(avail, model, reserve=0, multiple_of=1024, max_seq_len=s - 1, **rest)
    if longest:
        cands.append(
            (
                f"shorter sequences ({longest}, the longest that fits)",
                "changes the training data layout",
                {"seq_len": longest},
            )
        )
    return cands


def _priced(
    model: Any, config: Mapping[str, Any], cands, current: int, avail: int
) -> tuple[Suggestion, ...]:
    """Each candidate applied alone; drops those that are invalid or save nothing."""
    levers = []
    for name, cost, changes in cands:
        try:
            led = estimate(model, **_apply(config, changes))
        except ValueError:
            continue
        t = led.total
        if t >= current:  # a lever that saves nothing here is no advice
            continue
        levers.append(Suggestion(name, cost, changes, t, t <= avail, led.host_total))
    return tuple(levers)


#: Bytes ``advise``, ``jmem estimate --memory`` and the job's ``--dry-run`` keep free of the
#: device memory (fragmentation, workspace, the runtime's context).
DEFAULT_RESERVE = 2 * 10**9


def fits(peak: int, memory: Any, reserve: float = DEFAULT_RESERVE) -> bool:
    """``peak + reserve <= memory``: the one rule ``advise`` (on the estimate) and the job's
    dry run (on the compiled peak) decide fit by."""
    mem, reserve = _check_reserve(memory, reserve)
    return int(peak) + reserve <= mem


def advise(memory: Any, model: Any, *, reserve: float = DEFAULT_RESERVE, **config) -> Advice:
    """Does ``model`` train in ``memory``? If not, which ledger is short and what helps.

    States short (params + grads + optimizer + masters + reserve > memory): remat cannot
    help; suggestions in cost order are 8-bit optimizer states, 4-bit states, offloading the
    moments, offloading the masters too, streaming the weights from host memory per layer
    under remat (``offload="params"``: with ``lora`` the frozen base, the job's ``--offload
    params``; for full fine-tuning the trained params with the state and masters offloaded,
    ``"optimizer+masters,params"``, the job's ``--offload optimizer,params``),
    state on disk, ZeRO sharding over the fewest devices that fit, and LoRA / QLoRA
    (changes what is trained). Activations short: gradient accumulation
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
      ValueError: as :func:`estimate`, or a reserve outside ``[0, memory)``.
    """
    mem, reserve = _check_reserve(memory, reserve)
    if "offload" in config:
        config = {**config, "offload": _offload(config)}
    led = estimate(model, **config)
    avail = mem - reserve
    if fits(led.total, mem, reserve):
        return Advice(True, None, 0, mem, reserve, led, ())
    short = "states" if led.static > avail else "activations"
    if short == "states":
        cands = _optimizer_levers(config) + _sharding_lever(model, config, avail)
        cands += _lora_levers(config)
    else:
        cands = _activation_levers(model, config, avail)
    levers = _priced(model, config, cands, led.total, avail)
    plan = _plan(model, config, avail)
    return Advice(False, short, led.total - avail, mem, reserve, led, levers, plan)


# The cumulative plan: each step maps the current config to its change, or None.


def _to_8bit(c: Mapping[str, Any]) -> dict | None:
    opt = c.get("optimizer", "adamw")
    return {"optimizer": opt + "_8bit"} if opt in ("adamw", "adam") else None


def _to_micro_batch(c: Mapping[str, Any]) -> dict | None:
    return {"batch_size": 1} if c.get("batch_size", 1) > 1 else None


def _to_remat(mode: str, c: Mapping[str, Any]) -> dict | None:
    cur = remat_of(c) or "none"
    weaker = REMAT_MODES[: REMAT_MODES.index(mode)]
    return {"remat": mode} if cur in weaker else None


def _to_offload_optimizer(c: Mapping[str, Any]) -> dict | None:
    off = _offload(c)
    return None if off.optimizer else {"offload": dataclasses.replace(off, state="optimizer")}


def _to_offload_masters(c: Mapping[str, Any]) -> dict | None:
    off = _offload(c)
    if off.state != "optimizer":
        return None
    return {"offload": dataclasses.replace(off, state="optimizer+masters")}


def _to_offload_params(c: Mapping[str, Any]) -> dict | None:
    """The params rung under remat (``_params_lever``): a frozen base with the state rung in
    use, full fine-tuning's params with the optimizer state and masters."""
    lever = _params_lever(c)
    return lever[0][2] if lever else None


def _more_shards(k: int, c: Mapping[str, Any]) -> dict | None:
    """The lever "ZeRO-3 over k devices": None when the config already has as many."""
    return {"num_shards": k} if c.get("num_shards", 1) < k else None


_PLAN_STEPS = (
    ("8-bit optimizer states", "quantize/dequantize kernels", _to_8bit),
    ("gradient accumulation (micro-batch 1)", "more sequential steps", _to_micro_batch),
    ("remat 'selective'", "a few % FLOPs", functools.partial(_to_remat, "selective")),
    ("offload optimizer state", "PCIe copies of the moments", _to_offload_optimizer),
    ("remat 'full'", "~33% FLOPs", functools.partial(_to_remat, "full")),
    ("offload masters too", "PCIe copies of the masters", _to_offload_masters),
    ("stream the params per layer", "PCIe copies of the streamed weights 3x", _to_offload_params),
) + tuple(
    (f"ZeRO-3 over {k} devices", f"{k} devices", functools.partial(_more_shards, k))
    for k in (2, 4, 8, 16, 32, 64)
)


def _plan(model: Any, config: Mapping[str, Any], avail: int) -> tuple[Suggestion, ...]:
    """Greedy cumulative plan: cheapest lever that lowers the total, until it fits."""
    cfg, plan = dict(config), []
    total = estimate(model, **cfg).total
    for name, cost, change in _PLAN_STEPS:
        if total <= avail:
            break
        ch = change(cfg)
        if not ch:
            continue
        new = _apply(cfg, ch)
        led = estimate(model, **new)
        t = led.total
        if t < total:
            cfg, total = new, t
            plan.append(Suggestion(name, cost, ch, t, t <= avail, led.host_total))
    return tuple(plan)
