"""Preference pairs as TRL reads them, tokenized into ``[n, 2, S]`` rows (axis 1: chosen,
rejected) with a response mask: ``{"prompt", "chosen", "rejected"}`` as text (standard
format: the texts used verbatim, as prompt/completion examples), or as chat messages
(conversational format: ``chosen``/``rejected`` lists of messages, an optional ``prompt``
list; without it, the messages the two share at the start are the prompt, as TRL's
``extract_prompt``), rendered by the tokenizer's chat template with the generation prompt
closing the prompt, as TRL's ``maybe_apply_chat_template``. Only answer tokens are trained
on; one pair per row (no packing), padded with token 0 and mask 0 at the end.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jmem._src.data.chat_template import PLAIN_CHAT_TEMPLATE
from jmem._src.data.chat_template import render_chat
from jmem._src.data.examples import render_example
from jmem._src.data.text import read_jsonl

#: What a preference example may be, for error messages.
PAIR_FORMATS = (
    '"prompt", "chosen" and "rejected" as strings, or "chosen" and "rejected" as lists of '
    '{"role": ..., "content": ...} messages (optional "prompt" messages)'
)
#: The arrays of ``pack_pairs`` and their dtypes.
PAIR_FIELDS = {"inputs": np.int32, "targets": np.int32, "completion_mask": np.float32}


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )


def _shared_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return n


def normalize_preference(obj: Any, where: str) -> dict:
    """The canonical form of a preference example: ``{"prompt", "chosen", "rejected"}``, all
    strings or all message lists (an implicit conversational prompt split off), and
    ``"where"``.

    Raises:
      ValueError: naming ``where`` (``"prefs.jsonl:3"``): not an object, a missing or
        mistyped field (named), or chosen and rejected identical.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: got {type(obj).__name__}; expected {PAIR_FORMATS}.")
    for field in ("chosen", "rejected"):
        if field not in obj:
            raise ValueError(f"{where}: missing field {field!r}; expected {PAIR_FORMATS}.")
    chosen, rejected, prompt = obj["chosen"], obj["rejected"], obj.get("prompt")
    if _is_messages(chosen) and _is_messages(rejected):
        if prompt is None:  # implicit prompt: the messages both answers start with
            n = _shared_prefix(chosen, rejected)
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        elif isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not _is_messages(prompt):
            raise ValueError(f"{where}: field 'prompt' must be a list of messages here.")
        if not chosen or not rejected:
            raise ValueError(f"{where}: field 'chosen' or 'rejected' has no answer message.")
    elif isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            raise ValueError(f"{where}: missing field 'prompt'; expected {PAIR_FORMATS}.")
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: field 'prompt' must be a string with text answers.")
    else:
        raise ValueError(
            f"{where}: 'chosen' and 'rejected' must both be strings or both message lists; "
            f"got {type(chosen).__name__} and {type(rejected).__name__}."
        )
    if chosen == rejected:
        raise ValueError(
            f"{where}: 'chosen' and 'rejected' are identical, so the pair states no "
            "preference; fix or drop the example."
        )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "where": where}


def _objects(path: str):
    """``(where, object)`` of a .jsonl file's lines, or of a .json file's array."""
    if path.endswith(".jsonl"):
        yield from read_jsonl(path, f"; expected {PAIR_FORMATS}")
        return
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}).") from None
    if not isinstance(value, list):
        raise ValueError(f"{path}: expected a JSON array of examples, got {type(value).__name__}.")
    for i, obj in enumerate(value):
        yield f"{path}: example {i}", obj


def load_preferences(path: str) -> list[dict]:
    """Reads preference pairs: a ``.jsonl`` file (one JSON object per line, blank lines
    skipped) or a ``.json`` file (an array of objects), in TRL's formats (module docstring).

    Args:
      path: the file.

    Returns:
      The examples in canonical form (``normalize_preference``), each with its ``"where"``
      (``"path:line"``) for later errors.

    Raises:
      ValueError: naming the file (and line and field) for a missing file, another
        extension, no examples, bad JSON, a missing field, or identical answers.
    """
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file; expected a .jsonl or .json file of pairs.")
    if not path.endswith((".jsonl", ".json")):
        raise ValueError(f"{path}: unsupported extension; expected .jsonl or .json.")
    examples = [normalize_preference(obj, where) for where, obj in _objects(path)]
    if not examples:
        raise ValueError(f"{path}: the file has no examples; expected {PAIR_FORMATS}.")
    return examples


