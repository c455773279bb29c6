"""The result of the planner: a training step's device bytes in five ledgers (params, grads,
optimizer state, masters, activations), split the way ZeRO (Rajbhandari et al. 2020)
accounts them, with the host and disk bytes of the offload rungs and what they move per
step. Accounting conventions and sources are in ``docs/planner.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Mapping

from jmem._src.units import GB
from jmem._src.units import GiB
from jmem._src.units import format_count

__all__ = ["DISK_GBPS", "PCIE_GBPS", "Ledger"]

#: Effective host<->device bandwidth of PCIe 4.0 x16, GB/s: 16 GT/s x 16 lanes x 128/130 is
#: 31.5 GB/s per direction; CUDA's bandwidthTest with pinned memory measures ~25 GB/s.
PCIE_GBPS = 25.0
#: Disk bandwidth, GB/s: a PCIe 3.0 x4 NVMe drive's sequential rate (~3.5 GB/s read, ~3
#: GB/s write on datasheets); PCIe 4.0 drives reach ~7 GB/s.
DISK_GBPS = 3.0


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Device bytes of one training configuration, by ledger (all ints, bytes).

    Attributes:
      params, grads, optimizer_state, master_weights, activations: device bytes.
      host: bytes kept in host memory (offloaded optimizer state, masters, activations,
        ``"params"``: the streamed base, or the params, whole).
      n_params: parameters of the model; trainable_params: those that get gradients.
      detail: finer split (``activation:layers``, ``lora:params``, ...), bytes.
      notes: assumptions and caveats that apply to this configuration.
      config: the arguments that produced it.
      transfers: bytes each step moves per offload rung: ``"optimizer"`` (state in and out
        over host<->device: 2 x its bytes), ``"master_weights"`` (2 x), ``"disk"``
        (disk<->host: 2 x state and masters, read and written back), ``"params"``
        (host-to-device: the layer stack 3 x per micro-batch, in the forward pass, the remat
        recomputation and the backward pass, plus the embedding, final norm and head once),
        ``"activations"`` (``remat="offload"``/``"offload_inputs"``: the offloaded layer
        inputs to host in the forward pass and back in the backward, 2 x their bytes).
      disk: bytes kept on disk (``offload="disk"``), by ledger.
      flops: compute FLOPs of one step (6 N tokens; 4 N tokens for a frozen base with
        LoRA, whose weights get no gradient; Kaplan et al. 2020), attention excluded.
      update_phase: device bytes at the peak of the optimizer update when it is modelled
        apart (full fine-tuning with the optimizer state offloaded, updated leaf by leaf
        after the backward pass, when the activations are gone): the params and grads on
        the device then plus what the update of one leaf, or one row of a layer stack,
        holds; 0 when not modelled.
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
    transfers: Mapping[str, int] = dataclasses.field(default_factory=dict)
    disk: Mapping[str, int] = dataclasses.field(default_factory=dict)
    flops: int = 0
    update_phase: int = 0

    LEDGERS = ("params", "grads", "optimizer_state", "master_weights", "activations")

    @property
    def static(self) -> int:
        """Model-state bytes (everything but activations)."""
        return self.params + self.grads + self.optimizer_state + self.master_weights

    @property
    def total(self) -> int:
        """Device bytes: the five ledgers summed (the forward/backward pass), or the
        optimizer update's ``update_phase`` when that is larger."""
        return max(self.static + self.activations, self.update_phase)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def transfer_seconds(
        self, pcie_gbps: float = PCIE_GBPS, disk_gbps: float = DISK_GBPS
    ) -> dict[str, float]:
        """Seconds per step of each rung's transfers: host<->device bytes at ``pcie_gbps``
        GB/s (1e9 bytes), disk bytes at ``disk_gbps`` GB/s."""
        if not (pcie_gbps > 0 and disk_gbps > 0):
            raise ValueError(
                f"pcie_gbps and disk_gbps must be > 0 GB/s; got {pcie_gbps}, {disk_gbps}."
            )
        return {
            k: v / ((disk_gbps if k == "disk" else pcie_gbps) * GB)
            for k, v in self.transfers.items()
        }

    def trade(self, pcie_gbps: float = PCIE_GBPS, disk_gbps: float = DISK_GBPS) -> str:
        """``saves X GiB, moves Y GB per step (...)``: the offload rungs' trade in one line."""
        # the params rung's host bytes less the head it fetches for the loss phase
        # (``detail["activation:streamed_head"]``)
        saved = self.host_total - self.host.get("activations", 0) + sum(self.disk.values())
        saved -= self.detail.get("activation:streamed_head", 0)
        secs = self.transfer_seconds(pcie_gbps, disk_gbps)
        parts = ", ".join(
            f"{k.replace('_', ' ')} {v / GB:.3g} GB ({secs[k]:.3g} s at "
            f"{disk_gbps if k == 'disk' else pcie_gbps:g} GB/s)"
            for k, v in self.transfers.items()
        )
        return (
            f"offload saves {saved / GiB:.3g} GiB of device memory, moves "
            f"{sum(self.transfers.values()) / GB:.3g} GB per step: {parts or 'nothing'}; "
            f"compute {self.flops / 1e12:.3g} TFLOP per step"
        )

    def as_dict(self) -> dict[str, int]:
        d = {k: getattr(self, k) for k in self.LEDGERS}
        if self.update_phase:
            d["update_phase"] = self.update_phase
        d["total"] = self.total
        return d

    def __str__(self) -> str:
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items() if v not in (None, False))
        head = (
            f"{format_count(self.n_params)} params ({format_count(self.trainable_params)} trainable)"
            + (f"; {cfg}" if cfg else "")
        )
        rows = [(k.replace("_", " "), getattr(self, k)) for k in self.LEDGERS]
        if self.update_phase:
            rows.append(("optimizer update phase", self.update_phase))
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
