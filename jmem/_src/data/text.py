"""Plain text for language-model training: the default corpus, ``.txt`` and ``.jsonl`` files.

The default corpus ships with every CPython: ``pydoc_data.topics`` (the Python language
reference, ~0.47 MB of English prose and code), its topics in a fixed shuffled order (sorted
keys put the typesseq tables and the last statements at the end, an unrepresentative tail).
``load_text(path)`` also reads ``.txt``
files and ``.jsonl`` files with a ``text`` field (joined with blank lines: one stream; for
documents kept apart, with segment ids, use ``load_examples`` and ``pack_examples``).
"""

from __future__ import annotations

import json
import os
from typing import Any
from typing import Iterator

import numpy as np

#: The seed of the default corpus's document order (fixed: the corpus is one text).
DEFAULT_CORPUS_SEED = 0


def load_text(path: str | None = None) -> str:
    """Returns the training text.

    Args:
      path: None for the default corpus (``pydoc_data.topics``, its documents in a fixed
        seeded order, ``DEFAULT_CORPUS_SEED``), a ``.txt`` file, or a ``.jsonl`` file whose
        lines are objects with a ``"text"`` field.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: for another extension, or a ``.jsonl`` line without ``"text"``.
    """
    if path is None:
        from pydoc_data import topics  # noqa: PLC0415

        keys = sorted(topics.topics)
        order = np.random.default_rng(DEFAULT_CORPUS_SEED).permutation(len(keys))
        return "\n\n".join(topics.topics[keys[i]] for i in order)
    if not os.path.exists(path):
        raise FileNotFoundError(f"Data file {path!r} does not exist.")
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if path.endswith(".jsonl"):
        docs = []
        for where, obj in read_jsonl(path):
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(
                    f"{where}: each line must be a JSON object with a string 'text' field."
                )
            docs.append(obj["text"])
        return "\n\n".join(docs)
    raise ValueError(
        f"Unsupported data file {path!r}: use .txt or .jsonl (a 'text' field per line)."
    )


def read_jsonl(path: str, expected: str = "") -> Iterator[tuple[str, Any]]:
    """Yields ``("path:line", object)`` for each non-blank line of a JSON-lines file.

    Raises:
      ValueError: ``path:line: not valid JSON (...)`` (followed by ``expected``).
    """
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield f"{path}:{i + 1}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg}){expected}.") from None
