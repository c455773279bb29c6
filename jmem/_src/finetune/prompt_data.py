"""The prompts of ``--objective grpo``: TRL's prompt-only dataset, a ``.jsonl`` file (or a
``.json`` array) of rows with a ``prompt`` column, text (standard format) or chat messages
(conversational format, rendered with the tokenizer's chat template and its generation
prompt, as TRL's ``GRPOTrainer._tokenize_prompts``); every other column is kept for the
reward functions. A prompt longer than ``max_prompt_len`` tokens keeps its last tokens, as
TRL's ``max_prompt_length`` cut prompts (``prompt_ids[:, -max_prompt_length:]``, TRL < 1.0).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from jmem._src.cli import CliError
from jmem._src.cli import one_line
from jmem._src.data.chat_template import render_chat
from jmem._src.data.preference import _is_messages
from jmem._src.data.preference import _objects

#: What a row may be, for error messages.
PROMPT_FORMAT = (
    'one JSON object per prompt with "prompt": a string, or a list of {"role": ..., '
    '"content": ...} messages (TRL\'s prompt-only format); other keys are columns for the '
    "reward functions"
)


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt: ``text`` as the model is given it (a chat prompt rendered with its
    generation prompt; never cut), ``ids`` its tokens (at most ``max_prompt_len``: the last
    ones when cut), ``columns`` the row's other columns (for the reward functions)."""

    text: str
    ids: tuple[int, ...]
    columns: dict


def _prompt_ids(prompt: Any, tokenizer, where: str) -> tuple[str, np.ndarray]:
    """The text and token ids of one ``prompt`` value (text or messages)."""
    if isinstance(prompt, str):  # as TRL: tokenized as is, with the tokenizer's BOS
        return prompt, np.asarray(tokenizer.encode(prompt), np.int32)
    if not _is_messages(prompt):
        raise CliError(
            f"{where}: 'prompt' is a {type(prompt).__name__}, neither text nor a list of "
            '{"role", "content"} messages with string values; expected ' + PROMPT_FORMAT
        )
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise CliError(
            f"{where}: the prompt is chat messages and the tokenizer has no chat template; "
            "use a checkpoint whose tokenizer has one, or give the prompts as text"
        )
    try:
        text = render_chat(
            prompt,
            template,
            bos_token=getattr(tokenizer, "bos_token", None),
            eos_token=getattr(tokenizer, "eos_token", None),
            add_generation_prompt=True,
        )
    except ValueError as e:
        raise CliError(f"{where}: {one_line(e)}") from None
    # The template's text as written (its BOS included): no second BOS, as TRL's
    # apply_chat_template(tokenize=True).
    ids, _ = tokenizer.encode_with_offsets(text)
    return text, np.asarray(ids, np.int32)


def _rows(path: str):
    """``(where, row)`` of the file, refusing a missing file, another extension or bad JSON."""
    if not os.path.isfile(path):
        raise CliError(f"{path}: no such file; pass a .jsonl (or .json) file of prompts")
    if not path.endswith((".jsonl", ".json")):
        raise CliError(f"{path}: unsupported extension; expected .jsonl or .json, {PROMPT_FORMAT}")
    try:
        return list(_objects(path))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CliError(one_line(e)) from None


def read_prompts(
    path: str,
    tokenizer,
    *,
    max_prompt_len: int,
    max_prompt_len_name: str = "max_prompt_len",
) -> tuple[list[PromptRecord], list[str]]:
    """Reads a prompt-only dataset and tokenizes its prompts.

    Text prompts are tokenized as they are (``tokenizer.encode``: with BOS when the
    tokenizer adds one to text, e.g. Llama, not Qwen), as TRL tokenizes standard prompts.
    Chat prompts (a list of ``{"role", "content"}``) are rendered with the tokenizer's chat
    template and ``add_generation_prompt=True``, and the text tokenized as written (the
    template's own BOS, no second one), as TRL's ``apply_chat_template``. A prompt of more
    than ``max_prompt_len`` tokens keeps its last ``max_prompt_len`` (its start, BOS
    included, is cut), with one note counting them. A column that some rows lack is None in
    those rows (as ``datasets`` reads JSON).

    Args:
      path: a ``.jsonl`` file (one object per line, blank lines skipped) or a ``.json``
        array of objects.
      tokenizer: ``encode``, ``encode_with_offsets`` and optional ``chat_template``,
        ``bos_token``, ``eos_token`` (``jmem.data.HFTokenizer``, ``ByteTokenizer``).
      max_prompt_len: tokens kept per prompt (>= 1).
      max_prompt_len_name: how the note names ``max_prompt_len`` (the job passes its flag).

    Returns:
      ``(records, notes)``: one ``PromptRecord`` per row in file order; notes are
      sentences for the log (empty when nothing was cut).

    Raises:
      CliError: one line naming the file (and line): no such file, another extension, bad
        JSON, no rows, a row that is not an object or has no ``prompt`` or a prompt of
        another type, chat messages with a tokenizer without a chat template, a failing
        template, a prompt of no tokens; ``max_prompt_len < 1``.
    """
    if not isinstance(max_prompt_len, int) or max_prompt_len < 1:
        raise CliError(f"{max_prompt_len_name} must be an int >= 1; got {max_prompt_len!r}")
    rows = _rows(path)
    if not rows:
        raise CliError(f"{path}: the file holds no prompts; expected {PROMPT_FORMAT}")
    keys: dict[str, None] = {}
    parsed = []
    for where, row in rows:
        if not isinstance(row, dict) or "prompt" not in row:
            found = f"keys {sorted(row)}" if isinstance(row, dict) else type(row).__name__
            raise CliError(f"{where}: no 'prompt' field (got {found}); expected {PROMPT_FORMAT}")
        text, ids = _prompt_ids(row["prompt"], tokenizer, where)
        if not len(ids):
            raise CliError(f"{where}: the prompt has no tokens; drop the row or give it text")
        keys.update(dict.fromkeys(k for k in row if k != "prompt"))
        parsed.append((text, ids, row))
    records, cut, longest = [], 0, 0
    for text, ids, row in parsed:
        longest = max(longest, len(ids))
        cut += len(ids) > max_prompt_len
        columns = {k: row.get(k) for k in keys}
        records.append(PromptRecord(text, tuple(int(i) for i in ids[-max_prompt_len:]), columns))
    notes = []
    if cut:
        notes.append(
            f"{cut} of {len(records)} prompts are longer than {max_prompt_len_name} "
            f"{max_prompt_len} tokens (longest {longest}): their start is cut, their last "
            f"{max_prompt_len} tokens kept (as TRL's max_prompt_length)"
        )
    return records, notes


def prompt_columns(records: list[PromptRecord], num_generations: int = 1) -> dict[str, list]:
    """The reward functions' ``columns`` of a batch of prompts: each column's values, each
    repeated ``num_generations`` times (TRL's order: prompt ``g``'s completions are rows
    ``g * G ... g * G + G - 1``).

    Args:
      records: the batch's prompts (``read_prompts``).
      num_generations: completions per prompt ``G`` (>= 1).

    Returns:
      column name -> ``len(records) * G`` values.
    """
    names = dict.fromkeys(k for r in records for k in r.columns)
    return {k: [r.columns.get(k) for r in records for _ in range(num_generations)] for k in names}
