"""The job's data: text packed into rows, or instruction/chat examples packed with response
masks (``jmem.data``), with ``--eval-split`` held out: windows of the text, or examples,
drawn at random (seeded by ``--seed``) across the data, never its tail.

A held-out part smaller than a batch is evaluated as it is (fewer rows); when the data
cannot spare even one row (text) or one example (examples) beside a training batch,
evaluation is skipped with a notice, never an error. Examples that keep no response token
within ``--seq-len`` are counted: all of them is an error before training (a run that
would learn nothing), some of them a notice and a count in ``summary.json``."""

from __future__ import annotations

import os

import numpy as np

from jmem import data as jdata
from jmem._src.cli import CliError
from jmem._src.cli import user_input
from jmem._src.data import dataset as _data


def load_datasets(config, tok):
    """``(train, eval or None)`` from ``--data``: a .jsonl file of examples (text,
    prompt/completion, Alpaca or chat messages; loss on the responses only), else text (a
    .txt file or the default corpus) as one token stream cut into windows of
    ``--seq-len + 1`` tokens. ``--eval-split`` of the windows (or examples) is held out, drawn
    at random across the data (``held_out_indices``, seeded by ``--seed``).

    ``train.report`` holds what ``summary.json`` records of the data: ``eval_skipped`` (why,
    when evaluation was asked for and is skipped) and, for examples, ``examples`` (counts of
    examples, truncated ones and ones with no trained-on token, train and held out).

    With a preference ``--objective`` (dpo, orpo, simpo), ``--data`` holds pairs
    (``preference_datasets``): batches of ``[B, 2, S]`` arrays.

    Raises:
      CliError: for a missing, empty or unreadable file, data smaller than one training
        batch, or examples none of which keeps a response token within ``--seq-len``;
        for pairs, as ``preference_datasets``.
    """
    if config.data.data is not None and not os.path.isfile(config.data.data):
        raise CliError(f"--data {config.data.data}: no such file; pass a .txt or .jsonl file")
    if config.training.objective != "sft":
        train, held, report = preference_datasets(config, tok)
    elif config.data.data is not None and config.data.data.endswith(".jsonl"):
        train, held, report = _example_datasets(config, tok)
    else:
        train, held, report = _text_datasets(config, tok)
    if report.get("eval_skipped"):
        print(f"note: evaluation skipped: {report['eval_skipped']}", flush=True)
    train.report = report
    return train, held


def _text_datasets(config, tok):
    flag = f"--data {config.data.data}" if config.data.data else "the default corpus"
    with user_input(flag):
        text = jdata.load_text(config.data.data)
    if not text.strip():
        raise CliError(f"{flag}: the file holds no text; pass a non-empty .txt or .jsonl file")
    tokens = tok.encode(text)
    row, need = config.data.seq_len + 1, config.data.batch_size * (config.data.seq_len + 1)
    n_eval, report = int(len(tokens) * config.data.eval_split), {}
    if config.data.eval_split and n_eval < row:  # hold out one row when the data can spare it
        n_eval = row if len(tokens) - row >= need else 0
        if not n_eval:
            report["eval_skipped"] = (
                f"{flag} has {len(tokens):,} tokens: one training batch ({need:,}) leaves no "
                f"row of {row} tokens to hold out; pass more text for evaluation"
            )
    if len(tokens) - n_eval < need:
        raise CliError(
            f"{flag}: {len(tokens) - n_eval:,} training tokens, fewer than one batch of "
            f"--batch-size {config.data.batch_size} x (--seq-len {config.data.seq_len} + 1) = {need:,}; "
            "pass more text or smaller --batch-size/--seq-len"
        )
    rows = _data.windows(tokens, config.data.seq_len)
    train_idx, held_idx = _data.held_out_indices(
        len(rows["inputs"]), n_eval // row, config.run.seed
    )
    train = jdata.PackedDataset.from_rows(
        _take(rows, train_idx), config.data.batch_size, seed=config.run.seed
    )
    held = None
    if len(held_idx):
        n = min(config.data.batch_size, len(held_idx))
        held = jdata.PackedDataset.from_rows(_take(rows, held_idx), n, seed=config.run.seed)
    return train, held, report


def _take(rows: dict, idx) -> dict:
    return {k: v[idx] for k, v in rows.items()}


def _split_examples(config, examples):
    """``--eval-split`` of the examples held out (at least one when there are two or more),
    drawn at random across the file (``held_out_indices``); the training examples in a
    seeded shuffled order."""
    n_eval = int(len(examples) * config.data.eval_split)
    if config.data.eval_split and n_eval == 0 and len(examples) > 1:
        n_eval = 1
    train_idx, held_idx = _data.held_out_indices(len(examples), n_eval, config.run.seed)
    order = np.random.default_rng([config.run.seed, len(examples)]).permutation(train_idx)
    return [examples[i] for i in order], [examples[i] for i in held_idx]


