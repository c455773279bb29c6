"""GRPO reward functions: the specs, the built-ins on worked examples, the checks of what a
function returns, and TRL's ``_calculate_rewards`` as the oracle of how they are called."""

import pathlib
import subprocess
import sys
import types
from decimal import Decimal

import numpy as np
import pytest

from jmem import rewards
from jmem.rewards import RewardError

ROOT = pathlib.Path(__file__).resolve().parent.parent
LETTER_REWARD = ROOT / "examples" / "grpo_letter_reward.py"


# --- built-ins --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, number",
    [
        ("The answer is 42.", "42"),
        ("so it costs $1,234,567.50 in all", "1234567.50"),
        ("first 3, then -7", "-7"),
        ("minus \u22124", "-4"),
        ("10-2", "2"),  # a minus right after a digit is not a sign
        ("half is .5", "0.5"),
        ("1,2,3", "3"),  # not a thousands separator
        ("x2 and y3", None),  # inside a word
        ("no digits", None),
        ("+8", "8"),
    ],
)
def test_final_number(text, number):
    assert rewards.final_number(text) == (None if number is None else Decimal(number))


def test_answer_match_on_gsm8k_answers():
    completions = [
        "48 + 24 = 72. The answer is 72",
        "It is 1000 dollars.",
        "The temperature falls to -5 degrees.",
        "She pays 2.50 each",
        "I cannot tell.",
        "The answer is 18, not 81",
        "72",
    ]
    answer = [
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
        "#### 1,000",
        "#### -5",
        "#### 2.5",
        "#### 3",
        "#### 18",  # the last number counts: 81
        72.0,  # a number column
    ]
    got = rewards.answer_match(["q"] * 7, completions, answer)
    assert got == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_answer_match_refuses_an_answer_without_a_number():
    with pytest.raises(ValueError, match="row 1: the answer 'unknown' holds no number"):
        rewards.answer_match(["q"] * 2, ["1", "2"], ["#### 1", "unknown"])


def test_format_match_default_and_custom():
    good = "<think>\n2 + 2 is 4\n</think>\n<answer>4</answer>\n"
    completions = [
        good,
        "<answer>4</answer>",
        good + "and more",
        "<think>x</think><answer></answer>",
    ]
    assert rewards.format_match(None, completions) == [1.0, 0.0, 0.0, 1.0]
    rs = rewards.parse_rewards([r"format_match=\d+(,\d+)*"])  # commas and = belong to the regex
    total, _ = rs(["p"] * 3, ["12,345", "12,", "a1"])
    np.testing.assert_array_equal(total, [1.0, 0.0, 0.0])


def test_length_penalty_is_dapo_soft_overlong_punishment():
    ids = [[0] * n for n in (0, 80, 81, 90, 100, 101, 500)]
    got = rewards.length_penalty(None, None, ids, max_length=100, cache=20)
    np.testing.assert_allclose(got, [0.0, 0.0, -1 / 20, -0.5, -1.0, -1.0, -1.0])
    # The default cache is L // 5; a cache of 0 is a hard cut at L.
    assert rewards.length_penalty(None, None, [[0] * 9], max_length=10) == [-0.5]
    assert rewards.length_penalty(None, None, [[0] * 10, [0] * 11], max_length=10, cache=0) == [
        0.0,
        -1.0,
    ]


@pytest.mark.slow  # imports TRL (torch)
def test_length_penalty_equals_trl():
    trl_rewards = pytest.importorskip("trl.rewards", reason="TRL is the oracle")
    ids = [[1] * n for n in range(0, 130, 3)]
    for cache in (0, 1, 20, 100):
        trl = trl_rewards.get_soft_overlong_punishment(100, cache)(completion_ids=ids)
        ours = rewards.length_penalty(None, None, ids, max_length=100, cache=cache)
        np.testing.assert_allclose(ours, trl, rtol=0, atol=0)
        spec = rewards.parse_rewards([f"length_penalty=100:{cache}"])
        total, _ = spec(["p"] * len(ids), [""] * len(ids), completion_ids=ids)
        np.testing.assert_allclose(total, np.float32(trl), rtol=0, atol=0)


