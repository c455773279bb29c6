"""Batches of packed rows, shuffled deterministically per epoch, with an exact resumable
``Position``."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Iterator

import numpy as np

from jmem._src.data.packing import pack_examples


@dataclasses.dataclass(frozen=True)
class Position:
    """Exact place in the stream: ``epoch`` and the next example ``index`` within it."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict) -> "Position":
        return cls(int(d["epoch"]), int(d["index"]))


class PackedDataset:
    """Rows of ``seq_len`` tokens in batches, shuffled deterministically per epoch.

    Two sources:

    * ``PackedDataset(tokens, seq_len, batch_size)``: a token stream cut into
      ``n = len(tokens) // (seq_len + 1)`` non-overlapping windows of ``seq_len + 1`` tokens
      (inputs are the first ``seq_len``, targets the last); batches are
      ``{"inputs", "targets"}``.
    * ``PackedDataset.from_examples(examples, tokenizer, seq_len, batch_size)`` (or
      ``from_rows(pack_examples(...), batch_size)``): packed examples; batches also carry
      ``"mask"``, ``"segment_ids"`` and ``"positions"`` (see ``pack_examples``).

    Epoch ``e`` visits the rows in ``np.random.default_rng([seed, e]).permutation(n)``
    order, ``n // batch_size`` batches per epoch (the remainder is skipped that epoch), so a
    ``Position`` identifies the next batch exactly, across restarts.

    Raises:
      ValueError: if the text is too short for one batch, or sizes are < 1.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1; got {seq_len}, {batch_size}.")
        n = len(tokens) // (seq_len + 1)
        if n < batch_size:
            raise ValueError(
                f"The corpus has {len(tokens)} tokens: fewer than one batch of "
                f"{batch_size} x {seq_len + 1}. Use a longer text or smaller sizes."
            )
        self.examples = np.asarray(tokens[: n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)
        self._set_rows({"inputs": self.examples[:, :-1], "targets": self.examples[:, 1:]})
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = n // batch_size

    @classmethod
    def from_rows(cls, rows: dict, batch_size: int, seed: int = 0) -> "PackedDataset":
        """A dataset over packed rows, e.g. ``pack_examples``'s output.

        Args:
          rows: ``{name: array [n_rows, seq_len]}``, all of the same leading shape; a
            batch holds every name.
          batch_size: rows per batch (>= 1).
          seed: shuffling seed.

        Raises:
          ValueError: for arrays of different leading shapes, ``batch_size < 1``, or fewer
            rows than ``batch_size``.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
        self = cls.__new__(cls)
        self._set_rows(rows)
        n = len(self.rows["inputs"])
        if n < batch_size:
            raise ValueError(
                f"Packing gave {n} row(s) of {self.seq_len} tokens: fewer than one batch of "
                f"{batch_size}. Use more examples, a smaller batch or a shorter seq_len."
            )
        self.examples = None
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = n // batch_size
        return self

    @classmethod
    def from_examples(
        cls, examples, tokenizer: Any, seq_len: int, batch_size: int, seed: int = 0
    ) -> "PackedDataset":
        """``from_rows(pack_examples(examples, tokenizer, seq_len), batch_size, seed)``."""
        return cls.from_rows(pack_examples(examples, tokenizer, seq_len), batch_size, seed)

    def _set_rows(self, rows: dict) -> None:
        rows = {k: np.asarray(v) for k, v in rows.items()}
        shapes = {v.shape for v in rows.values()}
        if "inputs" not in rows or len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(
                "rows must hold 'inputs' and arrays of one shape [n_rows, seq_len]; got "
                f"{ {k: v.shape for k, v in rows.items()} }."
            )
        self.rows, self.seq_len = rows, rows["inputs"].shape[1]

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows["inputs"]))

    def batch_at(self, pos: Position) -> tuple[dict, Position]:
        """The batch at ``pos`` (each row array indexed: ``{"inputs", "targets", ...}``
        ``[B, S]``) and the next position."""
        if pos.epoch < 0 or pos.index < 0:
            raise ValueError(f"Position must be non-negative; got {pos}.")
        if pos.index + self.batch_size > self.batches_per_epoch * self.batch_size:
            pos = Position(pos.epoch + 1, 0)
        idx = self._order(pos.epoch)[pos.index : pos.index + self.batch_size]
        return (
            {k: v[idx] for k, v in self.rows.items()},
            Position(pos.epoch, pos.index + self.batch_size),
        )

    def iterate(self, pos: Position = Position()) -> Iterator[tuple[dict, Position]]:
        """Yields ``(batch, position_after_it)`` forever, starting at ``pos``."""
        while True:
            batch, pos = self.batch_at(pos)
            yield batch, pos
