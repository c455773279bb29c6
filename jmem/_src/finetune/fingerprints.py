"""What a run trained on, by content: fingerprints of ``--checkpoint`` (its config.json
and tokenizer files hashed; each safetensors file's size, header and ``SAMPLES`` blocks
of its data spread over the file hashed, so that another model of the same shapes is
told apart without reading 13 GB at every start) and of
``--data`` (its size and SHA-256), with paths resolved. ``run.json`` records them and
``--resume`` compares them, so that a base model replaced at the same path, a changed
``rope_theta`` or a halved data file is refused, and the same file by another path is not."""

from __future__ import annotations

import hashlib
import os
import struct

from jmem._src.cli import CliError
from jmem._src.file_hash import hash_file

#: Blocks of each safetensors file's data hashed besides its header, and their bytes.
SAMPLES, SAMPLE_BYTES = 16, 1 << 16
#: The small files of a checkpoint hashed whole (those that exist).
WHOLE_FILES = (
    "config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _safetensors_print(path: str) -> str:
    """SHA-256 of a safetensors file's header (its 8-byte length and the JSON of every
    tensor's name, dtype, shape and offsets) and of ``SAMPLES`` blocks of its data."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "truncated"
        (n,) = struct.unpack("<Q", head)
        h.update(head + f.read(min(n, size)))
        start = 8 + n
        span = max(0, size - start - SAMPLE_BYTES)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(1, SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def checkpoint_fingerprint(directory: str) -> dict:
    """``{"path": realpath, "files": {name: "sha256:..." | "sampled:...; size N"}}``."""
    files = {}
    for name in WHOLE_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            files[name] = f"sha256:{hash_file(path)}"
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            path = os.path.join(directory, name)
            size = os.path.getsize(path)
            files[name] = f"sampled:{_safetensors_print(path)}; size {size}"
    return {"path": os.path.realpath(directory), "files": files}


def data_fingerprint(path: str) -> dict:
    """``{"path": realpath, "size": bytes, "sha256": hex}`` of a data file."""
    return {
        "path": os.path.realpath(path),
        "size": os.path.getsize(path),
        "sha256": hash_file(path),
    }


def fingerprints(config) -> dict:
    """The fingerprints of the run's ``--checkpoint`` and ``--data`` (those given; a
    ``--tokenizer`` directory's files too). Read errors are one line naming the flag."""
    out = {}
    pairs = (
        ("checkpoint", config.model.checkpoint, checkpoint_fingerprint),
        ("data", config.data.data, data_fingerprint),
    )
    tok = config.model.tokenizer
    if tok not in (None, "byte") and tok != config.model.checkpoint:
        pairs += (("tokenizer", tok, checkpoint_fingerprint),)
    for name, path, make in pairs:
        if path is None:
            continue
        try:
            out[name] = make(path)
        except OSError as e:
            raise CliError(f"--{name} {path}: cannot be read ({e.strerror or e})") from None
    return out


def differences(before: dict, now: dict) -> list[str]:
    """One phrase per flag whose content changed (``--data d.jsonl: size 10 (was 20)``)."""
    out = []
    for name in sorted(set(before) | set(now)):
        a, b = before.get(name), now.get(name)
        if a == b:
            continue
        if a is None or b is None:
            out.append(f"--{name}: {'not given' if b is None else 'given'} now")
            continue
        where = f"--{name} {b.get('path')}"
        if a.get("path") != b.get("path"):
            out.append(f"{where} (was {a.get('path')})")
        elif "files" in a:
            fa, fb = a["files"], b.get("files", {})
            changed = sorted(n for n in set(fa) | set(fb) if fa.get(n) != fb.get(n))
            out.append(f"{where}: {', '.join(changed)} changed")
        elif a.get("size") != b.get("size"):
            out.append(f"{where}: size {b.get('size')} bytes (was {a.get('size')})")
        else:
            out.append(f"{where}: content changed (same size, another SHA-256)")
    return out