# --- specs ------------------------------------------------------------------------------


def _write(tmp_path, body, name="my_rewards.py"):
    path = tmp_path / name
    path.write_text(body)
    return path


def test_load_by_file_and_by_module(tmp_path, monkeypatch):
    body = "def share(prompts, completions, **kw):\n    return [0.25] * len(completions)\n"
    path = _write(tmp_path, body, "reward_by_path.py")
    _write(tmp_path, body.replace("0.25", "0.5"), "reward_by_module.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    rs = rewards.parse_rewards(
        [f"{path}:share", "reward_by_module:share", f"{LETTER_REWARD}:letter_share"]
    )
    assert rs.names == ("share", "share_2", "letter_share")
    total, per = rs(["p", "p"], ["eee", "xyz e"])
    np.testing.assert_allclose(per["share"], [0.25, 0.25])
    np.testing.assert_allclose(per["share_2"], [0.5, 0.5])
    np.testing.assert_allclose(per["letter_share"], [1.0, 0.2], rtol=1e-6)
    np.testing.assert_allclose(total, [1.75, 0.95], rtol=1e-6)
    assert total.dtype == np.float32 and per["share"].dtype == np.float32


def test_weights_and_required_columns():
    def wants(prompts, completions, level, hint=None):
        return [float(l) for l in level]

    rs = rewards.parse_rewards(["answer_match=solution", wants, "format_match"], [2.0, -0.5, 1])
    assert rs.weights == (2.0, -0.5, 1.0)
    assert rs.required_columns == ("level", "solution")
    total, per = rs(
        ["p"] * 2, ["4", "<think></think><answer>5</answer>"], {"solution": [4, 4], "level": [1, 3]}
    )
    np.testing.assert_array_equal(per["answer_match"], [1.0, 0.0])
    np.testing.assert_array_equal(total, [2.0 - 0.5, -1.5 + 1.0])
    with pytest.raises(RewardError, match="2 reward weights for 3 reward functions"):
        rewards.parse_rewards(["answer_match", wants, "format_match"], [1.0, 2.0])
    with pytest.raises(RewardError, match="not all finite"):
        rewards.parse_rewards(["answer_match"], [float("nan")])


def test_what_each_function_is_passed():
    seen = {}

    def everything(prompts, completions, **kwargs):
        seen["all"] = kwargs
        return [0.0] * len(completions)

    def named(completions, prompts, answer):
        seen["named"] = answer
        return [0.0] * len(completions)

    def ids_only(prompts, completions, completion_ids):
        seen["ids"] = completion_ids
        return [float(len(i)) for i in completion_ids]

    rs = rewards.parse_rewards([everything, named, ids_only])
    ids = np.array([[5, 6, 7], [8, 9, 10]])
    total, _ = rs(["a", "b"], ["x", "y"], {"answer": [1, 2], "extra": ["u", "v"]}, ids)
    assert seen["all"] == {"answer": [1, 2], "extra": ["u", "v"], "completion_ids": ids.tolist()}
    assert seen["named"] == [1, 2] and seen["ids"] == [[5, 6, 7], [8, 9, 10]]
    assert all(type(t) is int for t in seen["ids"][0])  # lists of ints, as TRL passes
    np.testing.assert_array_equal(total, [3.0, 3.0])


