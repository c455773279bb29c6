"""Instruction/chat examples: loading, chat templates, response masks, packing with segments."""

import json
import warnings

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import data
from jmem.models import llama

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The same template with transformers' {% generation %} tags, for its assistant mask.
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Multi-line, whitespace-sensitive (trim_blocks / lstrip_blocks), BOS/EOS, raise_exception.
LLAMA2_STYLE = """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] + ' ' %}{% set turns = messages[1:] %}
{% else %}
    {% set system = '' %}{% set turns = messages %}
{% endif %}
{% for message in turns %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant') }}
    {% endif %}
    {% if message['role'] == 'user' %}{{ bos_token + '[INST] ' }}
        {%- if loop.first %}{{ system }}{% endif %}{{ message['content'] | trim + ' [/INST]' }}
    {%- else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}
{% endfor %}
"""
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "héllo"},
    {"role": "user", "content": "user system"},
    {"role": "assistant", "content": "world hello"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE checkpoint tokenizer with ChatML special tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world héllo user system assistant brief"] * 20, trainer)
    # Llama-style: the tokenizer starts a plain text with <s>.
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return path


def _write_config(directory, **config):
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, **config})
    )
    return data.HFTokenizer(str(directory))


def _hf(directory, template):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = template
    return hf


# --- loading ------------------------------------------------------------------------------


def test_load_examples_reads_every_format(tmp_path):
    lines = [
        {"text": "a document", "id": 7},
        {"prompt": "2+2=", "completion": "4"},
        {"instruction": "Add.", "input": "2 and 2", "output": "4"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"messages": CHAT[1:3]},
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n")
    with open(path, "a") as f:
        f.write("\n".join(json.dumps(x) for x in lines[2:]) + "\n")
    assert data.load_examples(str(path)) == [
        {"text": "a document"},
        {"prompt": "2+2=", "completion": "4"},
        {
            "messages": [
                {"role": "user", "content": "Add.\n\n2 and 2"},
                {"role": "assistant", "content": "4"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "hi"},
            ]
        },
        {"messages": CHAT[1:3]},
    ]


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("missing.jsonl", None, r"missing.jsonl: no such file; expected a .jsonl"),
        ("d.csv", "x", r"d.csv: unsupported extension; expected a .jsonl"),
        ("e.jsonl", "\n  \n", r"e.jsonl: the file has no examples; expected one line"),
        ("f.jsonl", '{"text": "ok"}\n{not json\n', r"f.jsonl:2: not valid JSON .*expected"),
        ("g.jsonl", '\n{"text": "ok"}\n{"foo": 1}\n', r"g.jsonl:3: got keys \['foo'\]; expected"),
        ("h.jsonl", '{"messages": [{"role": "user", "content": "x"}]}', r"h.jsonl:1: .*assistant"),
        ("i.jsonl", '{"prompt": "x", "completion": 3}', r"i.jsonl:1: got keys .*expected"),
        ("j.jsonl", '{"instruction": "x"}', r"j.jsonl:1: got keys \['instruction'\]"),
        ("k.jsonl", "[1, 2]", r"k.jsonl:1: got list; expected"),
    ],
)
def test_bad_files_name_file_line_and_what_is_expected(tmp_path, name, content, match):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=match):
        data.load_examples(str(tmp_path / name))


# --- rendering and response tokens --------------------------------------------------------


def test_plain_template_trains_on_every_assistant_turn():
    text, spans = data.render_example({"messages": CHAT}, data.ByteTokenizer())
    assert text == (
        "### System:\nBe brief.\n\n### User:\nhello world\n\n### Assistant:\nhéllo"
        "\n\n### User:\nuser system\n\n### Assistant:\nworld hello"
    )
    assert [text[a:b] for a, b in spans] == ["héllo", "world hello"]
    ids, response = data.tokenize_example({"messages": CHAT}, data.ByteTokenizer())
    assert data.ByteTokenizer().decode(ids[response]) == "héllo" + "world hello"


def test_plain_template_with_bos_and_eos(tokenizer_dir):
    tok = _write_config(tokenizer_dir)  # no chat template: the plain one, with BOS/EOS
    example = {"instruction": "Say hi.", "output": "hi"}
    text, spans = data.render_example(example, tok)
    assert text == "<s>### User:\nSay hi.\n\n### Assistant:\nhi</s>"
    assert [text[a:b] for a, b in spans] == ["hi</s>"]
    ids, response = data.tokenize_example(example, tok)
    assert ids[0] == 0 and ids[-1] == 1  # <s> and </s> are single special tokens
    prompt_ids, _ = tok.encode_with_offsets(text[: spans[0][0]])
    np.testing.assert_array_equal(ids[: len(prompt_ids)], prompt_ids)
    np.testing.assert_array_equal(ids[response], tok.encode_with_offsets("hi</s>")[0])
    assert not response[: len(prompt_ids)].any() and response[len(prompt_ids) :].all()


