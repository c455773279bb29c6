"""llama.rollout: G completions per left-padded prompt; greedy equals generate on the unpadded
prompts; the completion mask ends at the EOS (included) and padding follows; log-probs are
the sampling policy's; top-k restricts the draws; micro-batches change nothing and compile
once per shape; NF4 + adapters run through the implicit rules (equal to the merged model)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import lora
from jmem import qlora
from jmem.models import llama
from jmem.models.llama import generation

CFG = llama.get_config("tiny", num_layers=2)
G, T = 2, 6


@pytest.fixture(scope="module")
def params():
    return llama.init(jax.random.key(0), CFG)


def _ragged_prompts(lengths=(7, 4, 5), width=7, seed=2):
    """Left-padded prompts ``[P, width]`` (padding holds junk ids) and their masks."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, CFG.vocab_size, size=(len(lengths), width)).astype(np.int32)
    mask = (np.arange(width)[None] >= width - np.asarray(lengths)[:, None]).astype(np.int32)
    return tokens, mask


def _logps_by_forward(params, prompt, completion, temperature=1.0):
    """Per-token log-probs ``[1, T]`` of ``completion`` after ``prompt`` (unpadded rows)."""
    seq = jnp.concatenate([prompt, completion], axis=1)
    logits = llama.forward(params, seq, CFG)[:, prompt.shape[1] - 1 : -1] / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, completion[..., None], axis=-1)[..., 0]


@pytest.mark.slow
def test_greedy_rollout_without_padding_equals_generate(params):
    tokens = np.random.default_rng(3).integers(1, CFG.vocab_size, size=(2, 5)).astype(np.int32)
    ro = llama.rollout(
        params,
        tokens,
        np.ones_like(tokens),
        CFG,
        num_generations=G,
        max_new_tokens=T,
        temperature=0.0,
    )
    want = llama.generate(params, jnp.asarray(tokens), CFG, max_new_tokens=T)[:, 5:]
    np.testing.assert_array_equal(ro.completion_ids, np.repeat(want, G, axis=0))
    np.testing.assert_array_equal(ro.prompt_ids, np.repeat(tokens, G, axis=0))


@pytest.mark.slow
def test_greedy_rollout_of_left_padded_prompts_equals_generate_per_prompt(params):
    tokens, mask = _ragged_prompts()
    ro = llama.rollout(
        params, tokens, mask, CFG, num_generations=G, max_new_tokens=T, temperature=0.0
    )
    chex.assert_shape([ro.completion_ids, ro.completion_mask, ro.logps], (len(tokens) * G, T))
    chex.assert_type(
        [ro.completion_ids, ro.completion_mask, ro.logps], [jnp.int32, jnp.int32, jnp.float32]
    )
    assert np.all(np.asarray(ro.completion_mask) == 1)  # no EOS: every token is real
    for i, row in enumerate(tokens):
        prompt = jnp.asarray(row[mask[i] > 0][None])
        want = llama.generate(params, prompt, CFG, max_new_tokens=T)[:, prompt.shape[1] :]
        for g in range(G):
            r = i * G + g
            np.testing.assert_array_equal(ro.completion_ids[r : r + 1], want)
            np.testing.assert_array_equal(ro.prompt_mask[r], mask[i])
            chex.assert_trees_all_close(
                ro.logps[r : r + 1], _logps_by_forward(params, prompt, want), atol=2e-5
            )


@pytest.mark.slow
def test_completion_mask_ends_at_eos_and_padding_follows(params):
    tokens, mask = _ragged_prompts()
    greedy = llama.rollout(
        params, tokens, mask, CFG, num_generations=1, max_new_tokens=T, temperature=0.0
    )
    eos = int(greedy.completion_ids[0, 2])  # row 0 stops at its third token
    ro = llama.rollout(
        params,
        tokens,
        mask,
        CFG,
        num_generations=1,
        max_new_tokens=T,
        temperature=0.0,
        eos_token_id=eos,
        pad_token_id=0,
    )
    ids, m, lp = (np.asarray(x) for x in (ro.completion_ids, ro.completion_mask, ro.logps))
    for r in range(len(tokens)):
        hits = np.flatnonzero(np.asarray(greedy.completion_ids[r]) == eos)
        n = T if hits.size == 0 else hits[0] + 1  # real tokens, the EOS included
        np.testing.assert_array_equal(m[r], np.arange(T) < n)
        np.testing.assert_array_equal(ids[r, :n], np.asarray(greedy.completion_ids[r, :n]))
        assert np.all(ids[r, n:] == 0) and np.all(lp[r, n:] == 0)
    assert m[0].sum() == 3


