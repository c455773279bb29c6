"""What the fine-tuning job shows its user: samples prompted in the
chat template on chat data, sizes in human units, the plot's title and step axis, the
``--eval-every`` default, the offload note on CPU, quiet processes other than process 0,
and the NF4 base quantized from the compute dtype."""

import json
import os
import types

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import data
from jmem import finetune
from jmem import lora
from jmem import nf4
from jmem import planner
from jmem import qlora
from jmem._src.finetune import report
from jmem._src.finetune.build import quantized_base
from jmem._src.finetune.outputs import Sampler
from jmem._src.finetune.setup import default_eval_every
from jmem._src.finetune.setup import resolve_defaults
from jmem._src.units import format_count
from jmem.models import hf
from jmem.models import llama

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ------------------------------------------------------------------------------ human units


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0"),
        (950, "950"),
        (3_200, "3.2K"),
        (12_345, "12.3K"),
        (999_600, "1M"),
        (1_400_000, "1.4M"),
        (20_000_000, "20M"),
        (6_738_415_616, "6.74B"),
        (1.2e12, "1.2T"),
    ],
)
def test_counts_print_in_human_units(n, text):
    assert format_count(n) == text


def test_the_planner_prints_a_small_model_in_human_units():
    """`tiny` is 3.03M params: never `0.00303B params` or `0.0143M trainable`."""
    cfg = llama.get_config("tiny")
    est = planner.estimate(cfg, lora={"rank": 4}, quantization="nf4")
    head = str(est).splitlines()[0]
    assert head.startswith(f"{format_count(llama.num_params(cfg))} params (")
    assert format_count(llama.num_params(cfg)).endswith("M") and "0.0" not in head
    assert "K trainable" in head


@pytest.mark.slow
def test_dry_run_prints_a_small_model_in_human_units(tmp_path, capsys):
    """The dry run of `tiny`: params, trainable and NF4 weights in K/M, no `0.00B`."""
    argv = ["--config", "tiny", "--dry-run", "--batch-size", "2", "--seq-len", "32"]
    finetune.main(argv + ["--lora-rank", "4", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    n = format_count(llama.num_params(llama.get_config("tiny")))
    assert f"tiny: {n} params" in out and "K trainable" in out and "M weights" in out
    assert "0.00B" not in out and "0.0M" not in out


# -------------------------------------------------------------- defaults and notes (setup)


@pytest.mark.parametrize(
    "steps, every", [(1, 1), (4, 4), (10, 10), (20, 10), (50, 10), (200, 20), (1000, 100)]
)
def test_eval_every_default_scales_with_the_run(steps, every):
    """max(steps // 10, min(steps, 10)): a short run is evaluated before and after only."""
    assert default_eval_every(steps) == every
    cfg = llama.get_config("tiny")
    c, _ = resolve_defaults(finetune.FinetuneConfig.from_flat(steps=steps), cfg, on_gpu=False)
    assert c.data.eval_every == every


@pytest.mark.parametrize(
    "flags, noted",
    [
        ({"remat": "offload_inputs"}, "--remat offload_inputs"),
        ({"remat": "offload"}, "--remat offload"),
        ({"offload": True}, "--offload"),
        ({"remat": "full"}, None),
        ({"remat": "offload_inputs", "dry_run": True, "target": "h100_sxm"}, None),
    ],
)
def test_host_offload_on_cpu_gets_one_note(flags, noted):
    """On XLA:CPU host and device are one memory: offload is noted once, with the way to
    see it (a --target compile); not for other levers, nor when compiling for a GPU."""
    assert jax.default_backend() == "cpu"
    cfg = llama.get_config("tiny")
    _, notes = resolve_defaults(finetune.FinetuneConfig.from_flat(**flags), cfg, on_gpu=False)
    offload = [n for n in notes if "XLA:CPU" in n]
    if noted is None:
        assert not offload
    else:
        assert len(offload) == 1 and noted in offload[0] and "--target h100_sxm" in offload[0]


# ------------------------------------------------------------------------- plot and summary


def test_plot_is_titled_with_the_model_and_objective(tmp_path):
    """A checkpoint run is titled with its model_type and size, never its directory's name."""
    ck = tmp_path / "run-final-v2"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    cfg = llama.get_config("tiny")
    size = format_count(llama.num_params(cfg))
    c = finetune.FinetuneConfig.from_flat(checkpoint=str(ck), lora_rank=8)
    title = report.run_title(c, cfg)
    assert title == f"SFT with QLoRA (r=8): qwen3, {size} params" and "run-final" not in title
    c = finetune.FinetuneConfig.from_flat(config="tiny", lora_rank=4)
    assert report.run_title(c, cfg) == f"SFT with QLoRA (r=4): tiny, {size} params"


def test_train_and_eval_losses_share_one_step_axis(tmp_path, monkeypatch):
    """losses[s] and an evaluation at s both measure the adapters after s updates: the
    train curve starts at 0 with the first evaluation; the axis label says so."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    losses, evals, lrs = [5.0, 4.0, 3.5, 3.0], [[0, 5.1], [2, 3.6], [4, 2.9]], [0, 1, 1, 1]
    report.plot_losses(losses, evals, lrs, str(tmp_path / "p.png"), "t")
    ax = figures[0].axes[0]
    train, held = ax.lines
    np.testing.assert_array_equal(train.get_xdata(), [0, 1, 2, 3])
    np.testing.assert_array_equal(held.get_xdata(), [0, 2, 4])
    assert train.get_xdata()[0] == held.get_xdata()[0]
    assert ax.get_xlabel() == report.STEP_AXIS and "after s updates" in ax.get_xlabel()
    assert (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    "losses, evals, expected",
    [
        # the last evaluation interval (steps 2..3 between evaluations at 2 and 4)
        ([5.0, 4.0, 3.5, 3.0], [[0, 5.1], [2, 3.6], [4, 2.9]], (3.25, 2)),
        # one evaluation: the last 10 steps (here all 4)
        ([5.0, 4.0, 3.5, 3.0], [[0, 5.1]], (3.875, 4)),
        # skipped (non-finite) fp16 steps are left out
        ([5.0, float("nan"), 3.0, float("inf")], [[0, 5.0], [4, 3.0]], (4.0, 2)),
        ([float("nan")], [], (None, 0)),
    ],
)
def test_recent_train_loss_is_the_mean_over_the_last_eval_interval(losses, evals, expected):
    """The closing line compares the eval loss with the mean over the last interval, not
    one batch's loss (which swings ~0.15 nats per step on the default corpus)."""
    assert report.recent_train_loss(losses, evals) == expected


# ------------------------------------------------------------------------- quiet processes


def test_quiet_stdout_discards_the_descriptor_and_keeps_stderr(capfd):
    """C++ writes to fd 1 (gloo's std::cout) are discarded as prints are; stderr is kept
    and fd 1 is restored after."""
    with report.quiet_stdout():
        print("python print")
        os.write(1, b"[Gloo] Rank 1 is connected to 1 peer ranks.\n")
        os.write(2, b"an error line\n")
    os.write(1, b"after\n")
    out, err = capfd.readouterr()
    assert out == "after\n" and err == "an error line\n"


# Process 1 of 2 prints nothing (gloo's lines included): asserted on both runs of
# tests/test_finetune.py::test_two_processes_train_checkpoint_and_resume (one pair of
# processes instead of two).


# ------------------------------------------------------------------- samples in the template


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer (262 tokens) with ChatML special tokens and template."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=262,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello user assistant"] * 20, trainer)
    path = tmp_path_factory.mktemp("chatml")
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return data.HFTokenizer(str(path))


