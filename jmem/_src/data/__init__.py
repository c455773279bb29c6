"""Data for training: text corpora, instruction/chat examples, tokenizers, packing without
cross-talk, and batches with an exact resumable position. Public API: ``jmem.data``."""