def test_prompt_completion_and_text_are_verbatim(tokenizer_dir):
    tok = _write_config(tokenizer_dir)
    assert data.render_example({"prompt": "2+2=", "completion": "4"}, tok) == (
        "<s>2+2=4</s>",
        [(7, 12)],
    )
    assert data.render_example({"text": "<s>hello</s>"}, tok) == ("<s>hello</s>", [(0, 12)])
    assert data.render_example({"prompt": "2+2=", "completion": "4"}, data.ByteTokenizer()) == (
        "2+2=4",
        [(4, 5)],
    )


def test_no_bos_when_the_tokenizer_does_not_add_one(tokenizer_dir, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    gpt2_style = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    gpt2_style.post_processor = tokenizers.processors.ByteLevel()  # adds no special token
    gpt2_style.save(str(tmp_path / "tokenizer.json"))
    tok = _write_config(tmp_path)
    assert _write_config(tokenizer_dir).add_bos_token and not tok.add_bos_token
    assert data.render_example({"prompt": "2+2=", "completion": "4"}, tok) == (
        "2+2=4</s>",
        [(4, 9)],
    )


@pytest.mark.parametrize("tokenize", [False, True])
def test_chat_template_matches_transformers(tokenizer_dir, tokenize):
    tok = _write_config(tokenizer_dir, chat_template=CHATML_GENERATION)
    hf = _hf(tokenizer_dir, CHATML_GENERATION)
    if not tokenize:
        for gen in (False, True):
            want = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
            got = data.render_chat(
                CHAT,
                tok.chat_template,
                bos_token="<s>",
                eos_token="</s>",
                add_generation_prompt=gen,
            )
            assert got == want
        return
    out = hf.apply_chat_template(
        CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, response = data.tokenize_example({"messages": CHAT}, tok)
    np.testing.assert_array_equal(ids, out["input_ids"])
    np.testing.assert_array_equal(response, np.asarray(out["assistant_masks"], bool))
    assert hf.decode(ids[response]) == "héllo<|im_end|>\nworld hello<|im_end|>\n"


def test_whitespace_control_bos_eos_and_raise_exception_as_transformers(tokenizer_dir):
    tok = _write_config(tokenizer_dir, chat_template=LLAMA2_STYLE)
    hf = _hf(tokenizer_dir, LLAMA2_STYLE)
    text, spans = data.render_example({"messages": CHAT}, tok)
    assert text == hf.apply_chat_template(CHAT, tokenize=False)
    assert text == (
        "<s>[INST] Be brief. hello world [/INST] héllo </s><s>[INST] user system [/INST] "
        "world hello </s>"
    )
    assert [text[a:b] for a, b in spans] == [" héllo </s>", " world hello </s>"]
    bad = {"messages": [CHAT[2], CHAT[1], CHAT[2]]}  # starts with the assistant
    with pytest.raises(ValueError, match="roles must alternate"):
        data.render_example(bad, tok)


def test_template_that_rewrites_earlier_turns_is_refused(tokenizer_dir):
    only_last = (
        "{% for m in messages %}{{ m['role'] + ': ' }}"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}"
        "{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tok = _write_config(tokenizer_dir, chat_template=only_last)
    with pytest.raises(ValueError, match="prefix of the whole conversation"):
        data.render_example({"messages": CHAT}, tok)


def test_chat_template_sources(tokenizer_dir, tmp_path):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]
    assert _write_config(tmp_path, chat_template=named).chat_template == CHATML
    assert _write_config(tmp_path).chat_template is None
    (tmp_path / "chat_template.jinja").write_text(CHATML_GENERATION)
    assert _write_config(tmp_path, chat_template=CHATML).chat_template == CHATML_GENERATION
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").unlink()
    tok = data.HFTokenizer(str(tmp_path))
    assert (tok.bos_token, tok.eos_token, tok.chat_template) == (None, None, None)


# --- packing ------------------------------------------------------------------------------


def test_pack_examples_exact_arrays():
    examples = [
        {"prompt": "abcde", "completion": "fgh"},  # 5 + 3 tokens: 7 slots, mask at 4, 5, 6
        {"text": "xyz"},  # 3 tokens: 2 slots, all trained on
        {"prompt": "0123456", "completion": "89"},  # 9 tokens: does not fit, next row
    ]
    rows = data.pack_examples(examples, data.ByteTokenizer(), seq_len=10)
    assert {k: v.dtype for k, v in rows.items()} == {
        "inputs": np.int32,
        "targets": np.int32,
        "mask": np.float32,
        "segment_ids": np.int32,
        "positions": np.int32,
    }
    b = lambda s: [ord(c) for c in s]
    np.testing.assert_array_equal(
        rows["inputs"], [b("abcdefg") + b("xy") + [0], b("01234568") + [0, 0]]
    )
    np.testing.assert_array_equal(
        rows["targets"], [b("bcdefgh") + b("yz") + [0], b("12345689") + [0, 0]]
    )
    np.testing.assert_array_equal(
        rows["mask"], [[0, 0, 0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 1, 1, 0, 0]]
    )
    np.testing.assert_array_equal(
        rows["segment_ids"], [[1, 1, 1, 1, 1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]]
    )
    np.testing.assert_array_equal(
        rows["positions"], [[0, 1, 2, 3, 4, 5, 6, 0, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7, 0, 0]]
    )


def test_mask_never_crosses_example_boundaries():
    # A response at the end of one example: the next example's first slot predicts its
    # second token from its first, so the mask there is that example's, not the response's.
    rows = data.pack_examples(
        [{"prompt": "ab", "completion": "c"}, {"prompt": "de", "completion": "f"}],
        data.ByteTokenizer(),
        seq_len=4,
    )
    np.testing.assert_array_equal(rows["mask"], [[0, 1, 0, 1]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 2, 2]])