def _sampled(params, generation_batch, **kw):
    tokens, mask = _ragged_prompts()
    kw = {"temperature": 1.0, "top_p": 0.9, "key": jax.random.key(7), **kw}
    return llama.rollout(
        params,
        tokens,
        mask,
        CFG,
        num_generations=G,
        max_new_tokens=T,
        generation_batch=generation_batch,
        **kw,
    )


def _same(a, b):
    """The same tokens and masks; log-probs within float32 rounding (XLA may order a
    micro-batch's sums differently)."""
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    chex.assert_trees_all_close(a.logps, b.logps, atol=1e-5)


@pytest.mark.slow
def test_micro_batches_equal_one_batch_and_compile_once_per_shape(params):
    generation._rollout_chunk.clear_cache()
    whole = _sampled(params, None, top_k=20)
    assert generation._rollout_chunk._cache_size() == 1
    halves = _sampled(params, 3, top_k=20)
    again = _sampled(params, 3, top_k=20, key=jax.random.key(8))
    assert generation._rollout_chunk._cache_size() == 2  # one program per micro-batch shape
    _same(whole, halves)
    assert not np.array_equal(halves.completion_ids, again.completion_ids)
    greedy = [_sampled(params, gb, temperature=0.0) for gb in (None, 2)]
    _same(*greedy)
    assert generation._rollout_chunk._cache_size() == 4


@pytest.mark.slow
def test_sampling_log_probs_and_top_k(params):
    tokens, mask = _ragged_prompts()
    ro = _sampled(params, None, top_k=3, top_p=1.0, temperature=0.7)
    # the G completions of a prompt differ (sampling) but start from the same prompt
    assert not np.array_equal(ro.completion_ids[0], ro.completion_ids[1])
    for r in range(ro.completion_ids.shape[0]):
        i = r // G
        prompt = jnp.asarray(tokens[i][mask[i] > 0][None])
        completion = ro.completion_ids[r : r + 1]
        seq = jnp.concatenate([prompt, completion], axis=1)
        logits = llama.forward(params, seq, CFG)[0, prompt.shape[1] - 1 : -1]
        top3 = np.asarray(jax.lax.top_k(logits, 3)[1])
        assert all(t in top3[j] for j, t in enumerate(np.asarray(completion[0])))
        want = _logps_by_forward(params, prompt, completion, temperature=0.7)
        chex.assert_trees_all_close(ro.logps[r : r + 1], want, atol=2e-5)
    # top_k=1 is greedy at any temperature
    top1 = _sampled(params, None, top_k=1, top_p=1.0)
    greedy = _sampled(params, None, temperature=0.0)
    chex.assert_trees_all_equal(top1.completion_ids, greedy.completion_ids)


@pytest.mark.slow
def test_rollout_on_nf4_base_with_adapters_equals_the_merged_model(params):
    q = qlora.quantize_params(params)
    ad = lora.init(jax.random.key(1), q, rank=4, targets=".*(q_proj|v_proj|down_proj).*")
    ad = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), ad)
    merged = lora.merge(qlora.dequantize_params(q), ad)
    tokens, mask = _ragged_prompts()
    kw = dict(num_generations=1, max_new_tokens=T, temperature=0.0)
    got = llama.rollout(q, tokens, mask, CFG, adapters=ad, apply=qlora.apply, **kw)
    want = llama.rollout(merged, tokens, mask, CFG, **kw)
    chex.assert_trees_all_equal(got.completion_ids, want.completion_ids)
    chex.assert_trees_all_close(got.logps, want.logps, atol=1e-4)
    base = llama.rollout(qlora.dequantize_params(q), tokens, mask, CFG, **kw)
    assert not np.array_equal(base.completion_ids, want.completion_ids)  # adapters matter


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"generation_batch": 4}, "divide"),
        ({"temperature": 1.0}, "key"),
        ({"top_k": -1}, "top_k"),
        ({"prompt_mask": np.asarray([[1, 1, 0]], np.int32)}, "left-padded"),
        ({"adapters": {}}, "apply"),
    ],
)
def test_bad_input_is_named(params, kw, match):
    args = {"prompt_mask": np.ones((1, 3), np.int32), "temperature": 0.0, **kw}
    mask = args.pop("prompt_mask")
    with pytest.raises(ValueError, match=match):
        llama.rollout(
            params,
            np.ones((1, 3), np.int32),
            mask,
            CFG,
            num_generations=3,
            max_new_tokens=2,
            **args,
        )
