"""Reward functions for GRPO (``jmem finetune --objective grpo``) with TRL's signature
``f(prompts, completions, **columns) -> list[float | None]``: ``parse_rewards`` loads
``--reward`` specs into a ``RewardSet`` (weighted sum, checked results); the built-ins
``answer_match``, ``format_match`` and ``length_penalty`` are plain functions to compose."""

from jmem._src.rewards import BUILTINS
from jmem._src.rewards import THINK_ANSWER_FORMAT
from jmem._src.rewards import RewardError
from jmem._src.rewards import RewardSet
from jmem._src.rewards import answer_match
from jmem._src.rewards import final_number
from jmem._src.rewards import format_match
from jmem._src.rewards import length_penalty
from jmem._src.rewards import parse_rewards

__all__ = (
    "BUILTINS",
    "THINK_ANSWER_FORMAT",
    "RewardError",
    "RewardSet",
    "answer_match",
    "final_number",
    "format_match",
    "length_penalty",
    "parse_rewards",
)
