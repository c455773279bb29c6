"""jmem.Levers: the execution settings as one frozen value, resolved in one place for a
model, a batch and a compile target; the model config holds identity only."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import small_config
from helpers import token_batch

import jmem
from jmem import planner
from jmem.models import llama


def test_model_config_holds_identity_only():
    fields = {f.name for f in dataclasses.fields(llama.LlamaConfig)}
    assert not fields & {"attention", "loss_chunk", "mlp_chunk", "scan_unroll", "remat", "fp8"}
    with pytest.raises(ValueError, match=r"levers=jmem.Levers\(token_chunk=...\)"):
        llama.get_config("tiny", mlp_chunk=64)


def test_levers_are_frozen_hashable_and_checked():
    lv = jmem.Levers(remat="full", token_chunk=64)
    assert hash(lv) == hash(jmem.Levers(remat="full", token_chunk=64))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lv.remat = "none"
    for bad in (dict(remat="most"), dict(attention="flash"), dict(loss_chunk=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            jmem.Levers(**bad)
    with pytest.raises(ValueError, match="scan_unroll"):
        jmem.Levers(scan_unroll=0)


def test_every_choice_has_a_reason():
    cfg = llama.get_config("tiny")
    lv = jmem.resolve_levers(jmem.Levers(remat="full"), cfg, (2, 4096), "cpu")
    assert [k for k, _ in lv.reasons] == [
        "remat", "attention", "loss_chunk", "token_chunk", "scan_unroll", "fp8",
        "offload_params",
    ]  # fmt: skip
    assert lv.attention == "blockwise" and "4096 keys > 1024" in lv.reason("attention")
    assert lv.scan_unroll == 1
    text = lv.describe()
    assert (
        all(k in text for k, _ in lv.reasons) and lv.as_dict()["attention"]["value"] == "blockwise"
    )


def test_auto_attention_resolves_for_the_target_not_the_running_machine():
    """On this CPU machine, a GPU target gets cuDNN (bf16, head dim 32); a float32 step or
    a soft-capped family (Gemma 2) falls back with the reason."""
    cfg = llama.get_config("tiny")
    assert jmem.resolve_levers(None, cfg, (1, 4096), "gpu").attention == "cudnn"
    assert jmem.resolve_levers(None, cfg, (1, 512), "cpu").attention == "dense"
    f32 = jmem.resolve_levers(None, cfg, (1, 4096), "gpu", dtype=jnp.float32)
    assert f32.attention == "blockwise" and "bfloat16" in f32.reason("attention")
    gemma = llama.get_config("gemma2_2b")
    capped = jmem.resolve_levers(None, gemma, (1, 4096), "gpu")
    assert capped.attention == "blockwise" and "head dim" in capped.reason("attention")
    packed = {
        "inputs": jax.ShapeDtypeStruct((1, 4096), jnp.int32),
        "segment_ids": jax.ShapeDtypeStruct((1, 4096), jnp.int32),
    }
    assert jmem.resolve_levers(None, cfg, packed, "gpu").attention == "blockwise"


def test_fp8_keeps_token_chunks_with_a_reason_and_unroll_follows_remat():
    cfg = llama.get_config("tiny")
    lv = jmem.resolve_levers(jmem.Levers(fp8=True, remat="none"), cfg, (1, 4096))
    assert lv.token_chunk == 2048 and "FP8" in lv.reason("token_chunk")
    assert "max-reduced" in lv.reason("fp8")
    assert lv.scan_unroll is True and "inlined" in lv.reason("scan_unroll")
    assert jmem.resolve_levers(jmem.Levers(scan_unroll=2), cfg, (1, 8)).scan_unroll == 2


@pytest.mark.slow
def test_fp8_lever_is_refused_where_no_fp8_matmul_would_run():
    """``Levers(fp8=True)`` records a choice; FP8 runs under ``jmem.fp8.apply``. The model
    outside ``apply`` and ``train_step`` without metas, or with a loss that does not apply
    them, raise (they trained in the compute dtype, silently); the working forms trace
    (shapes only: nothing compiled) and hold FP8 values."""
    from jmem._src.train.fp8_check import has_fp8_values

    cfg = small_config()
    params = llama.init(jax.random.key(0), cfg, jnp.bfloat16)
    batch = token_batch(cfg, seq_len=16)
    metas = jmem.fp8.init_metas(params, llama.LINEAR_NAMES)
    lv = jmem.Levers(remat="full", fp8=True)
    assert "through jmem.fp8.apply" in jmem.resolve_levers(lv, cfg, batch).reason("fp8")
    with pytest.raises(ValueError, match="not under jmem.fp8.apply"):
        jax.eval_shape(lambda p: llama.loss_fn(p, batch, cfg, levers=lv), params)
    fp8_loss = jmem.fp8.apply(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv))
    assert has_fp8_values(jax.make_jaxpr(fp8_loss)(params, metas, batch).jaxpr)
    with pytest.raises(ValueError, match="not under jmem.fp8.apply"):  # apply, no metas
        jax.eval_shape(fp8_loss, params, None, batch)
    wrapped = lambda p, b, *, fp8: fp8_loss(p, fp8, b)
    plain = lambda p, b, *, fp8: llama.loss_fn(p, b, cfg, levers=jmem.Levers(remat="full"))
    for loss, with_metas, message in (
        (wrapped, False, "the state has no FP8 metas"),
        (plain, True, "the loss runs no FP8 matmul"),
    ):
        step = jmem.train_step(loss, optax.adam(1e-3), levers=lv, donate=False)
        state = step.abstract_state(params, fp8=metas if with_metas else None)
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(step.jitted, state, batch)
    step = jmem.train_step(wrapped, optax.adam(1e-3), levers=lv, donate=False)
    out, _ = jax.eval_shape(step.jitted, step.abstract_state(params, fp8=metas), batch)
    assert jax.tree.structure(out.fp8) == jax.tree.structure(metas)


@pytest.mark.slow
def test_offload_remat_turns_token_chunks_off_on_a_gpu_target_only():
    """XLA:GPU fails layout assignment for remat offload inside token-chunk loops
    (tests/test_gpu_compile.py compiles it): on a GPU target the resolver sets token
    chunks to 0 and says why; on the CPU, and for other policies, chunks stay."""
    cfg = llama.CONFIGS["tiny"]
    gpu = jmem.resolve_levers(jmem.Levers(remat="offload"), cfg, (1, 4096), "h100_sxm")
    assert gpu.token_chunk == 0 and "layout assignment" in dict(gpu.reasons)["token_chunk"]
    cpu = jmem.resolve_levers(jmem.Levers(remat="offload"), cfg, (1, 4096), "cpu")
    assert cpu.token_chunk == 2048
    full = jmem.resolve_levers(jmem.Levers(remat="full"), cfg, (1, 4096), "h100_sxm")
    assert full.token_chunk == 2048


@pytest.mark.slow
def test_loss_fn_reads_the_levers():
    """The same loss through every path the levers choose (float32, 1e-5), FP8 too
    (token chunks compose with it: the chunked FP8 loss is the unchunked one)."""
    cfg = small_config()
    params = llama.init(jax.random.key(0), cfg)
    batch = token_batch(cfg, seq_len=24)
    ref = llama.loss_fn(params, batch, cfg, levers=jmem.Levers(attention="dense", loss_chunk=0))
    for lv in (
        jmem.Levers(attention="blockwise", loss_chunk=8, token_chunk=16),
        jmem.resolve_levers(jmem.Levers(token_chunk=16), cfg, batch),
    ):
        chex.assert_trees_all_close(llama.loss_fn(params, batch, cfg, levers=lv), ref, rtol=1e-5)
    metas = jmem.fp8.init_metas(params, llama.LINEAR_NAMES)
    resolved = jmem.resolve_levers(jmem.Levers(token_chunk=16, fp8=True), cfg, batch)
    fp8_loss = jmem.fp8.apply(llama.loss_fn)
    chex.assert_trees_all_close(
        fp8_loss(params, metas, batch, cfg, levers=resolved),
        fp8_loss(params, metas, batch, cfg, levers=jmem.Levers(token_chunk=0)),
        rtol=1e-5,
    )


def test_train_step_applies_the_levers_remat():
    cfg = small_config()
    lv = jmem.Levers(remat="full")
    loss = lambda p, b: llama.loss_fn(p, b, cfg, levers=lv)
    step = jmem.train_step(loss, optax.sgd(0.1), levers=lv)
    assert step.levers is lv
    params = llama.init(jax.random.key(0), cfg)
    batch = token_batch(cfg, seq_len=16)
    jaxpr = jax.make_jaxpr(step.jitted)(step.init(params), batch)
    assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)
    with pytest.raises(ValueError, match="disagree"):
        jmem.train_step(loss, optax.sgd(0.1), levers=lv, remat="none")


def test_planner_resolves_the_same_levers():
    """The planner's long-context paths are the resolver's: a GPU target's cuDNN and the
    CPU's blockwise both hold no [S, T] scores; explicit dense does. A GPU target also
    takes XLA:GPU's activation terms (no float32 copies of bf16 temporaries: lower)."""
    cfg = llama.get_config("llama3_1_8b")
    kw = dict(seq_len=32768, lora=8, quantization="nf4")
    dense = planner.estimate(cfg, levers=jmem.Levers(remat="full", attention="dense"), **kw)
    cpu = planner.estimate(cfg, levers=jmem.Levers(remat="full"), target="cpu", **kw)
    gpu = planner.estimate(cfg, levers=jmem.Levers(remat="full"), target="gpu", **kw)
    assert gpu.activations < cpu.activations < dense.activations / 4
    lv = jmem.resolve_levers(jmem.Levers(remat="offload_inputs"), cfg, (1, 32768))
    assert planner.estimate(cfg, levers=lv, **kw).config["remat"] == "offload_inputs"