def test_truncation_and_untrained_examples_warn_and_errors_are_clear():
    tok = data.ByteTokenizer()
    with pytest.warns(UserWarning, match="1 of 2 examples are longer"):
        rows = data.pack_examples([{"text": "abcdefgh"}, {"text": "xy"}], tok, seq_len=4)
    np.testing.assert_array_equal(rows["targets"], [list(b"bcde"), [ord("y"), 0, 0, 0]])
    with pytest.warns(UserWarning, match="1 of 2 examples have no response token"):
        with pytest.warns(UserWarning, match="1 of 2 examples are longer"):
            rows = data.pack_examples(
                [{"prompt": "abcdefgh", "completion": "x"}, {"prompt": "a", "completion": "b"}],
                tok,
                seq_len=4,
            )
    # the untrained example is left out: every row has a trained-on slot (no fake 0 loss)
    np.testing.assert_array_equal(rows["mask"], [[1, 0, 0, 0]])
    assert (rows["mask"].sum(axis=1) > 0).all()
    with warnings.catch_warnings(), pytest.raises(ValueError, match="None of the 1 examples"):
        warnings.simplefilter("ignore")
        data.pack_examples([{"text": "a"}], tok, seq_len=4)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="None of the 1 examples"):
        warnings.simplefilter("ignore")
        data.pack_examples([{"prompt": "abcdefgh", "completion": "x"}], tok, seq_len=4)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        data.pack_examples([{"text": "ab"}], tok, seq_len=0)
    with pytest.raises(ValueError, match=r"example 1: got keys \['body'\]"):
        data.pack_examples([{"text": "ab"}, {"body": "x"}], tok, seq_len=4)
    with pytest.raises(TypeError, match="encode_with_offsets"):
        data.pack_examples([{"text": "ab"}], object(), seq_len=4)


