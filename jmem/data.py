"""Data: text and instruction/chat examples, tokenizers, packing with segment ids, batches.

Text: ``load_text`` -> ``tokenizer.encode`` -> ``PackedDataset(tokens, seq_len, batch_size)``.
Examples (``{"text"}``, ``{"prompt", "completion"}``, Alpaca, chat ``messages``):
``load_examples`` -> ``PackedDataset.from_examples(examples, tokenizer, seq_len, batch_size)``
(``pack_examples`` underneath), batches with ``mask``, ``segment_ids`` and ``positions``.
Preference pairs (TRL's ``prompt``/``chosen``/``rejected``, text or messages):
``load_preferences`` -> ``pack_pairs`` -> ``PackedDataset.from_rows`` (``[B, 2, S]`` batches).
"""

from jmem._src.data.chat_template import PLAIN_CHAT_TEMPLATE
from jmem._src.data.chat_template import render_chat
from jmem._src.data.dataset import PackedDataset
from jmem._src.data.dataset import Position
from jmem._src.data.examples import load_examples
from jmem._src.data.examples import render_example
from jmem._src.data.examples import render_prompt
from jmem._src.data.packing import pack_examples
from jmem._src.data.packing import tokenize_example
from jmem._src.data.preference import load_preferences
from jmem._src.data.preference import pack_pairs
from jmem._src.data.text import load_text
from jmem._src.data.tokenizer import ByteTokenizer
from jmem._src.data.tokenizer import HFTokenizer

__all__ = (
    "PLAIN_CHAT_TEMPLATE",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedDataset",
    "Position",
    "load_examples",
    "load_preferences",
    "load_text",
    "pack_examples",
    "pack_pairs",
    "render_chat",
    "render_example",
    "render_prompt",
    "tokenize_example",
)