def test_remat_reason_says_where_a_policy_saves_little():
    """The remat reason names the programs where a policy saves little below another:
    ``dots``/``selective`` with token chunks (``none`` recomputes inside the chunks too),
    ``offload``/``offload_inputs`` on XLA:CPU (no separate host memory)."""
    cfg = llama.get_config("tiny")
    chunked = jmem.resolve_levers(jmem.Levers(remat="dots", token_chunk=1024), cfg, (1, 4096))
    assert "none included" in chunked.reason("remat")
    whole = jmem.resolve_levers(jmem.Levers(remat="dots", token_chunk=0), cfg, (1, 4096))
    assert whole.reason("remat") == "as given; recomputes no matmul in the backward pass"
    cpu = jmem.resolve_levers(jmem.Levers(remat="offload_inputs"), cfg, (1, 4096), "cpu")
    assert "no device memory below full" in cpu.reason("remat")
    gpu = jmem.resolve_levers(jmem.Levers(remat="offload_inputs"), cfg, (1, 4096), "h100_sxm")
    assert gpu.reason("remat").startswith("as given; recomputes q/k/v")
    assert "saves" not in gpu.reason("remat")


def test_remat_reason_states_its_recompute_cost():
    cfg = llama.get_config("llama3_1_8b")

    def why(remat, **kw):
        lv = jmem.Levers(remat=remat, **kw)
        return jmem.resolve_levers(lv, cfg, (1, 4096), "h100_sxm").reason("remat")

    assert "recomputes no matmul" in why("none", token_chunk=0)
    assert "recomputes no matmul" in why("dots", token_chunk=0)
    chunked = why("none")  # the default token chunks: the MLP is recomputed under none too
    assert "o_proj, the MLP's gate/up" in chunked and "token chunks (2048 tokens)" in chunked
    assert "q/k/v, o_proj, the MLP's gate/up" in why("full")
    share = lambda text: int(text.split("about +")[1].split("%")[0])  # noqa: E731
    assert 0 < share(chunked) < share(why("full")) < 50


