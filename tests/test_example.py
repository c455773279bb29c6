"""The fine-tuning job (``jmem.finetune``, which examples/qlora_7b.py calls) end to end on
CPU: trains, checkpoints, resumes exactly, plans 7B."""

import json
import os
import shutil

import helpers
import numpy as np
import pytest

from jmem import data
from jmem import finetune

pytestmark = pytest.mark.slow  # writes checkpoints and trains: seconds per test


@pytest.fixture(scope="module")
def example():
    """The job's package: the example script only calls ``finetune.main``."""
    return finetune


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
    "--eval-every",
    "2",
    "--eval-batches",
    "2",
]


@pytest.fixture(scope="module")
def four_steps(example, tmp_path_factory):
    """An uninterrupted 4-step run with checkpoints 2 and 4: ``(out, summary)``. Tests copy
    ``out`` before changing it."""
    out = tmp_path_factory.mktemp("four_steps") / "run"
    full = example.main(SMALL + ["--steps", "4", "--save-every", "2", "--out", str(out)])
    return out, full


def test_interrupted_and_resumed_run_gives_the_same_losses(example, four_steps, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(four_steps[0], out)
    full = four_steps[1]
    # Interrupt after step 2's checkpoint: drop the later one, then resume.
    ckpts = out / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2, 4]
    shutil.rmtree(ckpts / "4")
    resumed = example.main(
        SMALL + ["--steps", "4", "--save-every", "2", "--out", str(out), "--resume"]
    )
    np.testing.assert_array_equal(resumed["losses"], full["losses"])
    assert [s for s, _ in full["eval_losses"]] == [0, 2, 4]
    np.testing.assert_array_equal(resumed["eval_losses"], full["eval_losses"])
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