def _sampler(tok, chat, prompt="hello"):
    """A Sampler over a random 2-layer NF4 model with fresh adapters."""
    cfg = helpers.small_config(vocab_size=tok.vocab_size)
    frozen = qlora.quantize_params(llama.init(jax.random.key(0), cfg, jnp.bfloat16))
    adapters = lora.init(jax.random.key(1), frozen, rank=2, alpha=4.0)
    c = finetune.FinetuneConfig.from_flat(sample_prompt=prompt, sample_tokens=3)
    sample = Sampler(c, cfg, tok, types.SimpleNamespace(precision=None), chat=chat)
    sample(types.SimpleNamespace(params=adapters, frozen=frozen), "before")
    return sample


@pytest.mark.slow
def test_on_chat_data_the_sample_prompt_is_a_user_turn_in_the_template(chatml_tokenizer):
    """The sampled ids start with the template's user turn and generation prompt, which are
    the ids a training conversation has up to its answer (special tokens as tokens)."""
    tok = chatml_tokenizer
    sample = _sampler(tok, chat=True)
    rendered = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert sample.rendered == rendered == data.render_prompt("hello", tok)
    want = tok.encode_with_offsets(rendered)[0]
    ids = sample.tokens["before"]
    np.testing.assert_array_equal(ids[: len(want)], want)
    assert len(ids) == len(want) + 3
    assert ids[0] == tok._tok.token_to_id("<|im_start|>")  # one token, not its characters
    convo = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    train_ids, _ = data.tokenize_example({"messages": convo}, tok)
    np.testing.assert_array_equal(train_ids[: len(want)], want)
    assert sample.record()["sample_prompt"]["form"] == "chat template, user turn"


@pytest.mark.slow
def test_on_other_data_the_sample_prompt_is_raw_text(chatml_tokenizer):
    sample = _sampler(chatml_tokenizer, chat=False)
    want = chatml_tokenizer.encode("hello")
    np.testing.assert_array_equal(sample.tokens["before"][: len(want)], want)
    assert sample.rendered == "hello" and sample.record()["sample_prompt"]["form"] == "raw text"


