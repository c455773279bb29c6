"""Which smaller GPU cards (device memory sizes) a step fits: with ``--memory`` not given the step
is judged against the target's own memory (79.11 GiB for ``h100_sxm``), and this adds one line
for the 24, 32, 40 and 48 GiB cards below it, by the same rule (``planner.fits``: compiled
device peak + the 2 GB reserve within the card), with the cheapest lever of the planner's
advice (``planner.advise``) that brings each card it misses under."""

from __future__ import annotations

from typing import Callable
from typing import Mapping

from jmem._src.measure import format_bytes
from jmem._src.planner.advice import DEFAULT_RESERVE
from jmem._src.planner.advice import Advice
from jmem._src.planner.advice import fits
from jmem._src.planner.offload import Offload

#: Device memories (GiB) of the cards users compare with: RTX 3090/4090 (24), RTX 5090 (32),
#: A100 40GB (40), L40S/RTX 6000 Ada (48).
CARDS_GIB = (24, 32, 40, 48)


def smaller_cards(memory: int) -> tuple[int, ...]:
    """The ``CARDS_GIB`` sizes (GiB) below ``memory`` bytes, smallest first."""
    return tuple(g for g in CARDS_GIB if g * 2**30 < memory)


def job_flags(changes: Mapping) -> str:
    """The ``jmem finetune`` flags for one lever of ``planner.advise`` (its ``changes``), or
    "" for a change the job has no flag for (LoRA, quantization: the job is QLoRA)."""
    flags = []
    if "offload" in changes:
        off = Offload.parse(changes["offload"])
        if off.disk:
            flags.append("--offload-dir DIR" + (" --offload params" if off.params else ""))
        else:
            parts = ["optimizer"] * off.optimizer + ["params"] * off.params
            flags.append("--offload " + ",".join(parts))
    if "optimizer" in changes:
        flags.append(f"--optimizer {changes['optimizer']}")
    if "remat" in changes:
        flags.append(f"--remat {changes['remat']}")
    if "seq_len" in changes:
        flags.append(f"--seq-len {changes['seq_len']}")
    if "batch_size" in changes:
        flags.append("--batch-size 1 --grad-accum B")
    if "num_shards" in changes:
        flags.append(f"--mesh fsdp={changes['num_shards']}")
    return " ".join(flags)


def host_label(host: int, host_memory: int | None) -> str:
    """``", needs X GiB of host memory, above --host-memory Y"`` when a lever's ``host``
    bytes exceed ``host_memory`` (bytes; None: no limit), else ""."""
    if host_memory is None or host <= host_memory:
        return ""
    return (
        f", needs {host / 2**30:.2f} GiB of host memory, above --host-memory "
        f"{host_memory / 2**30:.2f} GiB"
    )


def candidates(advice: Advice | None, host_memory: int | None = None) -> list[tuple]:
    """The levers of ``advice`` that bring its memory under, in the order the dry run
    tries them: each lever that fits alone (cheapest first) and whose host bytes are
    within ``host_memory`` (bytes; None: no limit), then the cumulative plan when it fits,
    then the levers that fit the device but not ``host_memory``, their ``what`` saying so
    (``host_label``). Each ``(what, planner device total, changes)``: the job's flags and
    the planner's name for the lever, bytes, and the planner ``changes`` applied in order
    (one lever's, or the plan's). Empty for no advice (a card no lever can reach)."""
    if advice is None:
        return []
    within, over = [], []
    for lever in advice.suggestions:
        flags = job_flags(lever.changes)
        if lever.fits and flags:
            name = lever.name.split(" (--")[0]  # the params rung names its flag already
            label = host_label(lever.host, host_memory)
            (over if label else within).append(
                (f"{flags} ({name}){label}", lever.total, (lever.changes,))
            )
    if advice.plan and advice.plan[-1].fits:
        names = " + ".join(lv.name for lv in advice.plan)
        flags = " ".join(f for f in (job_flags(lv.changes) for lv in advice.plan) if f)
        label = host_label(advice.plan[-1].host, host_memory)
        plan = f"{flags} (the planner's plan: {names}){label}", advice.plan[-1].total
        (over if label else within).append((*plan, tuple(lv.changes for lv in advice.plan)))
    return within + over


def cheapest(advice: Advice | None, host_memory: int | None = None) -> tuple[str, int] | None:
    """``(what, planner device total)`` of the first of ``candidates(advice, host_memory)``:
    the cheapest lever that fits alone within ``host_memory`` (bytes; None: no limit), else
    the plan, else the cheapest lever over ``host_memory``, labelled so; None when there is
    none (also for no advice: a card no lever can reach)."""
    found = candidates(advice, host_memory)
    return found[0][:2] if found else None


def lever_fits(total: int, memory: int, excess: int = 0) -> bool:
    """Whether a lever whose planner device total is ``total`` (bytes) brings the step under
    ``memory`` (bytes): the rule of every lever the dry run names (``planner.fits`` with
    the 2 GB reserve, the compile's ``excess`` bytes over the planner added to the total,
    as ``planner.advise`` judges its levers with that excess in its reserve)."""
    return fits(int(total) + int(excess), memory, DEFAULT_RESERVE)


def card_fits(peak: int, memory: int, reserve: int) -> dict[int, bool]:
    """Per card of ``smaller_cards(memory)`` (GiB): whether ``peak + reserve`` fits it."""
    return {g: fits(peak, g * 2**30, reserve) for g in smaller_cards(memory)}


