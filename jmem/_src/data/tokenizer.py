"""Tokenizers for the examples: UTF-8 bytes, or a checkpoint's own ``tokenizer.json``.

Both give ``encode(text)`` (int32 ids) and ``encode_with_offsets(text)`` (ids and the
character where each token starts, which ``jmem.data`` uses to mark response tokens), and
carry the checkpoint's ``chat_template``, ``bos_token`` and ``eos_token`` (None when
absent).
"""

from __future__ import annotations

import json
import os

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no unknown tokens, no training needed.

    It has no chat template and no BOS/EOS tokens (``chat_template``, ``bos_token`` and
    ``eos_token`` are None, ``add_bos_token`` False): instruction data is rendered with the
    plain template.
    """

    vocab_size = 256
    chat_template = None
    bos_token = None
    eos_token = None
    add_bos_token = False

    def encode(self, text: str) -> np.ndarray:
        """int32 ``[n_bytes]``."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int32 [n_bytes], starts int64 [n_bytes])``: the character each byte is in."""
        lengths = [len(c.encode("utf-8")) for c in text]
        return self.encode(text), np.repeat(np.arange(len(text)), lengths)

    def decode(self, ids) -> str:
        """The text of ``ids`` (invalid UTF-8 sequences become U+FFFD)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _token_text(value) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or an ``AddedToken`` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(directory: str, config: dict) -> str | None:
    """The checkpoint's chat template: ``chat_template.jinja`` (transformers >= 4.43 saves it
    there) or ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
    ``{"name", "template"}`` of which the one named ``"default"`` is used)."""
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


class HFTokenizer:
    """A checkpoint directory's own ``tokenizer.json``, through the ``tokenizers`` library.

    ``tokenizer_config.json`` (optional) gives ``bos_token``, ``eos_token`` and
    ``chat_template`` (also read from ``chat_template.jinja``), as in transformers;
    ``add_bos_token`` is True when the tokenizer's post-processor starts a text with
    ``bos_token`` (then text and prompt/completion examples start with it too).

    Raises:
      FileNotFoundError: if the directory has no ``tokenizer.json``.
      ValueError: if ``tokenizer_config.json`` is not a JSON object.
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
        config = {}
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError(f"{config_path}: expected a JSON object.")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = _chat_template(directory, config)
        # Whether plain text gets BOS, as transformers tokenizes it: the tokenizer's own
        # post-processor prepends it (Llama) or not (GPT-2, Qwen).
        bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos_token = bos_id is not None and self._tok.encode("").ids[:1] == [bos_id]

    def encode(self, text: str) -> np.ndarray:
        """int32 ``[n_tokens]``, with the tokenizer's own special tokens (e.g. BOS)."""
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int32 [n], starts int64 [n])``: tokens of ``text`` as written (special
        tokens only where the text has them, as ``apply_chat_template`` tokenizes) and the
        character index where each token starts."""
        enc = self._tok.encode(text, add_special_tokens=False)
        starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64).reshape(-1)
        return np.asarray(enc.ids, dtype=np.int32), starts

    def decode(self, ids) -> str:
        """The text of ``ids``."""
        return self._tok.decode([int(i) for i in ids])