def _dot_flops(cfg, tokens, remat, attention, token_chunk):
    """Compiled dot FLOPs of the gradient of ``loss_fn`` under ``jmem.remat(policy)``."""
    from jmem._src.hlo_flops import dot_flops

    lv = jmem.Levers(remat=remat, attention=attention, token_chunk=token_chunk)
    loss = lambda p: llama.loss_fn(p, {"inputs": tokens, "targets": tokens}, cfg, levers=lv)  # noqa: E731
    loss = loss if remat == "none" else jmem.remat(loss, remat)
    params = llama.abstract_params(cfg)
    return dot_flops(jax.jit(jax.grad(loss)).lower(params).compile().as_text())


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_recompute_cost_matches_the_compiled_dot_flops(attention):
    """The resolver's recompute share equals the compiled step's extra dot FLOPs over
    ``none`` without token chunks, divided by the model's minimum (tiny, 512 tokens)."""
    from jmem._src.recompute import _per_token
    from jmem._src.recompute import recompute_cost

    cfg, seq = llama.get_config("tiny"), 512
    tokens = jnp.zeros((1, seq), jnp.int32)
    per = _per_token(cfg, seq, attention)
    linear = per["qkv"] + per["o"] + per["gate_up"] + per["down"]
    minimum = (2 * linear + 3 * per["attention"]) * seq * cfg.num_layers
    base = _dot_flops(cfg, tokens, "none", attention, 0)
    for remat, chunk in [("none", 128), ("selective", 0), ("full", 0)]:
        measured = (_dot_flops(cfg, tokens, remat, attention, chunk) - base) / minimum
        share, _ = recompute_cost(remat, cfg, seq, token_chunked=bool(chunk), attention=attention)
        assert abs(measured - share) < 0.02, (remat, chunk, measured, share)
