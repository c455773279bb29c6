"""``jmem finetune --objective grpo``: the flags and their one-line refusals (a group needs
two completions, the batch whole groups, one weight per reward, a reward at all), and the
options in a config file and Python."""

import helpers
import pytest

from jmem import finetune
from jmem._src.cli import CliError
from jmem._src.finetune.config_file import parse_args

GRPO = ["--objective", "grpo", "--reward", "examples/grpo_rewards.py:letter_share"]

BAD_FLAGS = {
    "one generation": (GRPO + ["--num-generations", "1"], ["--num-generations", ">= 2"]),
    "batch not whole groups": (
        GRPO + ["--num-generations", "4", "--batch-size", "6"],
        ["--batch-size 6", "multiple of --num-generations 4"],
    ),
    "generation batch": (
        GRPO + ["--num-generations", "2", "--batch-size", "8", "--generation-batch", "3"],
        ["--generation-batch 3", "divide --batch-size 8"],
    ),
    "no reward": (["--objective", "grpo"], ["--objective grpo needs a reward", "--reward"]),
    "weights": (GRPO + ["--reward-weights", "1,2"], ["2 weights for 1 --reward"]),
    "weight not a number": (GRPO + ["--reward-weights", "x"], ["--reward-weights", "'x'"]),
    "grpo option with sft": (["--epsilon", "0.3"], ["--epsilon", "--objective grpo", "not sft"]),
    "reward with dpo": (
        ["--objective", "dpo", "--reward", "a:b"],
        ["--reward", "--objective grpo", "not dpo"],
    ),
    "dpo loss with grpo": (GRPO + ["--loss-type", "ipo"], ["--loss-type ipo", "dapo"]),
    "grpo loss with dpo": (["--objective", "dpo", "--loss-type", "dapo"], ["sigmoid, ipo"]),
    "seq-len": (GRPO + ["--seq-len", "64"], ["--seq-len", "--max-prompt-len"]),
    "top-p": (GRPO + ["--top-p", "0"], ["--top-p", "(0, 1]"]),
    "temperature": (GRPO + ["--temperature", "0"], ["--temperature", "positive"]),
    "scale": (GRPO + ["--scale-rewards", "std"], ["--scale-rewards", "group"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_grpo_flags_are_one_line(capsys, case):
    argv, words = BAD_FLAGS[case]
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    helpers.one_line_error(capsys, e, *words)


def test_grpo_flags_parse_with_trl_defaults():
    c = parse_args(GRPO + ["--reward", "len", "--reward-weights", "1,0.5", "--batch-size", "8"])
    g = c.grpo
    assert g.reward == ("examples/grpo_rewards.py:letter_share", "len")
    assert g.reward_weights == (1.0, 0.5)
    # TRL's GRPOConfig: num_generations 8, epsilon 0.2, scale_rewards group, mu 1
    assert (g.num_generations, g.epsilon, g.epsilon_high, g.num_iterations) == (8, 0.2, None, 1)
    assert (g.temperature, g.top_p, g.top_k, g.scale_rewards) == (1.0, 1.0, 0, "group")
    assert (g.max_prompt_len, g.max_completion_len) == (512, 256)
    assert c.training.beta is None and c.training.loss_type is None  # resolved by the job
    assert finetune.FinetuneConfig.from_flat(**c.flat()) == c


def test_grpo_defaults_resolve_to_trl(tmp_path):
    from jmem._src.finetune.setup import resolve_defaults
    from jmem.models import llama

    c = finetune.FinetuneConfig.from_flat(config="tiny", objective="grpo", reward=["len"])
    c, _ = resolve_defaults(c, llama.get_config("tiny"), on_gpu=False)
    assert (c.training.beta, c.training.loss_type) == (0.0, "dapo")
    c = finetune.FinetuneConfig.from_flat(config="tiny", objective="dpo")
    c, _ = resolve_defaults(c, llama.get_config("tiny"), on_gpu=False)
    assert (c.training.beta, c.training.loss_type) == (0.1, "sigmoid")


def test_grpo_options_in_a_config_file_and_python(tmp_path):
    (tmp_path / "f.yaml").write_text(
        "training: {objective: grpo, beta: 0.04, loss_type: dr_grpo}\n"
        "grpo: {reward: [a.py:f, len], reward_weights: [2, 1], num_generations: 4,\n"
        "       epsilon_high: 0.28, num_iterations: 2}\n"
    )
    c = parse_args(["--config-file", str(tmp_path / "f.yaml")])
    assert (c.training.beta, c.training.loss_type) == (0.04, "dr_grpo")
    assert c.grpo.reward == ("a.py:f", "len") and c.grpo.reward_weights == (2.0, 1.0)
    assert (c.grpo.num_generations, c.grpo.epsilon_high, c.grpo.num_iterations) == (4, 0.28, 2)
    c = parse_args(
        [
            "--config-file",
            str(tmp_path / "f.yaml"),
            "--reward",
            "b:g",
            "--reward",
            "len",
            "--reward-weights",
            "1,1",
        ]
    )
    assert c.grpo.reward == ("b:g", "len")  # the flags replace the file's list
    with pytest.raises(CliError, match="--reward-weights|reward_weights"):
        finetune.FinetuneConfig.from_flat(objective="grpo", reward=["a:f"], reward_weights=[1, 2])
    # a dry run plans without a reward
    c = finetune.FinetuneConfig.from_flat(objective="grpo", dry_run=True)
    assert c.grpo.reward == ()
