"""A reward for tests/test_finetune_grpo.py: the share of "a" in a completion, that raises
on its N-th call after ``JMEM_TEST_REWARD_FAIL_AT=N:TAG`` is set (a run stopped by its
reward, then resumed without the variable)."""

import os

_calls: dict[str, int] = {}


def flaky_share(prompts, completions, **kwargs):
    key = os.environ.get("JMEM_TEST_REWARD_FAIL_AT")
    if key:
        _calls[key] = _calls.get(key, 0) + 1
        if _calls[key] == int(key.split(":")[0]):
            raise RuntimeError("the reward service is down")
    return [t.count("a") / len(t) if t else 0.0 for t in completions]