def test_the_sample_prompt_tokens_are_transformers_apply_chat_template(chatml_tokenizer):
    """The oracle: ``apply_chat_template(..., add_generation_prompt=True)``'s ids."""
    transformers = pytest.importorskip("transformers")
    tok = chatml_tokenizer
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tok)
    hf_tok.chat_template = CHATML
    want = hf_tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True
    )
    want = want["input_ids"] if hasattr(want, "keys") else want  # BatchEncoding in v5
    np.testing.assert_array_equal(
        tok.encode_with_offsets(data.render_prompt("hello", tok))[0], want
    )


@pytest.mark.slow
def test_a_chat_run_samples_in_the_template_and_reports_it(tmp_path, capsys):
    """A run on chat data (byte tokens, the plain template): the samples are prompted as a
    user turn, summary.json says so; --steps 4 evaluates at 0 and 4 only (the default
    --eval-every); the summary names the objective and its step axis."""
    path = tmp_path / "chat.jsonl"
    with open(path, "w") as f:
        for i in range(24):
            msgs = [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    argv = ["--config", "tiny", "--data", str(path), "--batch-size", "2", "--seq-len", "32"]
    argv += ["--lora-rank", "4", "--steps", "4", "--eval-split", "0.2", "--no-progress"]
    argv += ["--sample-prompt", "hi", "--sample-tokens", "4", "--out", str(tmp_path / "o")]
    summary = finetune.main(argv)
    out = capsys.readouterr().out
    assert summary["chat"] is True
    assert summary["sample_prompt"] == {
        "text": "hi",
        "rendered": "### User:\nhi\n\n### Assistant:\n",
        "form": "chat template, user turn",
    }
    assert "sample before (step 0) (chat template): 'hi'" in out and len(summary["samples"]) == 2
    assert [s for s, _ in summary["eval_losses"]] == [0, 4]
    assert summary["objective"] == "SFT" and "after s updates" in summary["step_axis"]
    # the closing line and the summary put the eval loss beside the last interval's mean
    assert summary["recent_loss_steps"] == 4
    np.testing.assert_allclose(summary["recent_loss"], np.mean(summary["losses"]), rtol=1e-6)
    assert f"(mean of the last 4: {summary['recent_loss']:.4f}); eval loss" in out


# ------------------------------------------------------------------ base from compute dtype


@pytest.mark.slow
def test_the_base_is_quantized_from_the_compute_dtype(tmp_path):
    """A float32 checkpoint's layer matrices are rounded to the compute dtype (bf16) and
    NF4-quantized from that, as the docs say: bitwise the NF4 of the bf16 matrix."""
    cfg = helpers.small_config()
    params = llama.init(jax.random.key(0), cfg, jnp.float32)
    hf.save_params(str(tmp_path / "ck"), params, cfg, dtype=jnp.float32)
    c = finetune.FinetuneConfig.from_flat(checkpoint=str(tmp_path / "ck"))
    got = quantized_base(c, cfg, jnp.bfloat16, abstract=False)["layers"]["q_proj"]["kernel"]
    w = params["layers"]["q_proj"]["kernel"][0]
    from_bf16 = nf4.quantize(w.astype(jnp.bfloat16))
    from_f32 = nf4.quantize(w)
    assert got.dtype == jnp.bfloat16
    for leaf in ("packed", "absmax", "absmax_scale", "absmax_offset"):
        np.testing.assert_array_equal(getattr(got, leaf)[0], getattr(from_bf16, leaf))
    assert not np.array_equal(got.absmax_offset[0], from_f32.absmax_offset)


# ------------------------------------------- what the run says under QLoRA and full FT alike


@pytest.mark.parametrize("given, word", [({}, "default"), ({"remat": "selective"}, "as given")])
def test_a_lever_the_jobs_default_supplied_says_default(given, word):
    """The levers' reasons: ``remat = full (default; ...)`` when ``--remat`` was not given
    (the resolver alone says ``as given`` for every value it is handed)."""
    from jmem._src.finetune.build import job_resolved_levers

    config = finetune.FinetuneConfig.from_flat(config="tiny", seq_len=64, batch_size=2, **given)
    levers = job_resolved_levers(config, llama.get_config("tiny"), jnp.float32)
    assert levers.reason("remat").startswith(word), levers.reason("remat")
    assert levers.reason("loss_chunk").startswith("default"), levers.reason("loss_chunk")


def test_the_step_axis_and_the_weight_decay_help_hold_for_full_finetuning():
    """No adapters under ``--lora-rank 0``: the step axis counts updates of the weights,
    and ``--weight-decay`` names what it decays in either method."""
    from jmem._src import cli
    from jmem._src.finetune.config import TrainingConfig

    assert "adapters" not in report.STEP_AXIS and "weights after s updates" in report.STEP_AXIS
    (field,) = [f for f in cli.options(TrainingConfig) if f.name == "weight_decay"]
    assert "--lora-rank 0" in field.metadata["option"]["help"]
