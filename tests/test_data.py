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
