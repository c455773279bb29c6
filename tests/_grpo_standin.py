"""Throwaway stand-in for jmem._src.rewards and jmem._src.finetune.prompt_data until their
branch is merged (installed into sys.modules only when the real modules are missing)."""

import dataclasses
import importlib.util
import json
import sys
import types

import numpy as np


def install():
    try:
        import jmem._src.finetune.prompt_data  # noqa: F401
        import jmem._src.rewards  # noqa: F401

        return
    except ImportError:
        pass
    rewards = types.ModuleType("jmem._src.rewards")

    class RewardError(ValueError):
        pass

    @dataclasses.dataclass
    class RewardSet:
        names: tuple
        weights: tuple
        functions: tuple
        required_columns: tuple = ()

        def __call__(self, prompts, completions, columns):
            per = {}
            for n, f in zip(self.names, self.functions):
                try:
                    v = f(prompts=prompts, completions=completions, **columns)
                except Exception as e:
                    raise RewardError(f"reward {n} raised {type(e).__name__}: {e}") from e
                v = np.asarray(v, np.float32)
                if v.shape != (len(completions),) or not np.all(np.isfinite(v)):
                    raise RewardError(f"reward {n} returned a bad value")
                per[n] = v
            total = sum(w * per[n] for n, w in zip(self.names, self.weights))
            return np.asarray(total, np.float32), per

    def parse_rewards(specs, weights=None, *, max_completion_length=None):
        fns = []
        for spec in specs:
            path, name = spec.rsplit(":", 1)
            s = importlib.util.spec_from_file_location("_reward_" + name, path)
            m = importlib.util.module_from_spec(s)
            s.loader.exec_module(m)
            fns.append(getattr(m, name))
        names = tuple(spec.rsplit(":", 1)[1] for spec in specs)
        return RewardSet(names, tuple(weights or [1.0] * len(specs)), tuple(fns))

    rewards.RewardError, rewards.RewardSet, rewards.parse_rewards = (
        RewardError,
        RewardSet,
        parse_rewards,
    )
    prompt_data = types.ModuleType("jmem._src.finetune.prompt_data")

    @dataclasses.dataclass
    class PromptRecord:
        text: str
        ids: tuple
        columns: dict

    def read_prompts(path, tokenizer, *, max_prompt_len, max_prompt_len_name="max_prompt_len"):
        out = []
        for line in open(path):
            row = json.loads(line)
            text = row.pop("prompt")
            ids = tuple(int(i) for i in tokenizer.encode(text))[-max_prompt_len:]
            out.append(PromptRecord(text, ids, row))
        return out, []

    prompt_data.PromptRecord, prompt_data.read_prompts = PromptRecord, read_prompts
    sys.modules["jmem._src.rewards"] = rewards
    sys.modules["jmem._src.finetune.prompt_data"] = prompt_data
