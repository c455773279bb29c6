"""Text data for the examples: loading, byte and Hugging Face tokenizers, packing."""

from jmem._src.data import ByteTokenizer, HFTokenizer, PackedDataset, Position, load_text

__all__ = (
    "ByteTokenizer",
    "HFTokenizer",
    "PackedDataset",
    "Position",
    "load_text",
)
