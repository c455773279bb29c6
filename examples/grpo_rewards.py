"""A reward for the GRPO toy task of the README: the share of lowercase ASCII letters in
each completion (0 to 1), a TRL-style reward function
(``--reward examples/grpo_rewards.py:lowercase_share``). A model from random init
(``--config tiny``, byte tokens: about 26 in 256 draws are lowercase letters) learns
within tens of steps to write more of them."""

import string


def lowercase_share(prompts, completions, **kwargs):
    """The share of lowercase ASCII letters among each completion's characters (0 for an
    empty completion)."""
    del prompts, kwargs
    share = lambda t: sum(c in string.ascii_lowercase for c in t) / len(t) if t else 0.0
    return [share(text) for text in completions]