def test_resume_without_checkpoint_is_a_clear_error(example, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        example.main(SMALL + ["--steps", "1", "--out", str(tmp_path), "--resume"])
    assert e.value.code == 2 and "--resume: no checkpoint" in capsys.readouterr().err


def test_a_second_run_into_the_same_out_replaces_or_resumes_never_mixes(
    example, four_steps, tmp_path, capsys
):
    """--overwrite drops the older run's checkpoints, so a later --resume finds the newer
    run's; summary.json records the model, data, tokenizer, flags and the held-out losses."""
    out = str(tmp_path / "run")
    shutil.copytree(four_steps[0], out)  # the older run: 4 steps, checkpoints 2 and 4
    with pytest.raises(SystemExit):
        example.main(SMALL + ["--steps", "2", "--out", out])
    assert "--overwrite" in capsys.readouterr().err
    second = example.main(
        SMALL + ["--steps", "2", "--save-every", "100", "--overwrite", "--out", out]
    )
    steps = [int(p) for p in os.listdir(os.path.join(out, "checkpoints")) if p.isdigit()]
    assert steps == [2]
    summary = json.loads(open(os.path.join(out, "summary.json")).read())
    assert summary["config"] == "tiny" and summary["model"]["vocab_size"] == 256
    assert summary["data"] == "pydoc_data.topics" and summary["tokenizer"] == "byte"
    assert summary["args"]["lora_rank"] == 4 and summary["args"]["seq_len"] == 32
    assert [s for s, _ in summary["eval_losses"]] == [0, 2] == [s for s, _ in second["eval_losses"]]
    assert len(summary["learning_rates"]) == 2 and summary["last_eval_loss"] > 0
    capsys.readouterr()
    again = example.main(SMALL + ["--steps", "2", "--resume", "--out", out])
    text = capsys.readouterr().out
    assert "Nothing to do: the checkpoint is at step 2" in text and "compiled" not in text
    assert again["losses"] == second["losses"]


def test_trains_from_a_hugging_face_checkpoint_with_its_tokenizer(example, tmp_path, capsys):
    """--checkpoint DIR of a Llama 3.1-style model (llama3 RoPE scaling, GQA, tied
    embeddings): weights quantized to NF4 on load, the checkpoint's own tokenizer, samples
    before and after training, and an adapter directory that PEFT loads onto the
    transformers model with jmem's logits (dense base + the same adapters, 1e-4)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jmem import lora  # noqa: PLC0415
    from jmem.models import hf  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    transformers = pytest.importorskip("transformers", reason="writes the tiny HF checkpoint")
    tokenizers = pytest.importorskip("tokenizers", reason="the checkpoint's tokenizer.json")
    peft = pytest.importorskip("peft", reason="loads the adapters the run wrote")
    torch = pytest.importorskip("torch")
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
        tie_word_embeddings=True,
        max_position_embeddings=64,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(ckpt, safe_serialization=True)
    tok.save(str(ckpt / "tokenizer.json"))
    assert data.HFTokenizer(str(ckpt)).vocab_size == len(vocab)
    argv = ["--checkpoint", str(ckpt), "--steps", "3", "--batch-size", "2", "--seq-len", "16"]
    argv += ["--lora-rank", "2", "--lr", "1e-2", "--no-progress", "--out", str(tmp_path / "run")]
    out = example.main(argv + ["--sample-prompt", " ".join(words[:4]), "--sample-tokens", "3"])
    assert len(out["losses"]) == 3 and all(np.isfinite(out["losses"]))
    assert out["checkpoint"] == str(ckpt) and out["tokenizer"] == str(ckpt)
    assert out["config"] is None and out["model"]["vocab_size"] == 128
    assert set(out["samples"]) == {"before (step 0)", "after (step 3)"}
    assert "sample before (step 0)" in capsys.readouterr().out

    adapter_dir = str(tmp_path / "run" / "adapter")
    jcfg = hf.load_config(str(ckpt))
    assert jcfg.rope_scaling is not None and jcfg.tie_embeddings
    params, _ = hf.load_params(str(ckpt), jcfg, dtype=jnp.float32)
    adapters = hf.load_adapters(adapter_dir, params, jcfg)
    assert any(float(jnp.abs(w.b).max()) > 0 for w in adapters.values())  # trained
    adapters = jax.tree.map(lambda x: x.astype(jnp.float32), adapters)
    tokens = np.arange(1, 13, dtype=np.int32)[None]
    ours = lora.apply(lambda p, t: llama.forward(p, t, jcfg))(params, adapters, tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)


def test_instruction_run_writes_adapters_and_a_merged_checkpoint(example, tmp_path):
    """The main job on a tiny SFT set: response-only loss, eval loss, PEFT adapters in
    --out/adapter, and a merged Hugging Face checkpoint that computes the eval loss the
    adapters computed (up to the bf16 rounding of the merged weights)."""
    import jax  # noqa: PLC0415

    from jmem.models import hf  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    sft = helpers.sft_jsonl(tmp_path / "sft.jsonl")
    out, merged = tmp_path / "run", tmp_path / "merged"
    argv = SMALL + ["--data", sft, "--steps", "3", "--eval-every", "3", "--eval-split", "0.2"]
    extra = ["--export-merged", str(merged), "--sample-prompt", "Q: 1+2=?\nA:"]
    summary = example.main(argv + ["--out", str(out), "--sample-tokens", "4", *extra])
    assert set(summary["samples"]) == {"before (step 0)", "after (step 3)"}
    assert all(isinstance(t, str) for t in summary["samples"].values())
    assert summary["data"] == sft and len(summary["losses"]) == 3
    assert [s for s, _ in summary["eval_losses"]] == [0, 3] and np.isfinite(
        summary["last_eval_loss"]
    )
    assert (out / "adapter" / "adapter_config.json").exists()
    cfg = hf.load_config(str(merged))
    params, _ = hf.load_params(str(merged), cfg, dtype=jax.numpy.bfloat16)
    adapters = hf.load_adapters(str(out / "adapter"), params, cfg)
    assert set(adapters) == {f"layers/{n}/kernel" for n in llama.LINEAR_NAMES}
    from jmem._src.finetune.datasets import load_datasets  # noqa: PLC0415
    from jmem._src.finetune.setup import model_config  # noqa: PLC0415
    from jmem._src.finetune.setup import resolve_defaults  # noqa: PLC0415

    args = example.parse_args(argv)
    args, _ = resolve_defaults(args, model_config(args), on_gpu=False)
    _, held = load_datasets(args, data.ByteTokenizer())
    n = min(2, held.batches_per_epoch)  # as the example's Evaluator (--eval-batches 2)
    batches = [held.batch_at(data.Position(0, i * 4))[0] for i in range(n)]
    losses = [float(llama.loss_fn(params, b, cfg)) for b in batches]
    merged_loss = np.average(losses, weights=[b["mask"].sum() for b in batches])
    assert merged_loss == pytest.approx(summary["last_eval_loss"], abs=0.03)