def test_pack_examples_counts_what_it_cut_and_what_trains_nothing():
    """return_counts: the job refuses data where every example is untrained and reports a
    fraction; warn=False leaves the telling to the caller."""
    tok = data.ByteTokenizer()
    examples = [
        {"prompt": "abcdefgh", "completion": "x"},  # cut at 5 tokens: response lost
        {"prompt": "a", "completion": "bc"},  # fits
        {"prompt": "ab", "completion": ""},  # no response at all (eos only? byte: none)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows, counts = data.pack_examples(examples, tok, seq_len=4, warn=False, return_counts=True)
    assert counts == {"examples": 3, "truncated": 1, "untrained": 2, "max_tokens": 9}
    assert rows["mask"].sum() == 2  # "b", "c"


# --- dataset ------------------------------------------------------------------------------


def test_packed_examples_dataset_batches_and_exact_resume():
    examples = [{"prompt": f"q{i}:", "completion": "a" * (1 + i % 7)} for i in range(60)]
    ds = data.PackedDataset.from_examples(examples, data.ByteTokenizer(), 16, 4, seed=5)
    rows = data.pack_examples(examples, data.ByteTokenizer(), 16)
    n = len(rows["inputs"])
    assert ds.batches_per_epoch == n // 4
    it = ds.iterate()
    seq = [next(it) for _ in range(3 * ds.batches_per_epoch + 2)]  # crosses epochs
    batch, pos = seq[0]
    assert set(batch) == {"inputs", "targets", "mask", "segment_ids", "positions"}
    idx = ds._order(0)[:4]
    for k in rows:
        np.testing.assert_array_equal(batch[k], rows[k][idx])
    saved = data.Position.from_dict(json.loads(json.dumps(seq[6][1].to_dict())))
    resumed = ds.iterate(saved)
    for k in range(7, len(seq)):
        b, p = next(resumed)
        for key in b:
            np.testing.assert_array_equal(b[key], seq[k][0][key])
        assert p == seq[k][1]


def test_from_rows_errors():
    with pytest.raises(ValueError, match="one shape"):
        data.PackedDataset.from_rows({"inputs": np.zeros((4, 8)), "mask": np.zeros((4, 7))}, 2)
    with pytest.raises(ValueError, match="fewer than one batch of 8"):
        data.PackedDataset.from_rows({"inputs": np.zeros((4, 8))}, 8)
    with pytest.raises(ValueError, match=">= 1"):
        data.PackedDataset.from_rows({"inputs": np.zeros((4, 8))}, 0)


# --- the packed row through the reference model -------------------------------------------


@pytest.mark.slow
def test_packed_example_has_its_logits_alone_and_the_loss_is_the_token_mean():
    cfg = helpers.small_config(vocab_size=256)
    params = llama.init(jax.random.key(0), cfg)
    tok = data.ByteTokenizer()
    first = {"prompt": "The capital of France is", "completion": " Paris."}
    second = {"prompt": "2 + 2 =", "completion": " 4"}
    rows = data.pack_examples([first, second], tok, seq_len=48)
    assert rows["inputs"].shape == (1, 48)
    n1, n2 = (
        len(tok.encode("The capital of France is Paris.")) - 1,
        len(tok.encode("2 + 2 = 4")) - 1,
    )
    np.testing.assert_array_equal(rows["segment_ids"][0, : n1 + n2 + 1], [1] * n1 + [2] * n2 + [0])

    packed = llama.forward(
        params, rows["inputs"], cfg, positions=rows["positions"], segment_ids=rows["segment_ids"]
    )
    alone = [
        llama.forward(params, data.pack_examples([ex], tok, n)["inputs"], cfg)
        for ex, n in ((first, n1), (second, n2))
    ]
    np.testing.assert_allclose(packed[0, n1 : n1 + n2], alone[1][0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[0, :n1], alone[0][0], atol=1e-5, rtol=0)
    # Without segment ids and positions the second example attends to the first.
    crosstalk = llama.forward(params, rows["inputs"], cfg)
    assert np.abs(crosstalk[0, n1 : n1 + n2] - alone[1][0]).max() > 1e-3

    # The loss is the mean over the response tokens of both examples (7 + 2 targets).
    def nll(logits, targets):
        logz = jax.nn.logsumexp(logits, axis=-1)
        return logz - np.take_along_axis(np.asarray(logits), targets[..., None], -1)[..., 0]

    per_token = np.concatenate(
        [
            nll(alone[0][0], rows["targets"][0, :n1]),
            nll(alone[1][0], rows["targets"][0, n1 : n1 + n2]),
        ]
    )
    response = rows["mask"][0, : n1 + n2].astype(bool)
    assert response.sum() == len(" Paris.") + len(" 4")
    want = per_token[response].mean()
    got = llama.loss_fn(params, {k: jnp.asarray(v) for k, v in rows.items()}, cfg)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.slow
def test_train_step_on_packed_batches_with_microbatches_is_the_whole_batch_token_mean():
    import optax  # noqa: PLC0415

    import jmem  # noqa: PLC0415

    cfg = helpers.small_config(vocab_size=256)
    params = llama.init(jax.random.key(0), cfg)
    examples = [
        {
            "messages": [
                {"role": "user", "content": "hi " * (i % 5)},
                {"role": "assistant", "content": "ok" * i},
            ]
        }
        for i in range(1, 9)
    ]
    ds = data.PackedDataset.from_examples(examples, data.ByteTokenizer(), 64, 4, seed=0)
    batch = jax.tree.map(jnp.asarray, ds.batch_at(data.Position())[0])
    counts = batch["mask"].reshape(2, -1).sum(axis=1)
    assert counts[0] != counts[1]  # the two microbatches have different response-token counts
    loss = lambda p, b: llama.loss_fn(p, b, cfg)
    step = jmem.train_step(loss, optax.sgd(0.1), microbatches=2, donate=False)
    state, metrics = step(step.init(params), batch)
    want_loss, grads = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-6)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-6), state.params, want
    )
