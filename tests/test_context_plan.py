"""The planner per device of a context mesh (``jmem._src.planner.context``) against the
XLA:GPU compiles for h100_sxm of ``benchmarks/context_parallel.py``, and the resolver's
``context_strategy="auto"`` rule."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import jmem
from jmem import planner
from jmem._src.levers import resolve
from jmem._src.planner import context as cp
from jmem.models import llama

_DIR = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
RESULTS = os.path.join(_DIR, "context_parallel_h100.json")
#: 2M-8M tokens, ``--remat offload_inputs``, each strategy at 2M and 4M, ulysses beyond
LONGEST = os.path.join(_DIR, "context_parallel_longest_h100.json")


def _rows(path=RESULTS):
    with open(path) as f:
        return json.load(f)["rows"]


def _all_rows():
    return _rows() + _rows(LONGEST)


def _planned_peak(cfg, remat: str, strategy: str, seq: int, context: int) -> int:
    """The dry run's planner per device: S / C tokens, params replicated over context,
    plus attention's buffers for the strategy."""
    levers = jmem.Levers(remat=remat, attention="blockwise", token_chunk=2048, loss_chunk=2048)
    est = planner.estimate(
        cfg,
        param_dtype="bfloat16",
        optimizer="adamw_8bit",  # the job's default
        lora={"rank": 32, "targets": "all"},
        quantization="nf4",
        levers=levers,
        batch_size=1,
        seq_len=seq // context,
        target="h100_sxm",
    )
    return est.total + cp.attention_bytes(cfg, seq, context, strategy)


@pytest.mark.parametrize("row", range(len(_all_rows())))
def test_planner_within_10_percent_of_the_compiled_peak_per_device(row):
    """llama3_1_8b, QLoRA r=32 over context=8: 1M tokens under remat full and
    offload_inputs, and 2M-8M tokens under offload_inputs (each strategy at 2M and 4M):
    the planner's device peak within 10% of the compile's (observed -9.8% to +9.6%, the
    ring's at the edges; Ulysses within 3%), and the stored planner column is the
    planner's."""
    r = _all_rows()[row]
    cfg = llama.get_config("llama3_1_8b")
    planned = _planned_peak(cfg, r["remat"], r["strategy"], r["seq_len"], 8)
    msg = f"{r['remat']} {r['strategy']} {r['seq_len']}"
    np.testing.assert_allclose(planned, r["peak_bytes"], rtol=0.10, err_msg=msg)
    assert planned == r["planner_per_device_bytes"], msg


@pytest.mark.parametrize("row", range(len(_all_rows())))
def test_planned_attention_collectives_within_10_percent_of_the_compiled(row):
    r = _all_rows()[row]
    cfg = llama.get_config("llama3_1_8b")
    planned = cp.collective_bytes(cfg, r["seq_len"], 8, r["strategy"], passes=2)
    for kind, nbytes in planned.items():
        np.testing.assert_allclose(nbytes, r["collective_bytes"][kind], rtol=0.10, err_msg=kind)


def test_auto_picks_ulysses_for_a_long_sequence_whose_heads_divide_the_axis():
    cfg = llama.get_config("llama3_1_8b")  # 32 query heads, 8 KV heads
    batch = {"inputs": jnp.zeros((1, 1 << 20), jnp.int32)}
    lv = resolve(jmem.Levers(context_strategy="auto"), cfg, batch, "h100_sxm", context=8)
    assert lv.context_strategy == "ulysses"
    assert "multiples of 8" in dict(lv.reasons)["context_strategy"]
    short = {"inputs": jnp.zeros((1, 4096), jnp.int32)}
    lv = resolve(jmem.Levers(context_strategy="auto"), cfg, short, "h100_sxm", context=8)
    assert lv.context_strategy == "all_gather"
    assert "4096 tokens < 65536" in dict(lv.reasons)["context_strategy"]
    lv = resolve(jmem.Levers(context_strategy="auto"), cfg, batch, "h100_sxm", context=16)
    assert lv.context_strategy == "all_gather"  # 8 KV heads over 16 devices
    assert "not both multiples of 16" in dict(lv.reasons)["context_strategy"]


def test_unknown_strategy_names_the_choices():
    with pytest.raises(ValueError, match="or 'auto'"):
        jmem.Levers(context_strategy="zigzag")
    with pytest.raises(ValueError, match="unknown"):
        cp.attention_bytes(llama.get_config("tiny"), 256, 4, "zigzag")
