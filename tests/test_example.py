"""examples/qlora_7b.py end to end on CPU: trains, checkpoints, resumes exactly, plans 7B."""

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from jmem import data

pytestmark = pytest.mark.slow  # writes checkpoints and trains: seconds per test

_PATH = os.path.join(os.path.dirname(__file__), "..", "examples", "qlora_7b.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("qlora_7b", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SMALL = [
    "--config",
    "tiny",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--lora-rank",
    "4",
    "--no-progress",
    "--lr",
    "3e-3",
]


def test_interrupted_and_resumed_run_gives_the_same_losses(example, tmp_path):
    out = tmp_path / "run"
    full = example.main(SMALL + ["--steps", "4", "--save-every", "2", "--out", str(out)])
    # Interrupt after step 2's checkpoint: drop the later one, then resume.
    ckpts = out / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2, 4]
    shutil.rmtree(ckpts / "4")
    resumed = example.main(
        SMALL + ["--steps", "4", "--save-every", "2", "--out", str(out), "--resume"]
    )
    np.testing.assert_array_equal(resumed["losses"], full["losses"])
    assert os.path.exists(out / "loss.png")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_loss"] == full["losses"][0] and summary["tokens_per_s"] > 0


def test_dry_run_plans_from_abstract_shapes(example, tmp_path):
    out = example.main(
        [
            "--config",
            "tiny",
            "--dry-run",
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert out["nf4_bytes_per_param"] <= 0.52
    assert out["compiled"]["peak_bytes"] > 0 and os.path.exists(tmp_path / "dry_run.json")


def test_resume_without_checkpoint_is_a_clear_error(example, tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        example.main(SMALL + ["--steps", "1", "--out", str(tmp_path), "--resume"])


def test_trains_from_a_hugging_face_checkpoint_with_its_tokenizer(example, tmp_path):
    """--checkpoint DIR: weights quantized to NF4 on load, the checkpoint's own tokenizer."""
    transformers = pytest.importorskip("transformers", reason="writes the tiny HF checkpoint")
    tokenizers = pytest.importorskip("tokenizers", reason="the checkpoint's tokenizer.json")
    words = sorted(set(data.load_text()[:20000].split()))[:90]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    ckpt = tmp_path / "hf"
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(ckpt, safe_serialization=True)
    tok.save(str(ckpt / "tokenizer.json"))
    assert data.HFTokenizer(str(ckpt)).vocab_size == len(vocab)
    out = example.main(
        [
            "--checkpoint",
            str(ckpt),
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--lora-rank",
            "2",
            "--no-progress",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert len(out["losses"]) == 3 and all(np.isfinite(out["losses"]))