def test_none_is_not_scored():
    def half(prompts, completions, **kw):
        return [None, 1.0, None]

    def other(prompts, completions, **kw):
        return [2.0, None, None]

    rs = rewards.parse_rewards([half, other], [1.0, 3.0])
    with pytest.raises(RewardError, match=r"no reward function scored rows 2 \(of 3\)"):
        rs(["p"] * 3, ["a", "b", "c"])
    rs = rewards.parse_rewards([half, other, lambda prompts, completions, **kw: [0.5] * 3])
    total, per = rs(["p"] * 3, ["a", "b", "c"])
    np.testing.assert_array_equal(per["half"], [np.nan, 1.0, np.nan])
    np.testing.assert_array_equal(total, [2.5, 1.5, 0.5])


def _one_line(excinfo, *names):
    message = str(excinfo.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message


@pytest.mark.parametrize(
    "result, match",
    [
        (RuntimeError("server down"), "raised RuntimeError: server down"),
        (0.5, "returned a float, not a list"),
        ("1.0", "returned a str, not a list"),
        ([1.0], "returned 1 rewards for 3 completions"),
        ([1.0, "2", 3.0], "returned a str at row 1"),
        ([1.0, float("nan"), float("inf")], r"returned NaN or inf at rows 1, 2 \(of 3\)"),
        (np.zeros((3, 1)), "returned a list at row 0"),
    ],
)
def test_a_bad_result_names_the_function(result, match):
    def judge(prompts, completions, **kw):
        if isinstance(result, Exception):
            raise result
        return result

    rs = rewards.parse_rewards([judge])
    with pytest.raises(RewardError, match=match) as e:
        rs(["p"] * 3, ["a", "b", "c"])
    _one_line(e, "'judge'")


def test_arrays_are_accepted():
    rs = rewards.parse_rewards([lambda prompts, completions, **kw: np.arange(3.0)])
    np.testing.assert_array_equal(rs(["p"] * 3, ["a"] * 3)[0], [0.0, 1.0, 2.0])


def test_missing_inputs_are_refused():
    rs = rewards.parse_rewards(["answer_match", "length_penalty=8"])
    with pytest.raises(RewardError, match="needs the column 'answer', which the data lacks") as e:
        rs(["p"], ["1"], {"solution": ["1"]})
    _one_line(e, "'answer_match'", "solution")
    with pytest.raises(RewardError, match="'length_penalty' needs completion_ids"):
        rs(["p"], ["1"], {"answer": ["1"]})
    with pytest.raises(RewardError, match="column 'answer' has 1 values for 2 completions"):
        rs(["p", "p"], ["1", "2"], {"answer": ["1"]})


@pytest.mark.parametrize(
    "spec, match",
    [
        ("answer_mach", "unknown built-in reward 'answer_mach' (did you mean 'answer_match'?)"),
        ("format_match=(", "the regex does not compile"),
        ("length_penalty", "needs its maximum length in tokens"),
        ("length_penalty=8:9", "'8:9' is not MAX or MAX:CACHE"),
        ("length_penalty=big", "'big' is not MAX or MAX:CACHE"),
        ("answer_match=a b", "'a b' is not a column name"),
        ("missing_file.py:f", "no such file 'missing_file.py'"),
        ("jmem_no_such_module:f", "no module 'jmem_no_such_module'"),
        (
            "jmem._src.rewards:answer_mach",
            "has no function 'answer_mach' (did you mean 'answer_match'?)",
        ),
        ("jmem._src.rewards:THINK_ANSWER_FORMAT", "is a str, not a function"),
        ("mod.py:", "names no function"),
        ("", "not a non-empty string"),
    ],
)
def test_bad_specs_are_refused_in_one_line(spec, match):
    with pytest.raises(RewardError, match=__import__("re").escape(match)) as e:
        rewards.parse_rewards([spec])
    _one_line(e)


def test_bad_files_and_signatures_are_refused(tmp_path):
    broken = _write(tmp_path, "import nothing_here_zz\n", "broken.py")
    with pytest.raises(RewardError, match="importing .*broken.py raised ModuleNotFoundError") as e:
        rewards.parse_rewards([f"{broken}:f"])
    _one_line(e)
    with pytest.raises(RewardError, match=r"cannot be called as f\(prompts=, completions=") as e:
        rewards.parse_rewards([lambda texts: [0.0] * len(texts)])
    _one_line(e, "'<lambda>'", "texts")
    with pytest.raises(RewardError, match="needs 'trainer_state', which TRL passes and jmem"):
        rewards.parse_rewards([lambda prompts, completions, trainer_state: [0.0]])
    with pytest.raises(RewardError, match="no reward function given"):
        rewards.parse_rewards([])
    # the module-spec form reaches a bare length_penalty's default from the job
    rs = rewards.parse_rewards(
        ["length_penalty", "jmem._src.rewards:format_match"], max_completion_length=10
    )
    total, _ = rs(["p"], ["<think></think><answer>1</answer>"], completion_ids=[[1] * 9])
    np.testing.assert_allclose(total, [-0.5 + 1.0])


@pytest.mark.slow  # imports TRL (torch)
def test_rewards_as_trl_calculates_them():
    """TRL's own ``GRPOTrainer._calculate_rewards`` (on a stand-in trainer) gives the same
    per-function rewards (None as NaN), and the total is TRL's
    ``(rewards_per_func * reward_weights).nansum(dim=1)``."""
    pytest.importorskip("torch", reason="TRL's reward handling runs on torch")
    trl = pytest.importorskip("trl", reason="TRL is the oracle")
    import torch

    def length(prompts, completions, completion_ids, **kw):
        return [len(i) / 4 for i in completion_ids]

    def graded(prompts, completions, answer, **kw):
        return [
            None if a.startswith("skip") else float(c.strip() == a)
            for c, a in zip(completions, answer)
        ]

    funcs, weights = [length, graded, rewards.answer_match], [0.5, 2.0, 1.0]
    inputs = [{"prompt": "q1", "answer": "7"}, {"prompt": "q2", "answer": "skip 5"}]
    inputs += [{"prompt": "q3", "answer": "#### 1,200"}]
    prompts, completions = [x["prompt"] for x in inputs], ["7", "8 then 9", "so 1200"]
    ids = [[3, 4], [5], [6, 7, 8, 9, 10]]
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device="cpu", is_main_process=True),
        reward_funcs=funcs,
        reward_processing_classes=[None] * 3,
        reward_func_names=[f.__name__ for f in funcs],
        state=types.SimpleNamespace(global_step=0),
        args=types.SimpleNamespace(report_to=[]),
        _log_completion_extra=None,
        _log_metric=None,
        environments=None,
    )
    per_trl = trl.GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, ids)
    total_trl = (per_trl * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    rs = rewards.parse_rewards(funcs, weights)
    total, per = rs(prompts, completions, {"answer": [x["answer"] for x in inputs]}, ids)
    np.testing.assert_array_equal(np.stack([per[n] for n in rs.names], 1), per_trl.numpy())
    np.testing.assert_allclose(total, total_trl.numpy(), rtol=1e-7, atol=0)


def test_async_functions_are_awaited_and_columns_checked_up_front():
    async def judge(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    rs = rewards.parse_rewards([judge, "answer_match=solution"])
    total, _ = rs(["p"], ["12"], {"solution": ("12",)})  # a tuple column arrives as a list
    np.testing.assert_array_equal(total, [3.0])
    rs.check_columns(["solution", "level"])
    with pytest.raises(
        RewardError, match="'answer_match' needs the column 'solution', which p.jsonl"
    ) as e:
        rs.check_columns(["answer"], where="p.jsonl")
    _one_line(e, "answer")


def test_builtins_are_the_public_functions_and_need_no_jax():
    assert rewards.BUILTINS == {
        "answer_match": rewards.answer_match,
        "format_match": rewards.format_match,
        "length_penalty": rewards.length_penalty,
    }
    code = (
        "import sys, jmem.rewards, jmem._src.finetune.prompt_data; "
        "assert 'jax' not in sys.modules, 'jax'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