def _example_datasets(config, tok):
    """Examples packed into rows (``jmem.data.pack_examples``), the response-token check,
    and the held-out examples (evaluated in rows fewer than a batch if need be)."""
    flag = f"--data {config.data.data}"
    with user_input(flag):
        examples = jdata.load_examples(config.data.data)
    train_ex, held_ex = _split_examples(config, examples)
    with user_input(flag):
        rows, counts = jdata.pack_examples(
            train_ex, tok, config.data.seq_len, warn=False, return_counts=True
        )
    check_response_tokens(counts, flag, config.data.seq_len)
    with user_input(flag):
        train = jdata.PackedDataset.from_rows(rows, config.data.batch_size, seed=config.run.seed)
    report = {"examples": {"train": counts}, "chat": all("messages" in ex for ex in examples)}
    held, why = None, None
    if not config.data.eval_split:
        return train, None, report
    if held_ex:
        try:
            rows, held_counts = jdata.pack_examples(
                held_ex, tok, config.data.seq_len, warn=False, return_counts=True
            )
        except ValueError as e:
            rows, why = None, f"the held-out examples cannot be packed ({e})"
        if rows is not None:
            report["examples"]["held_out"] = held_counts
            if held_counts["untrained"] == held_counts["examples"]:
                why = "no held-out example keeps a response token within --seq-len"
            else:
                n = min(config.data.batch_size, len(rows["inputs"]))
                held = jdata.PackedDataset.from_rows(rows, n, seed=config.run.seed)
    else:
        why = f"{flag} has {len(examples)} example(s): none to hold out"
    if why:
        report["eval_skipped"] = why
    return train, held, report


def check_response_tokens(counts: dict, flag: str, seq_len: int) -> None:
    """Refuses training data with no trained-on token; prints a notice when some examples
    lose their response (cut off at ``--seq-len``, or empty).

    Raises:
      CliError: when every example is without a response token within ``--seq-len``.
    """
    n, untrained, cut = counts["examples"], counts["untrained"], counts["truncated"]
    longest = counts["max_tokens"]
    if untrained == n:
        raise CliError(
            f"{flag}: none of the {n} training examples keeps a response token within "
            f"--seq-len {seq_len} ({cut} cut at the end, longest {longest} tokens): the run "
            f"would train on nothing; pass a longer --seq-len (up to {longest - 1}), or "
            "shorten the prompts (a long system prompt pushes the response past the cut)"
        )
    if untrained:
        print(
            f"note: {untrained} of {n} training examples keep no response token within "
            f"--seq-len {seq_len} ({cut} cut at the end): they are left out; a longer "
            "--seq-len keeps them.",
            flush=True,
        )
    elif cut:
        print(
            f"note: {cut} of {n} training examples are longer than --seq-len {seq_len} + 1 "
            "tokens: their end is cut and not trained on.",
            flush=True,
        )


def preference_datasets(config, tok):
    """``(train, held or None, report)`` of preference pairs (``jmem.data.load_preferences``,
    TRL's formats; ``pack_pairs``: one pair per ``[2, S]`` row, answers masked in
    ``completion_mask``), ``--eval-split`` of the pairs held out at random as for examples.

    Raises:
      CliError: ``--data FILE:LINE: ...`` for a missing field, identical answers or a
        prompt longer than ``--seq-len``; no ``--data``, another extension, fewer pairs
        than one batch.
    """
    data, objective = config.data.data, config.training.objective
    if data is None or not data.endswith((".jsonl", ".json")):
        raise CliError(
            f"--objective {objective} needs --data FILE.jsonl (or .json) of preference pairs "
            '("prompt", "chosen", "rejected"); got ' + (data or "the default corpus")
        )
    flag = f"--data {data}"
    with user_input("--data"):  # the message names the file (and line)
        pairs = jdata.load_preferences(data)
    train_ex, held_ex = _split_examples(config, pairs)
    pack = lambda ex: jdata.pack_pairs(ex, tok, config.data.seq_len, seq_len_name="--seq-len")
    with user_input("--data"):
        rows, counts = pack(train_ex)
        held_rows, held_counts = pack(held_ex) if held_ex else (None, None)
    if counts["truncated"]:
        print(
            f"note: {counts['truncated']} of {2 * counts['pairs']} training answers are longer "
            f"than --seq-len {config.data.seq_len} + 1 tokens (longest {counts['max_tokens']}): "
            "their end is cut and not trained on.",
            flush=True,
        )
    if len(train_ex) < config.data.batch_size:
        raise CliError(
            f"{flag}: {len(train_ex)} training pairs, fewer than one batch of --batch-size "
            f"{config.data.batch_size} (pairs per step); pass more pairs or a smaller --batch-size"
        )
    train = jdata.PackedDataset.from_rows(rows, config.data.batch_size, seed=config.run.seed)
    chat = not isinstance(pairs[0]["chosen"], str)
    report = {"pairs": {"train": counts}, "chat": chat}
    held = None
    if held_rows is not None:
        report["pairs"]["held_out"] = held_counts
        n = min(config.data.batch_size, held_counts["pairs"])
        held = jdata.PackedDataset.from_rows(held_rows, n, seed=config.run.seed)
    elif config.data.eval_split:
        report["eval_skipped"] = f"{flag} has {len(pairs)} pair(s): none to hold out"
    return train, held, report
