"""The job's data: text packed into rows, or instruction/chat examples packed with response
masks (``jmem.data``), with ``--eval-split`` held out."""

from __future__ import annotations

import os

import numpy as np

from jmem import data as jdata
from jmem._src.cli import CliError
from jmem._src.cli import one_line
from jmem._src.cli import user_input


def load_datasets(config, tok):
    """``(train, eval or None)`` from ``--data``: a .jsonl file of examples (text,
    prompt/completion, Alpaca or chat messages; loss on the responses only), else text (a
    .txt file or the default corpus) as one token stream. ``--eval-split`` is held out."""
    if config.data is not None and not os.path.isfile(config.data):
        raise CliError(f"--data {config.data}: no such file; pass a .txt or .jsonl file")
    if config.data is not None and config.data.endswith(".jsonl"):
        return _example_datasets(config, tok)
    flag = f"--data {config.data}" if config.data else "the default corpus"
    with user_input(flag):
        text = jdata.load_text(config.data)
    if not text.strip():
        raise CliError(f"{flag}: the file holds no text; pass a non-empty .txt or .jsonl file")
    tokens = tok.encode(text)
    n_eval = int(len(tokens) * config.eval_split)
    need = config.batch_size * (config.seq_len + 1)
    if len(tokens) - n_eval < need:
        raise CliError(
            f"{flag}: {len(tokens) - n_eval:,} training tokens, fewer than one batch of "
            f"--batch-size {config.batch_size} x (--seq-len {config.seq_len} + 1) = {need:,}; "
            "pass more text or smaller --batch-size/--seq-len"
        )
    if config.eval_split and n_eval < need:
        raise CliError(
            f"--eval-split {config.eval_split}: holds out {n_eval:,} tokens, fewer than one "
            f"batch ({need:,}); raise it, pass smaller sizes, or --eval-split 0 for no evaluation"
        )
    cut = len(tokens) - n_eval  # the tail is held out: no window straddles the two
    train = jdata.PackedDataset(tokens[:cut], config.seq_len, config.batch_size, seed=config.seed)
    held = None
    if n_eval:
        held = jdata.PackedDataset(
            tokens[cut:], config.seq_len, config.batch_size, seed=config.seed
        )
    return train, held


def _example_datasets(config, tok):
    """Examples packed into rows (``jmem.data.pack_examples``); a seeded shuffle of the
    examples, then the last ``--eval-split`` of them held out."""
    flag = f"--data {config.data}"
    with user_input(flag):
        examples = jdata.load_examples(config.data)
    order = np.random.default_rng([config.seed, len(examples)]).permutation(len(examples))
    examples = [examples[i] for i in order]
    n_eval = int(len(examples) * config.eval_split)
    if config.eval_split and n_eval == 0:
        raise CliError(
            f"--eval-split {config.eval_split}: holds out none of the {len(examples)} examples; "
            "raise it, or pass --eval-split 0 for no evaluation"
        )
    cut = len(examples) - n_eval
    with user_input(flag):
        train = jdata.PackedDataset.from_examples(
            examples[:cut], tok, config.seq_len, config.batch_size, seed=config.seed
        )
    held = None
    if n_eval:
        what = f"--eval-split {config.eval_split} (held-out examples of {config.data})"
        try:
            held = jdata.PackedDataset.from_examples(
                examples[cut:], tok, config.seq_len, config.batch_size, seed=config.seed
            )
        except ValueError as e:
            raise CliError(
                f"{what}: {one_line(e)} Or raise --eval-split, or pass --eval-split 0 "
                "for no evaluation."
            ) from e
    return train, held
