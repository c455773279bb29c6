"""What a step keeps off the device, as one value: ``Offload`` (a state rung and the params
rung), read once from its text form (``"optimizer,params"``: a flag, a config file,
``estimate(offload=...)``) and handed on as the value. No JAX import: the job's option
parser uses it."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["PARAMS", "STATE_RUNGS", "Offload"]

#: The state rungs, from the fewest device bytes moved to the most: each one's ledgers that
#: leave the device (``"disk"``: state and masters in files, streamed through host memory).
STATE_RUNGS: dict[str, tuple[str, ...]] = {
    "none": (),
    "optimizer": ("optimizer_state",),
    "optimizer+masters": ("optimizer_state", "master_weights"),
    "disk": ("optimizer_state", "master_weights"),
}

#: The params rung's name in the text form (``"params"``, ``"optimizer,params"``).
PARAMS = "params"

#: The non-string values ``Offload.parse`` reads as a state rung.
_STATE_VALUES = {False: "none", None: "none", True: "optimizer"}


def _refuse(value: Any) -> ValueError:
    return ValueError(
        "offload must be False, 'optimizer', 'optimizer+masters', 'disk', 'params' or a "
        f"state rung with params ('optimizer,params'); got {value!r}."
    )


@dataclasses.dataclass(frozen=True)
class Offload:
    """The offload rungs of a step: which ledgers live in host memory (or on disk).

    Attributes:
      state: the state rung, a key of ``STATE_RUNGS``: ``"none"``, ``"optimizer"`` (the
        optimizer state in host memory), ``"optimizer+masters"`` (and the fp32 masters) or
        ``"disk"`` (state and masters in files, streamed through host memory).
      params: the params rung: the layer-stacked weights live in host memory and stream to
        the device one layer at a time (``jmem.Levers(offload_params=True)``, the job's
        ``--offload params``).

    ``str()`` is the text form (``"optimizer,params"``, ``"none"``), which ``parse`` reads
    back; the value is false when nothing is offloaded.

    Raises:
      ValueError: an unknown state rung or a non-bool ``params``.
    """

    state: str = "none"
    params: bool = False

    def __post_init__(self):
        if self.state not in STATE_RUNGS:
            raise ValueError(
                f"offload state {self.state!r} is unknown; choose from {tuple(STATE_RUNGS)}."
            )
        if not isinstance(self.params, bool):
            raise ValueError(f"offload params must be a bool; got {self.params!r}.")

    @classmethod
    def parse(cls, value: Any) -> Offload:
        """The ``Offload`` of ``value``: an ``Offload`` (returned as is), False/None
        (nothing), True (``"optimizer"``), a state rung, ``"params"``, or a state rung and
        ``"params"`` joined by a comma in either order (``"optimizer,params"``).

        Raises:
          ValueError: an unknown value, or two state rungs (``"optimizer,disk"``).
        """
        if isinstance(value, Offload):
            return value
        if not isinstance(value, str):
            if isinstance(value, bool) or value is None:
                return cls(_STATE_VALUES[value])
            raise _refuse(value)
        parts = [p.strip() for p in value.split(",")]
        states = [p for p in parts if p != PARAMS]
        if len(parts) > 1 and PARAMS not in parts or len(states) > 1:
            raise _refuse(value)
        if any(p not in STATE_RUNGS for p in states):
            raise _refuse(value)
        return cls(states[0] if states else "none", PARAMS in parts)

    @property
    def optimizer(self) -> bool:
        """The optimizer state leaves the device (any state rung)."""
        return self.state != "none"

    @property
    def disk(self) -> bool:
        """The state and masters live on disk."""
        return self.state == "disk"

    @property
    def ledgers(self) -> tuple[str, ...]:
        """The state ledgers that leave the device (``Ledger`` field names)."""
        return STATE_RUNGS[self.state]

    def __bool__(self) -> bool:
        return self.optimizer or self.params

    def __str__(self) -> str:
        if not self.params:
            return self.state
        return PARAMS if self.state == "none" else f"{self.state},{PARAMS}"