def card_lines(
    peak: int,
    memory: int,
    reserve: int,
    advise_at: Callable[[int], Advice],
    excess: int = 0,
    host_memory: int | None = None,
    check: Callable | None = None,
) -> tuple[list[str], dict]:
    """The dry run's lines for the cards below ``memory`` (bytes): which ones the compiled
    ``peak`` (bytes) fits with ``reserve`` (bytes), and per card it misses the cheapest
    lever that brings it under (``advise_at(card bytes)``: ``planner.advise`` at that
    memory, or None when the card is below the reserve, which the caller makes judge
    the planner's totals plus ``excess``, the compiled peak's bytes over the planner's),
    a lever over ``host_memory`` (bytes) labelled so (``candidates``), cards sharing a
    lever on one line; and the record for ``dry_run.json`` (``{"fits": {GiB: bool},
    "levers": {GiB: [what, planner bytes] or None}}``; with ``check`` and a card missed,
    ``"checked": {GiB: [what, compiled device bytes, host bytes, transfer bytes, seconds,
    GB/s, fits] or None}``).

    ``check``: ``advice_check.AdviceCheck`` (``changes -> Checked``, None when not
    compiled): each card's lever is compiled and printed with the compile's device and
    host bytes and transfers, and one that misses its card gives way to the next; None:
    the planner's figures, labelled planner-only. No lines when no card is below
    ``memory``."""
    verdicts = card_fits(peak, memory, reserve)
    if not verdicts:
        return [], {}
    yes = [str(g) for g, ok in verdicts.items() if ok]
    no = [str(g) for g, ok in verdicts.items() if not ok]
    said = [f"fits {'/'.join(yes)} GiB"] * bool(yes) + [f"does not fit {'/'.join(no)} GiB"] * bool(
        no
    )
    lines = [f"Also (the same rule, cards below {format_bytes(memory)}): " + "; ".join(said)]
    found = {
        g: candidates(advise_at(g * 2**30), host_memory) for g, ok in verdicts.items() if not ok
    }
    if found:
        over = f", plus the compile's {format_bytes(excess)} over it" if excess > 0 else ""
        how = "; each compiled for the target" if check else ""
        lines.append(f"  cheapest lever that brings it under (the planner's advice{over}{how}):")
    groups: dict = {}
    levers: dict = {}
    checked: dict = {}
    for g in sorted(found, reverse=True):  # the largest card first: the cheapest levers
        said, levers[g], checked[g] = _card_advice(g * 2**30, reserve, found[g], check, host_memory)
        groups.setdefault(said, []).append(str(g))
    for said, cards in groups.items():
        where = f"  on a {'/'.join(sorted(cards, key=int))} GiB card: "
        lines += [where + said[0]] + [f"    {more}" for more in said[1:]]
    record = {"fits": verdicts, "levers": {g: lv and list(lv) for g, lv in sorted(levers.items())}}
    if check is not None and checked:
        record["checked"] = {g: checked[g] for g in sorted(checked)}
    return lines, record


def _card_advice(
    card: int, reserve: int, found: list, check, host_memory: int | None = None
) -> tuple[tuple, tuple, list]:
    """``(lines, (what, planner bytes) or None, checked row or None)`` for one card
    (``card`` bytes): the first of ``found`` (``candidates``) whose compile (``check``)
    fits the card, each tried before it that misses named on a line of its own, its
    compiled host bytes over ``host_memory`` (bytes) labelled so (``host_label``); the
    planner's figures, labelled so, where ``check`` is None or does not compile it
    (``check.why_not``)."""
    if not found:
        return ("no lever or plan of the planner's advice brings it under",), None, None
    missed, row = [], None
    for what, total, changes in found:
        done = None if check is None else check(changes)
        planner = f"planner: {format_bytes(total)}"
        if done is None:
            why = "" if check is None else f"; not compiled: {check.why_not(changes)}"
            return (f"{what}, {planner} (planner-only{why})", *missed), (what, total), None
        row = [what, done.peak_bytes, done.host_bytes, sum(done.transfers.values())]
        row += [done.seconds, done.pcie_gbps, done.fits(card, reserve)]
        if row[-1]:
            over = "" if "--host-memory" in what else host_label(done.host_bytes, host_memory)
            said = f"{what}; {done.describe()}{over.replace(', needs', ', which needs')}"
            return (f"{said}; {planner}", *missed), (what, total), row
        missed.append(f"tried {what}: {done.describe()}: does not fit")
    return ("no lever of the planner's advice compiles under it", *missed), None, row


def memory_lines(
    memory: int,
    reserve: int,
    advice: Advice | None,
    excess: int = 0,
    host_memory: int | None = None,
    check: Callable | None = None,
) -> tuple[list[str], dict]:
    """The dry run's advice for a ``--memory`` (bytes) its compiled step misses, as
    ``card_lines`` gives it per card: the cheapest lever of ``advice`` (``planner.advise``
    at ``memory``, its totals judged with ``excess`` over the reserve; None: no lever can
    reach it) within ``host_memory`` (bytes), compiled by ``check`` when given (the next
    lever when one misses); and its record (``{"lever": [what, planner bytes] or None,
    "checked": [what, device, host, transfer bytes, seconds, GB/s, fits] or None}``)."""
    over = f", plus the compile's {format_bytes(excess)} over it" if excess > 0 else ""
    how = "; compiled for the target" if check else ""
    found = candidates(advice, host_memory)
    said, lever, row = _card_advice(memory, reserve, found, check, host_memory)
    lines = [f"cheapest lever that brings it under (the planner's advice{over}{how}):"]
    lines += [f"  {said[0]}"] + [f"    {more}" for more in said[1:]]
    return lines, {"lever": lever and list(lever), "checked": row}