def render_answer(prompt, answer, tokenizer: Any) -> tuple[str, int]:
    """The text of a prompt and one answer, and the character where the answer starts.

    Text: as a prompt/completion example (``render_example``: ``bos_token``, the texts
    verbatim, ``eos_token``). Messages: ``render(prompt + answer)`` by the tokenizer's chat
    template (else ``PLAIN_CHAT_TEMPLATE``), the answer from the end of
    ``render(prompt, add_generation_prompt=True)``.

    Raises:
      ValueError: a template that fails, or does not render the prompt as a prefix.
    """
    if isinstance(answer, str):
        text, [(start, _)] = render_example({"prompt": prompt, "completion": answer}, tokenizer)
        return text, start
    template = getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE
    kw = dict(bos_token=getattr(tokenizer, "bos_token", None))
    kw["eos_token"] = getattr(tokenizer, "eos_token", None)
    head = render_chat(prompt, template, add_generation_prompt=True, **kw)
    text = render_chat(prompt + answer, template, **kw)
    if not text.startswith(head):
        raise ValueError(
            "the chat template does not render the prompt (with its generation prompt) as a "
            "prefix of the conversation, so the answer cannot be located; use text pairs."
        )
    return text, len(head)


def tokenize_answer(prompt, answer, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int32 [n], response bool [n])`` of ``render_answer``'s text: a token is a
    response token when its first character lies in the answer (as ``tokenize_example``)."""
    text, start = render_answer(prompt, answer, tokenizer)
    ids, starts = tokenizer.encode_with_offsets(text)
    return np.asarray(ids, np.int32), np.asarray(starts) >= start


def _row(ex: dict, answer: str, tokenizer, seq_len: int, seq_len_name: str):
    """One answer's ``(ids, response)``, cut to ``seq_len + 1`` tokens; refuses a prompt
    that leaves no answer token within ``seq_len`` targets."""
    where = ex["where"]
    try:
        ids, response = tokenize_answer(ex["prompt"], ex[answer], tokenizer)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not response.any():
        raise ValueError(f"{where}: the {answer} answer has no tokens; fix or drop the example.")
    prompt_tokens = int(np.argmax(response))
    if prompt_tokens > seq_len:
        raise ValueError(
            f"{where}: the prompt is {prompt_tokens} tokens, longer than {seq_len_name} "
            f"{seq_len}: no {answer} token would be trained on; pass a longer {seq_len_name} "
            "or shorten the prompt."
        )
    return ids[: seq_len + 1], response[: seq_len + 1], len(ids)


def pack_pairs(examples, tokenizer: Any, seq_len: int, *, seq_len_name: str = "seq_len"):
    """Tokenizes preference pairs into rows ``[n, 2, seq_len]`` (axis 1: chosen, rejected).

    Args:
      examples: ``load_preferences``'s examples (or dicts ``normalize_preference`` takes).
      tokenizer: ``encode_with_offsets(text) -> (ids, starts)``, with optional
        ``chat_template``, ``bos_token``, ``eos_token`` (``ByteTokenizer``, ``HFTokenizer``).
      seq_len: slots per row (>= 1); an answer longer than ``seq_len + 1`` tokens is cut.
      seq_len_name: how errors name ``seq_len`` (the job passes ``--seq-len``).

    Returns:
      ``(rows, counts)``: rows ``{"inputs", "targets"}`` int32 and ``"completion_mask"``
      float32 (1 where the target is an answer token), each ``[n, 2, seq_len]``, padded with
      0; counts ``{"pairs", "truncated" (answers cut), "max_tokens" (longest answer)}``.

    Raises:
      ValueError: naming the example's line: a prompt longer than ``seq_len`` tokens, an
        answer with no token, a failing chat template, a bad example (``normalize_preference``).
    """
    if seq_len < 1:
        raise ValueError(f"{seq_len_name} must be >= 1; got {seq_len}.")
    examples = [
        ex if "where" in ex else normalize_preference(ex, f"example {i}")
        for i, ex in enumerate(examples)
    ]
    rows = {k: np.zeros((len(examples), 2, seq_len), dt) for k, dt in PAIR_FIELDS.items()}
    truncated, longest = 0, 0
    for i, ex in enumerate(examples):
        for j, answer in enumerate(("chosen", "rejected")):
            ids, response, n = _row(ex, answer, tokenizer, seq_len, seq_len_name)
            truncated, longest = truncated + (n > seq_len + 1), max(longest, n)
            rows["inputs"][i, j, : len(ids) - 1] = ids[:-1]
            rows["targets"][i, j, : len(ids) - 1] = ids[1:]
            rows["completion_mask"][i, j, : len(ids) - 1] = response[1:]
    return rows, {"pairs": len(examples), "truncated": truncated, "max_tokens": longest}
