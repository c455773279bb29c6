"""The dry run's advice for smaller cards, checked by compiling it: each lever the planner
names for a card (``card_fit``) is applied to the job's flags and the step compiled again
for the same target (the dry run's own builder, abstract shapes, nothing allocated), so the
printed lever carries the compile's device peak and host bytes (``pinned_host`` buffers,
``MemoryReport.host_peak_bytes``), not the planner's.

A compile that misses its card makes the dry run try the card's next lever; at most
``MAX_COMPILES`` compiles per dry run, each configuration compiled once (cached).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
import time
from typing import Mapping
from typing import Sequence

from jmem._src.planner.advice import DEFAULT_RESERVE
from jmem._src.planner.advice import fits
from jmem._src.planner.offload import Offload
from jmem._src.units import GB

#: Compiles of suggested levers one dry run makes at most (each a full compile of the step).
MAX_COMPILES = 3

#: ``--memory`` of a lever's compile: large enough that the dry run judges no smaller cards
#: (no advice of its own) and names no lever; the caller judges the peak against the card.
_AS_GIVEN = 1 << 50


@dataclasses.dataclass(frozen=True)
class Checked:
    """One compile of a lever applied to the job (bytes; seconds at ``pcie_gbps``).

    Attributes:
      peak_bytes: the compiled device peak (``MemoryReport.peak_bytes``).
      host_bytes: the compiled host bytes (``pinned_host`` buffers, ``host_peak_bytes``).
      transfers: ``{rung: bytes}`` host<->device (disk<->host for ``disk``) per step: the
        planner's ledger for the lever's configuration, its offloaded layer inputs
        (``activations``) taken from the compile instead where it has host temporaries
        (each written in the forward pass, read in the backward: 2 x their bytes).
      seconds: the transfers' time per step at ``pcie_gbps`` (``disk_gbps`` for disk).
      pcie_gbps: the host<->device rate (GB/s, GB = 1e9 B; ``--pcie-gbps``).
    """

    peak_bytes: int
    host_bytes: int
    transfers: Mapping[str, int]
    seconds: float
    pcie_gbps: float

    def fits(self, card: int, reserve: int = DEFAULT_RESERVE) -> bool:
        """The compiled peak plus ``reserve`` within ``card`` bytes (``planner.fits``)."""
        return fits(self.peak_bytes, card, reserve)

    def describe(self) -> str:
        """``compiled: 10.23 GiB device + 14.00 GiB host, moves 30.1 GB per step (1.2 s at
        25 GB/s --pcie-gbps)`` (GB = 1e9 B; disk's bytes at ``--disk-gbps``)."""
        moved = sum(self.transfers.values())
        disk = ", disk at --disk-gbps" if self.transfers.get("disk") else ""
        how = (
            f"moves {moved / GB:.3g} GB per step ({self.seconds:.3g} s at "
            f"{self.pcie_gbps:g} GB/s --pcie-gbps{disk})"
            if moved
            else "no transfers"
        )
        return (
            f"compiled: {self.peak_bytes / 2**30:.2f} GiB device + "
            f"{self.host_bytes / 2**30:.2f} GiB host, {how}"
        )


def job_options(config, changes: Sequence[Mapping]) -> dict | None:
    """The ``FinetuneConfig.replace`` options for levers' planner ``changes`` applied in
    order (a plan's levers cumulatively), or None for a change this check does not compile
    (sharding over more devices: ``num_shards``; a LoRA or quantization change the job has
    no flag for)."""
    options: dict = {}
    for change in changes:
        for key, value in change.items():
            if key == "offload":
                off = Offload.parse(value)
                parts = ["optimizer"] * off.optimizer * (not off.disk) + ["params"] * off.params
                options["offload"] = ",".join(parts) or "none"
                options["offload_dir"] = "" if off.disk else None  # "": the compile's own dir
            elif key in ("optimizer", "remat", "seq_len"):
                options[key] = value
            elif key == "batch_size":  # microbatches of one sequence
                options["grad_accum"] = config.data.batch_size
            else:
                return None
    return options


class AdviceCheck:
    """Compiles levers applied to the job's ``config`` (resolved; the dry run's) for
    ``target`` on ``mesh``, at most ``limit`` compiles, each configuration once.
    ``compiles``: the compiles made; ``seconds``: their wall time."""

    def __init__(self, config, cfg, mesh=None, target=None, limit: int = MAX_COMPILES):
        self.config, self.cfg, self.mesh, self.target = config, cfg, mesh, target
        self.limit, self.compiles, self.seconds = limit, 0, 0.0
        self._cache: dict = {}

    def __call__(self, changes: Sequence[Mapping]) -> Checked | None:
        """The compile of ``changes`` applied to the job (``job_options``); None when it is
        not compiled (a change the check cannot apply, or ``limit`` compiles made)."""
        options = job_options(self.config, changes)
        if options is None:
            return None
        key = tuple(sorted(options.items()))
        if key not in self._cache:
            if self.compiles >= self.limit:
                return None
            probe = {k: "D" if k == "offload_dir" and v == "" else v for k, v in options.items()}
            try:  # flags the job refuses together (a CliError): not compiled
                self.config.replace(**probe)
            except ValueError:
                self._cache[key] = None
                return None
            self.compiles += 1
            self._cache[key] = self._compile(options)
        return self._cache[key]

    def why_not(self, changes: Sequence[Mapping]) -> str:
        """Why ``changes`` were not compiled (``__call__`` returned None)."""
        options = job_options(self.config, changes)
        if options is None:
            return "a change the job's flags on this mesh do not make (sharding, LoRA)"
        if tuple(sorted(options.items())) in self._cache:
            return "the job refuses these flags together"
        return f"the dry run compiles at most {self.limit} levers"

    def _compile(self, options: dict) -> Checked:
        """The dry run of the job with ``options``, its printout silenced."""
        from jmem._src.finetune.dry_run import dry_run  # noqa: PLC0415 (it imports this)

        t0 = time.time()
        with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
            if options.get("offload_dir") == "":
                options = {**options, "offload_dir": out}
            config = self.config.replace(**options, memory=_AS_GIVEN, out=out)
            record = dry_run(config, self.cfg, self.mesh, self.target)
        self.seconds += time.time() - t0
        return checked(record, config.execution.pcie_gbps, config.execution.disk_gbps)


def checked(record: Mapping, pcie_gbps: float, disk_gbps: float) -> Checked:
    """``Checked`` from a dry run's record (``dry_run.json``): its compiled device peak and
    host bytes, and its planner transfers with the offloaded layer inputs taken as 2 x the
    compile's host temporaries where it has them."""
    compiled = record["compiled"]
    transfers = dict(record["transfers"])
    host_temp = int(compiled.get("host_temp_bytes") or 0)
    if "activations" in transfers and host_temp:
        transfers["activations"] = 2 * host_temp
    seconds = sum(
        v / ((disk_gbps if k == "disk" else pcie_gbps) * GB) for k, v in transfers.items()
    )
    host = int(compiled.get("host_peak_bytes") or 0)
    return Checked(int(compiled["peak_bytes"]), host, transfers, seconds, pcie_gbps)
