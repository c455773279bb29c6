"""GRPO prompts: TRL's prompt-only format (text or chat messages), tokenized as TRL does
(transformers as the oracle), left truncation, columns for the rewards, and the refusals."""

import json
import pathlib

import pytest

from jmem import data
from jmem import rewards
from jmem._src.cli import CliError
from jmem._src.finetune.prompt_data import PromptRecord
from jmem._src.finetune.prompt_data import prompt_columns
from jmem._src.finetune.prompt_data import read_prompts

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello world"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer that starts a text with <s> (Llama-style)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world user system assistant brief"] * 20, trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _jsonl(tmp_path, rows, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_text_prompts_keep_their_columns(tmp_path):
    rows = [{"prompt": "2+2=", "answer": "#### 4"}, {"prompt": "héllo", "level": 3}]
    records, notes = read_prompts(_jsonl(tmp_path, rows), data.ByteTokenizer(), max_prompt_len=64)
    assert notes == []
    assert records[0] == PromptRecord("2+2=", tuple(b"2+2="), {"answer": "#### 4", "level": None})
    assert records[1].ids == tuple("héllo".encode()) and records[1].columns["level"] == 3
    columns = prompt_columns(records, num_generations=2)  # TRL's order: each prompt's G rows
    assert columns == {"answer": ["#### 4", "#### 4", None, None], "level": [None, None, 3, 3]}


def test_text_and_chat_prompts_tokenize_as_trl(tokenizer_dir, tmp_path):
    """Text: ``tokenizer(text)`` (with BOS); messages: ``apply_chat_template(...,
    add_generation_prompt=True, tokenize=True)`` (the template's BOS, no second one)."""
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = CHATML
    tok = data.HFTokenizer(str(tokenizer_dir))
    path = _jsonl(tmp_path, [{"prompt": "hello world"}, {"prompt": MESSAGES, "answer": 7}])
    (text, chat), _ = read_prompts(path, tok, max_prompt_len=100)
    assert list(text.ids) == hf("hello world")["input_ids"] and text.ids[0] == 0
    kw = dict(add_generation_prompt=True, tokenize=True, return_dict=True)
    expected = list(hf.apply_chat_template(MESSAGES, **kw)["input_ids"])
    assert list(chat.ids) == expected and chat.ids.count(0) == 1
    assert chat.text == hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat.text.endswith("<|im_start|>assistant\n") and chat.columns == {"answer": 7}


def test_long_prompts_keep_their_end_with_one_note(tmp_path):
    rows = [{"prompt": "abcdefghij"}, {"prompt": "abc"}, {"prompt": "0123456789xyz"}]
    path = _jsonl(tmp_path, rows)
    records, notes = read_prompts(
        path, data.ByteTokenizer(), max_prompt_len=5, max_prompt_len_name="--max-prompt-len"
    )
    assert [bytes(r.ids) for r in records] == [b"fghij", b"abc", b"89xyz"]
    assert records[0].text == "abcdefghij"  # the text is the whole prompt
    assert len(notes) == 1 and notes[0].startswith("2 of 3 prompts are longer than")
    assert "--max-prompt-len 5 tokens (longest 13)" in notes[0]


def test_a_json_array_reads_as_jsonl(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b", "x": 1}]))
    records, _ = read_prompts(str(path), data.ByteTokenizer(), max_prompt_len=8)
    assert [r.text for r in records] == ["a", "b"] and records[0].columns == {"x": None}


@pytest.mark.parametrize(
    "rows, match",
    [
        ([], "the file holds no prompts"),
        (["", "  "], "the file holds no prompts"),
        ([{"question": "2+2?"}], r"prompts.jsonl:1: no 'prompt' field \(got keys \['question'\]\)"),
        ([{"prompt": "a"}, "{not json"], "prompts.jsonl:2: not valid JSON"),
        ([{"prompt": 3}], "prompts.jsonl:1: 'prompt' is a int, neither text nor a list"),
        ([{"prompt": [{"role": "user"}]}], "'prompt' is a list, neither text nor"),
        (
            [{"prompt": MESSAGES}],
            "the prompt is chat messages and the tokenizer has no chat template",
        ),
        ([{"prompt": ""}], "prompts.jsonl:1: the prompt has no tokens"),
        ([[1, 2]], "prompts.jsonl:1: no 'prompt' field (got list)"),
    ],
)
def test_bad_files_are_refused_in_one_line(tmp_path, rows, match):
    with pytest.raises(CliError, match=match.replace("(got list)", r"\(got list\)")) as e:
        read_prompts(_jsonl(tmp_path, rows), data.ByteTokenizer(), max_prompt_len=8)
    assert "\n" not in str(e.value)


def test_missing_files_other_extensions_and_a_bad_length_are_refused(tmp_path):
    tok = data.ByteTokenizer()
    with pytest.raises(CliError, match="no such file"):
        read_prompts(str(tmp_path / "none.jsonl"), tok, max_prompt_len=8)
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(CliError, match="unsupported extension; expected .jsonl or .json"):
        read_prompts(str(tmp_path / "p.txt"), tok, max_prompt_len=8)
    with pytest.raises(CliError, match="max_prompt_len must be an int >= 1; got 0"):
        read_prompts(_jsonl(tmp_path, [{"prompt": "a"}]), tok, max_prompt_len=0)


def test_a_failing_chat_template_names_the_line(tokenizer_dir, tmp_path):
    tok = data.HFTokenizer(str(tokenizer_dir))
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(CliError, match="prompts.jsonl:1: .*only user turns"):
        read_prompts(_jsonl(tmp_path, [{"prompt": MESSAGES}]), tok, max_prompt_len=8)


def test_the_toy_task_reads_and_scores():
    """examples/grpo_letters.jsonl and examples/grpo_letter_reward.py (the README's task)."""
    path = str(ROOT / "examples" / "grpo_letters.jsonl")
    records, notes = read_prompts(path, data.ByteTokenizer(), max_prompt_len=32)
    assert len(records) >= 24 and notes == []
    rs = rewards.parse_rewards([f"{ROOT / 'examples' / 'grpo_letter_reward.py'}:letter_share"])
    total, _ = rs(
        [r.text for r in records[:3]], ["eeee", "the tree", ""], prompt_columns(records[:3])
    )
    assert total.tolist() == [1.0, 3 / 8, 0.0]
