"""Packing examples into fixed-length rows without cross-talk: segment ids, positions, mask.

Each example of ``n`` tokens fills ``n - 1`` slots of a row: inputs ``ids[:-1]``, targets
``ids[1:]``, positions ``0 .. n - 2`` (reset at each example), one segment id per example
(``1, 2, ...`` within a row; 0 is padding), and ``mask = 1`` where the target is a response
token. A model that attends only within a segment (``segment_ids[q] == segment_ids[k]``,
causal) and uses ``positions`` for its rotary embedding sees each example exactly as if it
were alone in its row. Examples are placed in order (next fit: a new row starts when the
next example does not fit the current one), as in MaxText's and T5's packing
(``segment_ids`` / ``positions`` as in ``seqio``'s packed features).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from jmem._src.data.examples import normalize_example
from jmem._src.data.examples import render_example

#: The arrays of ``pack_examples`` and their dtypes.
PACKED_FIELDS = {
    "inputs": np.int32,
    "targets": np.int32,
    "mask": np.float32,
    "segment_ids": np.int32,
    "positions": np.int32,
}


def tokenize_example(example: dict, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of an example and which of them are response (trained-on) tokens.

    The example is rendered (``render_example``) and tokenized once as a whole; a token is a
    response token when its first character lies in a trained-on span (an assistant turn,
    a completion, or all of a ``text`` example), as transformers'
    ``return_assistant_tokens_mask`` maps character spans to tokens.

    Args:
      example: a dict in one of the forms of ``load_examples``.
      tokenizer: ``encode_with_offsets(text) -> (ids, starts)`` (``ByteTokenizer``,
        ``HFTokenizer``), with optional ``chat_template``, ``bos_token``, ``eos_token``.

    Returns:
      ``(ids int32 [n], response bool [n])``.

    Raises:
      ValueError: for an example in no known form or a failing chat template.
      TypeError: if the tokenizer has no ``encode_with_offsets``.
    """
    if not hasattr(tokenizer, "encode_with_offsets"):
        raise TypeError(
            f"{type(tokenizer).__name__} has no encode_with_offsets(text) -> (ids, starts); "
            "use jmem.data.HFTokenizer or jmem.data.ByteTokenizer."
        )
    text, spans = render_example(example, tokenizer)
    ids, starts = tokenizer.encode_with_offsets(text)
    ids, starts = np.asarray(ids, np.int32), np.asarray(starts)
    response = np.zeros(ids.shape, bool)
    for start, end in spans:
        response |= (starts >= start) & (starts < end)
    return ids, response


def _place(rows: dict, row: int, offset: int, segment: int, ids, response) -> None:
    """Writes one example (``n`` tokens) into ``n - 1`` slots of ``rows[*][row]``."""
    n = len(ids) - 1
    cols = slice(offset, offset + n)
    rows["inputs"][row, cols] = ids[:-1]
    rows["targets"][row, cols] = ids[1:]
    rows["mask"][row, cols] = response[1:]
    rows["segment_ids"][row, cols] = segment
    rows["positions"][row, cols] = np.arange(n)


def pack_examples(
    examples, tokenizer: Any, seq_len: int, *, warn: bool = True, return_counts: bool = False
):
    """Tokenizes examples and packs them into rows of ``seq_len`` slots, without cross-talk.

    Args:
      examples: an iterable of example dicts (``load_examples``; e.g.
        ``[{"prompt": "2+2=", "completion": "4"}]``).
      tokenizer: as ``tokenize_example``.
      seq_len: slots per row (the model's sequence length), >= 1.
      warn: warn about truncated and untrained examples (below).
      return_counts: also return ``{"examples", "truncated", "untrained", "max_tokens"}``:
        how many examples there were, were cut at ``seq_len + 1`` tokens, have no trained-on
        target left (an empty response, or one cut off: left out of the rows), and the
        longest one's tokens. Then no packable example gives rows of 0 rows, not an error,
        so that the caller can report the counts.

    Returns:
      ``{"inputs", "targets", "segment_ids", "positions"}`` int32 and ``"mask"`` float32, each
      ``[n_rows, seq_len]`` (see the module docstring). ``mask`` is 1 exactly on the slots
      whose target is a response token: a prompt of 5 tokens and a response of 3 give
      ``mask`` 1 at slots 4, 5 and 6. Padding slots are 0 everywhere (token id 0). Examples
      with no trained-on target are left out, so every row has a trained-on slot (a row of
      them alone would train on nothing and report a loss of 0). With ``return_counts``,
      ``(rows, counts)``.

    Warns:
      UserWarning: with the count of examples longer than ``seq_len + 1`` tokens (truncated,
        their end is lost) and of examples left without any trained-on target.

    Raises:
      ValueError: for ``seq_len < 1``, a bad example (naming its index), or (without
        ``return_counts``) when no example has a trained-on target.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1; got {seq_len}.")
    tokenized, truncated, untrained, total, longest = [], 0, 0, 0, 0
    for i, example in enumerate(examples):
        total += 1
        example = normalize_example(example, f"example {i}")
        try:
            ids, response = tokenize_example(example, tokenizer)
        except ValueError as e:  # a chat template that fails on this conversation
            raise ValueError(f"example {i}: {e}") from None
        longest = max(longest, len(ids))
        if len(ids) > seq_len + 1:
            truncated += 1
            ids, response = ids[: seq_len + 1], response[: seq_len + 1]
        if len(ids) < 2 or not response[1:].any():
            untrained += 1  # left out: a row of it alone would log a loss of 0
        else:
            tokenized.append((ids, response))
    if warn:
        _warn(truncated, untrained, total, seq_len)
    if not tokenized and not return_counts:
        raise ValueError(
            f"None of the {total} examples has a trained-on target within seq_len = "
            f"{seq_len} (2 tokens at least, a response among the targets); raise seq_len or "
            "check the examples' responses."
        )
    placement, row, offset, segment = [], (0 if tokenized else -1), 0, 0
    for ids, _ in tokenized:
        if offset + len(ids) - 1 > seq_len:
            row, offset, segment = row + 1, 0, 0
        segment += 1
        placement.append((row, offset, segment))
        offset += len(ids) - 1
    rows = {k: np.zeros((row + 1, seq_len), dt) for k, dt in PACKED_FIELDS.items()}
    for (ids, response), (r, o, s) in zip(tokenized, placement):
        _place(rows, r, o, s, ids, response)
    if return_counts:
        counts = dict(examples=total, truncated=truncated, untrained=untrained, max_tokens=longest)
        return rows, counts
    return rows


def _warn(truncated: int, untrained: int, total: int, seq_len: int) -> None:
    if truncated:
        warnings.warn(
            f"{truncated} of {total} examples are longer than seq_len + 1 = {seq_len + 1} "
            "tokens and were truncated (their end is not trained on); raise seq_len to keep them.",
            stacklevel=3,
        )
    if untrained:
        warnings.warn(
            f"{untrained} of {total} examples have no response token among their targets "
            f"within seq_len = {seq_len} (empty response, or cut off by truncation): they "
            "are left out.",
            stacklevel=3,
        )
