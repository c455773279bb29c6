"""Batches of packed rows, shuffled deterministically per epoch, with an exact resumable
``Position``."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any
from typing import Iterator

import numpy as np

from jmem._src.data.packing import pack_examples


def held_out_indices(n: int, n_held: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held)``: sorted indices of ``n`` items, ``n_held`` of them held out, drawn
    uniformly at random (seeded) across all of them, never a tail (a file sorted by date or
    topic would otherwise be evaluated on its last part only), as TRL's and torchtune's
    random splits.

    Raises:
      ValueError: unless ``0 <= n_held <= n``.
    """
    if not 0 <= n_held <= n:
        raise ValueError(f"n_held must be in [0, n={n}]; got {n_held}.")
    held = np.zeros(n, bool)
    held[np.random.default_rng([seed, n, 0x5E1D]).choice(n, n_held, replace=False)] = True
    return np.flatnonzero(~held), np.flatnonzero(held)


def windows(tokens: np.ndarray, seq_len: int) -> dict:
    """A token stream cut into ``len(tokens) // (seq_len + 1)`` non-overlapping windows,
    as rows ``{"inputs": int32[n, seq_len], "targets": int32[n, seq_len]}`` (targets are
    the inputs shifted by one); the rows ``PackedDataset(tokens, ...)`` holds."""
    n = len(tokens) // (seq_len + 1)
    w = np.asarray(tokens[: n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)
    return {"inputs": w[:, :-1], "targets": w[:, 1:]}


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
    ``Position`` identifies the next batch exactly, across restarts. A batch with a
    ``"mask"`` and no trained-on slot (rows built by hand; ``pack_examples`` leaves untrained
    examples out) is skipped, never returned: its loss would read 0. ``iterate`` counts the
    ones it skips in ``skipped_batches`` and ``report["skipped_batches"]`` (``report``: what
    a run records of its data, e.g. in ``summary.json``) and warns once.

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
        self.skipped_batches, self.report = 0, {}

    @classmethod
    def from_rows(cls, rows: dict, batch_size: int, seed: int = 0) -> "PackedDataset":
        """A dataset over packed rows, e.g. ``pack_examples``'s output.

        Args:
          rows: ``{name: array [n_rows, seq_len]}`` (or ``[n_rows, 2, seq_len]``: the
            pairs of ``pack_pairs``), all of one shape; a batch holds every name.
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
        if "mask" in self.rows and not self.rows["mask"].any():
            raise ValueError(
                "No row has a trained-on slot (mask is 0 everywhere): training on these rows "
                "would learn nothing; check the examples' responses."
            )
        self.examples = None
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = n // batch_size
        self.skipped_batches, self.report = 0, {}
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
        if "inputs" not in rows or len(shapes) != 1 or len(next(iter(shapes))) < 2:
            raise ValueError(
                "rows must hold 'inputs' and arrays of one shape [n_rows, seq_len] (or "
                f"[n_rows, ..., seq_len], e.g. preference pairs); got "
                f"{ {k: v.shape for k, v in rows.items()} }."
            )
        self.rows, self.seq_len = rows, rows["inputs"].shape[-1]

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows["inputs"]))

    def batch_at(self, pos: Position) -> tuple[dict, Position]:
        """The batch at ``pos`` (each row array indexed: ``{"inputs", "targets", ...}``
        ``[B, S]``; from the next batch with a trained-on slot, see the class) and the
        position after it."""
        batch, pos, _ = self._trained_batch(pos)
        return batch, pos

    def _trained_batch(self, pos: Position) -> tuple[dict, Position, int]:
        """``(batch, next position, batches skipped)``: the first batch from ``pos`` on that
        has a trained-on slot (every batch when there is no ``"mask"``)."""
        batch, pos = self._batch(pos)
        skipped = 0
        while "mask" in batch and not batch["mask"].any():
            skipped += 1
            if skipped > 100 * (self.batches_per_epoch + 1):
                raise ValueError(
                    f"{skipped} batches in a row have no trained-on slot; pack fewer "
                    "untrained rows or use a larger batch_size."
                )
            batch, pos = self._batch(pos)
        return batch, pos, skipped

    def _batch(self, pos: Position) -> tuple[dict, Position]:
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
        """Yields ``(batch, position_after_it)`` forever, starting at ``pos``; batches with
        no trained-on slot are skipped and counted (see the class)."""
        while True:
            batch, pos, skipped = self._trained_batch(pos)
            if skipped:
                if not self.skipped_batches:
                    warnings.warn(
                        f"Skipped {skipped} batch(es) with no trained-on token before "
                        f"{pos}: they would report a loss of 0; counted in "
                        "report['skipped_batches'].",
                        stacklevel=2,
                    )
                self.skipped_batches += skipped
                self.report["skipped_batches"] = self.skipped_batches
            yield batch, pos
