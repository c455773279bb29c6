"""The SHA-256 of a file, read in 4 MiB blocks: the checkpoints' content hashes
(``checkpointing.py``, ``hashes.json``), the published results' and the run's fingerprints of
its data and model files (``finetune/``). Standard library only."""

from __future__ import annotations

import hashlib

__all__ = ["hash_file"]


def hash_file(path: str) -> str:
    """The SHA-256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
