"""Data: real default corpus, packing, deterministic shuffling, exact resumable position."""

import json

import numpy as np
import pytest

from jmem import data


def test_default_corpus_is_real_text():
    text = data.load_text()
    assert len(text) > 400_000 and "def " in text and "class" in text


def test_packing_shapes_and_targets_shifted():
    toks = data.ByteTokenizer().encode(data.load_text()[:50_000])
    ds = data.PackedDataset(toks, seq_len=64, batch_size=4, seed=1)
    b, pos = ds.batch_at(data.Position())
    assert b["inputs"].shape == (4, 64) and b["targets"].shape == (4, 64)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    assert pos == data.Position(0, 4)


def test_resume_from_position_is_exact_and_epochs_reshuffle():
    toks = np.arange(10_000) % 251
    ds = data.PackedDataset(toks, seq_len=16, batch_size=8, seed=3)
    it = ds.iterate()
    seq = [next(it) for _ in range(100)]  # crosses epoch boundaries (73 batches per epoch)
    saved = data.Position.from_dict(json.loads(json.dumps(seq[49][1].to_dict())))
    resumed = ds.iterate(saved)
    for k in range(50, 60):
        b, p = next(resumed)
        np.testing.assert_array_equal(b["inputs"], seq[k][0]["inputs"])
        assert p == seq[k][1]
    assert ds._order(0).tolist() != ds._order(1).tolist()


def test_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    assert data.load_text(str(tmp_path / "a.txt")) == "hello world"
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert data.load_text(str(tmp_path / "b.jsonl")) == "one\n\ntwo"
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="text"):
        data.load_text(str(tmp_path / "c.jsonl"))
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(ValueError, match=".txt or .jsonl"):
        data.load_text(str(tmp_path / "d.csv"))
    with pytest.raises(FileNotFoundError):
        data.load_text(str(tmp_path / "missing.txt"))
    for bad in ('"just a string"', "42", '{"text": null}', "{not json"):
        (tmp_path / "e.jsonl").write_text(bad + "\n")
        with pytest.raises(ValueError, match="e.jsonl:1"):
            data.load_text(str(tmp_path / "e.jsonl"))


def test_too_short_corpus_and_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="fewer than one batch"):
        data.PackedDataset(np.arange(100), seq_len=64, batch_size=4)
    for s, b in ((0, 4), (16, 0), (-1, 4)):
        with pytest.raises(ValueError, match=">= 1"):
            data.PackedDataset(np.arange(1000), seq_len=s, batch_size=b)
    with pytest.raises(ValueError, match="non-negative"):
        data.PackedDataset(np.arange(1000), 16, 4).batch_at(data.Position(0, -8))


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"


def test_default_corpus_documents_are_shuffled_not_sorted():
    """The default corpus holds every pydoc topic once, in a fixed shuffled order (sorted
    keys end with the typesseq tables and the last statements, an unrepresentative tail)."""
    from pydoc_data import topics

    text = data.load_text()
    assert text == data.load_text()  # fixed
    starts = sorted((text.index(topics.topics[k]), k) for k in topics.topics)
    order = [k for _, k in starts]
    assert sorted(order) == sorted(topics.topics)
    assert order != sorted(topics.topics)
    last = sorted(topics.topics)[-len(order) // 10 :]  # the sorted tail: spread, not at the end
    where = [order.index(k) / len(order) for k in last]
    assert min(where) < 0.3 and max(where) > 0.7, where


def test_held_out_indices_are_drawn_across_the_data():
    from jmem._src.data.dataset import held_out_indices

    train, held = held_out_indices(1000, 50, seed=0)
    assert len(held) == 50 and len(train) == 950
    np.testing.assert_array_equal(np.sort(np.concatenate([train, held])), np.arange(1000))
    assert held.min() < 100 and held.max() > 900  # across the data, not a tail
    assert np.histogram(held, bins=4, range=(0, 1000))[0].min() >= 5
    np.testing.assert_array_equal(held, held_out_indices(1000, 50, seed=0)[1])  # seeded
    assert not np.array_equal(held, held_out_indices(1000, 50, seed=1)[1])
    with pytest.raises(ValueError, match="n_held"):
        held_out_indices(3, 4, seed=0)


def test_batches_without_a_trained_on_slot_are_skipped_and_counted():
    """Rows built by hand where some batches have mask 0 everywhere: iterate never yields
    them (their loss would read 0), counts them, and warns once; the position stays exact."""
    import warnings

    n, s = 8, 4
    mask = np.zeros((n, s), np.float32)
    mask[::2, 1] = 1.0  # rows 0, 2, 4, 6 train; 1, 3, 5, 7 do not
    rows = {"inputs": np.arange(n * s).reshape(n, s), "targets": np.ones((n, s)), "mask": mask}
    ds = data.PackedDataset.from_rows(rows, batch_size=1, seed=3)
    it = ds.iterate()
    with pytest.warns(UserWarning, match="no trained-on token"):
        got = [next(it) for _ in range(12)]
    assert all(b["mask"].sum() > 0 for b, _ in got)
    last = got[-1][1]
    assert ds.skipped_batches == last.epoch * n + last.index - 12 >= 8  # every row visited
    assert ds.report["skipped_batches"] == ds.skipped_batches
    # the same batches again from a saved position (exact resume)
    again = ds.batch_at(got[4][1])[0]
    np.testing.assert_array_equal(again["inputs"], got[5][0]["inputs"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="No row has a trained-on slot"):
            data.PackedDataset.from_rows({**rows, "mask": np.zeros_like(mask)}, batch_size=1)
