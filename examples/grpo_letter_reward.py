"""The reward of the GRPO toy task (``examples/grpo_letters.jsonl``): the share of the
letter "e" in a completion, so that a policy learns to write e's. TRL's reward signature;
pass it as ``--reward examples/grpo_letter_reward.py:letter_share``."""

LETTER = "e"


def letter_share(prompts, completions, **kwargs):
    """The share of characters of each completion that are ``LETTER`` (either case): a float
    in [0, 1] per completion, 0.0 for an empty one."""
    return [
        sum(c.lower() == LETTER for c in text) / len(text) if text else 0.0 for text in completions
    ]
