"""Text data for the examples: loading, byte and Hugging Face tokenizers, packing."""

from jmem._src.data import ByteTokenizer
from jmem._src.data import HFTokenizer
from jmem._src.data import PackedDataset
from jmem._src.data import Position
from jmem._src.data import load_text

__all__ = (
    "ByteTokenizer",
    "HFTokenizer",
    "PackedDataset",
    "Position",
    "load_text",
)
