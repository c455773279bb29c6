"""The benchmark scripts run end to end on a tiny shape and write their JSON (a script
that crashes after an hour of timing loses the hour)."""

import json
import os

import pytest

from tests.helpers import load_benchmark

ROOT = os.path.join(os.path.dirname(__file__), "..")


_load = load_benchmark


@pytest.mark.slow
def test_long_context_writes_its_rows(tmp_path):
    out = tmp_path / "long_context.json"
    _load("long_context").main(
        [
            "--config",
            "tiny",
            "--seqs",
            "128",
            "--time-max-seq",
            "128",
            "--reps",
            "1",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    rows = {r["contender"]: r for r in result["rows"]}
    assert set(rows) == {"dense", "long"}
    for row in rows.values():
        assert row["seq_len"] == 128
        assert row["peak_bytes"] >= row["temp_bytes"] > 0
        assert row["step_seconds"] > 0
    assert set(result["levers"]) == {"dense", "long"}
    assert len(result["load_avg_at_start"]) == 3


@pytest.mark.slow
def test_grpo_throughput_writes_both_phases(tmp_path):
    out = tmp_path / "grpo_throughput.json"
    flags = ["--steps", "2", "--out", str(out), "--config", "tiny", "--data"]
    flags += [os.path.join(ROOT, "examples", "grpo_letters.jsonl"), "--reward"]
    flags += [os.path.join(ROOT, "examples", "grpo_rewards.py") + ":lowercase_share"]
    flags += ["--batch-size", "4", "--num-generations", "2", "--max-prompt-len", "32"]
    _load("grpo_throughput").main(flags + ["--max-completion-len", "8"])
    result = json.loads(out.read_text())
    assert result["steps_timed"] == 1 and result["commit"] and result["date"]
    assert result["generation_tokens_per_s"] > 0 and result["train_tokens_per_s"] > 0


@pytest.mark.slow
def test_context_parallel_writes_its_rows(tmp_path):
    """One dry run on a context=4 mesh of CPU devices (tests/conftest.py's XLA_FLAGS reach
    the subprocess): its row has the compiled peak and the strategy's collective."""
    out = tmp_path / "context_parallel.json"
    argv = ["--config", "tiny", "--target", "", "--context", "4", "--seq-lens", "256"]
    argv += ["--remats", "full", "--strategies", "all_gather", "--out", str(out)]
    _load("context_parallel").main(argv)
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row, row
    assert row["peak_bytes"] > 0 and row["collective_bytes"]["all-gather"] > 0, row
