"""Dot FLOPs counted from the compiled HLO (``jmem._src.hlo_flops``) and the dry run's
compute line: loops counted by trip count, the ratio to the model's minimum."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import finetune
from jmem._src.hlo_flops import dot_flops


def test_dot_flops_count_a_scan_body_once_per_trip():
    """A scan of 6 ``[64, 128] @ [128, 32]`` matmuls is 6 * 2 * 64 * 128 * 32 FLOPs, where
    XLA's ``cost_analysis`` counts the loop body once."""

    def f(x, ws):
        def body(c, w):
            return c, c @ w

        return jax.lax.scan(body, x, ws)[1]

    x, ws = jnp.ones((64, 128)), jnp.ones((6, 128, 32))
    compiled = jax.jit(f).lower(x, ws).compile()
    assert dot_flops(compiled.as_text()) == 6 * 2 * 64 * 128 * 32
    once = compiled.cost_analysis()
    once = once[0] if isinstance(once, list) else once
    assert once["flops"] < 2 * 2 * 64 * 128 * 32


def test_dot_flops_refuse_a_loop_of_unknown_length():
    def f(x):
        return jax.lax.while_loop(lambda c: c[0, 0] < 100.0, lambda c: c @ c, x)

    text = jax.jit(f).lower(jnp.ones((8, 8))).compile().as_text()
    with pytest.raises(ValueError, match="known trip count"):
        dot_flops(text)


@pytest.mark.slow
def test_the_dry_run_reports_compiled_dot_flops_and_their_ratio(tmp_path):
    """The job's dry run prints and records the step's dot FLOPs: at least the minimum
    (forward + input gradients, 4 N T), and full remat's recomputed forward above none's."""
    records = {}
    for remat in ("none", "full"):
        out = tmp_path / remat
        argv = ["--config", "tiny", "--dry-run", "--seq-len", "256", "--batch-size", "1"]
        finetune.main(argv + ["--remat", remat, "--token-chunk", "0", "--out", str(out)])
        records[remat] = json.loads((out / "dry_run.json").read_text())["compute"]
    none, full = records["none"], records["full"]
    np.testing.assert_allclose(none["dot_flops"], none["ratio"] * none["minimum_flops"])
    assert 1.0 <= none["ratio"] < 2.0, none
    np.testing.assert_allclose(none["minimum_flops"], full["minimum_flops"])
    assert full["dot_flops"] > 1.1 * none["dot_flops"], records


def test_a_loop_of_unknown_length_is_reported_as_not_counted():
    """``flops=True`` on a program whose loop length is unknown: ``dot_flops`` None, and the
    dry run's compute line says why instead of a figure."""
    from jmem._src.finetune.dry_run import compute_line
    from jmem._src.finetune.dry_run import compute_record
    from jmem._src.measure import report_from_compiled
    from jmem.models import llama

    def f(x):
        return jax.lax.while_loop(lambda c: c[0, 0] < 100.0, lambda c: c @ c, x)

    report = report_from_compiled(jax.jit(f).lower(jnp.ones((8, 8))).compile(), flops=True)
    assert report.dot_flops is None
    batch = {"inputs": jax.ShapeDtypeStruct((1, 16), jnp.int32)}
    c = compute_record(None, llama.get_config("tiny"), batch, 1, "h100_sxm", full=False)
    assert c["ratio"] is None and c["seconds_bound"] is None
    assert "not counted" in compute_line(c) and "unknown trip count" in compute_line(c)


@pytest.mark.slow
def test_the_minimum_of_a_mixture_of_experts_counts_the_routed_experts_only(tmp_path):
    """On ``tiny_moe`` (k of E experts per token) the minimum is ``4 N T`` with ``N`` the
    parameters a token's matmuls use, so the compiled step is at least that minimum (over
    all E experts' weights the minimum was 1.5x the compile). The upper bound is looser than
    the dense model's 2x: at tiny_moe's sizes the grouped matmul's row tiles pad 512 routed
    rows by up to one tile per expert (2.03x measured)."""
    from jmem.models import llama

    out = tmp_path / "moe"
    argv = ["--config", "tiny_moe", "--dry-run", "--seq-len", "256", "--batch-size", "1"]
    finetune.main(argv + ["--remat", "none", "--token-chunk", "0", "--out", str(out)])
    c = json.loads((out / "dry_run.json").read_text())["compute"]
    cfg = llama.get_config("tiny_moe")
    assert cfg.num_experts > cfg.num_experts_per_tok, cfg
    assert 1.0 <= c["ratio"] < 2.5, c
