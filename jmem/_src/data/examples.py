"""Training examples: plain text, prompt/completion, Alpaca instructions and chat messages.

An example is a dict in one of four forms (extra keys are ignored):

* ``{"text": str}``: a document; every token is trained on.
* ``{"prompt": str, "completion": str}``: used verbatim (as TRL does for non-conversational
  prompt/completion data): ``bos_token + prompt + completion + eos_token``, trained on
  ``completion + eos_token``.

``bos_token`` starts text and prompt/completion examples when the tokenizer adds it to plain
text (``add_bos_token``, e.g. Llama; not GPT-2 or Qwen); ``eos_token`` ends them when the
tokenizer has one.
* ``{"instruction": str, "input": str (optional), "output": str}`` (Alpaca, Taori et al.
  2023): the conversation ``user: instruction [+ "\\n\\n" + input]``, ``assistant: output``.
* ``{"messages": [{"role": str, "content": str}, ...]}`` (the OpenAI / Hugging Face chat
  format): trained on every assistant turn. Other keys of a message (``name``,
  ``tool_calls``...) are passed to the template.

Conversations (chat and Alpaca) are rendered with the tokenizer's chat template when it has
one (``HFTokenizer.chat_template``, from the checkpoint's ``tokenizer_config.json``), else
with ``PLAIN_CHAT_TEMPLATE``.
"""

from __future__ import annotations

import os
from typing import Any

from jmem._src.data.chat_template import PLAIN_CHAT_TEMPLATE
from jmem._src.data.chat_template import assistant_spans
from jmem._src.data.chat_template import render_chat
from jmem._src.data.text import read_jsonl

#: What a line / an example may be, for error messages.
FORMATS = (
    'a JSON object with "text" (a string), "prompt" and "completion" (strings), '
    '"instruction" and "output" (Alpaca; optional "input"), or "messages" (a list of '
    '{"role": ..., "content": ...} with at least one "assistant" turn)'
)


def _messages(obj: dict) -> list[dict] | None:
    """The conversation of a chat or Alpaca example, validated; None for other forms."""
    if "messages" in obj:
        msgs = obj["messages"]
        ok = isinstance(msgs, list) and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in msgs
        )
        if not ok or not any(m["role"] == "assistant" for m in msgs):
            return None
        return [dict(m) for m in msgs]  # other keys (name, tool_calls) go to the template
    if isinstance(obj.get("instruction"), str) and isinstance(obj.get("output"), str):
        extra = obj.get("input") or ""
        if not isinstance(extra, str):
            return None
        user = obj["instruction"] + ("\n\n" + extra if extra else "")
        return [{"role": "user", "content": user}, {"role": "assistant", "content": obj["output"]}]
    return None


def normalize_example(obj: Any, where: str) -> dict:
    """The canonical form of an example: ``{"text"}``, ``{"prompt", "completion"}`` or
    ``{"messages"}`` (Alpaca becomes ``messages``).

    Raises:
      ValueError: naming ``where`` (e.g. ``"data.jsonl:3"``) and the expected formats, for
        anything else.
    """
    if isinstance(obj, dict):
        if "messages" in obj or "instruction" in obj:
            msgs = _messages(obj)
            if msgs is not None:
                return {"messages": msgs}
        elif "prompt" in obj or "completion" in obj:
            if isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
                return {"prompt": obj["prompt"], "completion": obj["completion"]}
        elif isinstance(obj.get("text"), str):
            return {"text": obj["text"]}
    found = f"keys {sorted(obj)}" if isinstance(obj, dict) else type(obj).__name__
    raise ValueError(f"{where}: got {found}; expected {FORMATS}.")


def load_examples(path: str) -> list[dict]:
    """Reads a ``.jsonl`` file of training examples, one JSON object per line.

    Blank lines are skipped. Each line may be in any of the four forms of the module
    docstring (forms may be mixed); the result holds their canonical forms
    (``normalize_example``), ready for ``pack_examples``.

    Args:
      path: a ``.jsonl`` file.

    Returns:
      A list of example dicts.

    Raises:
      ValueError: naming the file (and line) for a missing file, another extension, a file
        without examples, a line that is not JSON, or a line in none of the known formats.
    """
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file; expected a .jsonl file with one example per line.")
    if not path.endswith(".jsonl"):
        raise ValueError(
            f"{path}: unsupported extension; expected a .jsonl file (one JSON object per "
            "line). For plain text use load_text (.txt)."
        )
    examples = [
        normalize_example(obj, where) for where, obj in read_jsonl(path, f"; expected {FORMATS}")
    ]
    if not examples:
        raise ValueError(
            f"{path}: the file has no examples; expected one line per example, {FORMATS}."
        )
    return examples


def _with_eos(text: str, eos: str | None) -> str:
    return text if not eos or text.endswith(eos) else text + eos


def render_example(example: dict, tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """The text of an example and the ``[start, end)`` character spans trained on.

    Args:
      example: an example in any form of the module docstring.
      tokenizer: gives ``chat_template``, ``bos_token``, ``eos_token`` (None or missing:
        the plain template, no BOS/EOS text) and ``add_bos_token`` (default True).

    Returns:
      ``(text, spans)``: text and prompt/completion examples start with ``bos_token`` (with
      ``add_bos_token``, unless the text already does) and end with ``eos_token`` (unless
      they already do); conversations are as the template renders them.

    Raises:
      ValueError: for an example in no known form, or a chat template that fails.
    """
    ex = normalize_example(example, "example")
    bos = getattr(tokenizer, "bos_token", None)
    eos = getattr(tokenizer, "eos_token", None)
    if "messages" in ex:
        template = getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE
        return assistant_spans(ex["messages"], template, bos_token=bos, eos_token=eos)
    body = ex.get("text", ex.get("prompt"))
    add_bos = bos is not None and getattr(tokenizer, "add_bos_token", True)
    start = bos if add_bos and not body.startswith(bos) else ""
    if "text" in ex:
        text = _with_eos(start + body, eos)
        return text, [(0, len(text))]
    prompt = start + ex["prompt"]
    text = _with_eos(prompt + ex["completion"], eos)
    return text, [(len(prompt), len(text))]


def render_prompt(prompt: str, tokenizer: Any) -> str:
    """A prompt as a chat model is asked: one user turn with the text that opens the
    assistant's turn, rendered as ``render_example`` renders conversations (the tokenizer's
    chat template, else ``PLAIN_CHAT_TEMPLATE``; its ``bos_token``/``eos_token``).

    Tokenize the result as the training examples are, with the template's special tokens
    as written (``tokenizer.encode_with_offsets``; no second BOS): its ids are then those a
    training conversation's first user turn and generation prompt would have.

    Args:
      prompt: the user's message.
      tokenizer: as for ``render_example``.

    Returns:
      The text, e.g. ``"### User:\\n{prompt}\\n\\n### Assistant:\\n"`` with the plain
      template, ``"<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n"``
      with ChatML.

    Raises:
      ValueError: for a chat template that fails on a single user turn.
    """
    template = getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE
    return render_chat(
        [{"role": "user", "content": prompt}],
        template,
        bos_token=getattr(tokenizer, "bos_token", None),
        eos_token=getattr(tokenizer, "eos_token", None),
        add_generation_prompt=True,
    )
