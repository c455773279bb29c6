"""Real-text data for the examples: corpus loading, tokenizers, packed batches with an exact
resumable position.

The default corpus ships with every CPython: ``pydoc_data.topics`` (the Python language
reference, ~0.47 MB of English prose and code). ``load_text(path)`` also reads ``.txt``
files and ``.jsonl`` files with a ``text`` field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import numpy as np


def load_text(path: str | None = None) -> str:
    """Returns the training text.

    Args:
      path: None for the default corpus (``pydoc_data.topics``), a ``.txt`` file, or a
        ``.jsonl`` file whose lines are objects with a ``"text"`` field.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: for another extension, or a ``.jsonl`` line without ``"text"``.
    """
    if path is None:
        from pydoc_data import topics  # noqa: PLC0415

        return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    if not os.path.exists(path):
        raise FileNotFoundError(f"Data file {path!r} does not exist.")
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if path.endswith(".jsonl"):
        docs = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg}).") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise ValueError(
                        f"{path}:{i + 1}: each line must be a JSON object with a "
                        "string 'text' field."
                    )
                docs.append(obj["text"])
        return "\n\n".join(docs)
    raise ValueError(
        f"Unsupported data file {path!r}: use .txt or .jsonl (a 'text' field per line)."
    )


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no unknown tokens, no training needed."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """int32 ``[n_bytes]``."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint directory's own ``tokenizer.json``, through the ``tokenizers`` library.

    Raises:
      FileNotFoundError: if the directory has no ``tokenizer.json``.
    """

    def __init__(self, directory: str):
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{directory!r} has no tokenizer.json; pass a checkpoint directory "
                "with its tokenizer, or use the byte tokenizer."
            )
        from tokenizers import Tokenizer  # noqa: PLC0415

        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


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
    """Token stream packed into fixed-length examples, shuffled deterministically per epoch.

    The token stream is cut into ``n = len(tokens) // (seq_len + 1)`` non-overlapping
    examples of ``seq_len + 1`` tokens (inputs are the first ``seq_len``, targets the last).
    Epoch ``e`` visits them in ``np.random.default_rng([seed, e]).permutation(n)`` order, so
    a ``Position`` identifies the next batch exactly, across restarts.

    Raises:
      ValueError: if the text is too short for one batch.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1; got {seq_len}, {batch_size}.")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        n = len(tokens) // (seq_len + 1)
        if n < batch_size:
            raise ValueError(
                f"The corpus has {len(tokens)} tokens: fewer than one batch of "
                f"{batch_size} x {seq_len + 1}. Use a longer text or smaller sizes."
            )
        self.examples = np.asarray(tokens[: n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)
        self.batches_per_epoch = n // batch_size

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def batch_at(self, pos: Position) -> tuple[dict, Position]:
        """The batch at ``pos`` (``{"inputs", "targets"}``, int32 ``[B, S]``) and the next position."""
        if pos.epoch < 0 or pos.index < 0:
            raise ValueError(f"Position must be non-negative; got {pos}.")
        if pos.index + self.batch_size > self.batches_per_epoch * self.batch_size:
            pos = Position(pos.epoch + 1, 0)
        idx = self._order(pos.epoch)[pos.index : pos.index + self.batch_size]
        ex = self.examples[idx]
        return (
            {"inputs": ex[:, :-1], "targets": ex[:, 1:]},
            Position(pos.epoch, pos.index + self.batch_size),
        )

    def iterate(self, pos: Position = Position()) -> Iterator[tuple[dict, Position]]:
        """Yields ``(batch, position_after_it)`` forever, starting at ``pos``."""
        while True:
            batch, pos = self.batch_at(pos)
            yield batch, pos
