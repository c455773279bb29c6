"""Mixture-of-experts families (Mixtral, Qwen3-MoE): routing, the load-balancing loss,
checkpoints both ways and greedy generation against transformers' own classes on tiny
random float32 checkpoints (the oracle); the compiled FLOPs of the routed experts are
those of k experts per token; the config and checkpoint refusals."""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import hlo_dot_flops

import jmem
from jmem import nf4
from jmem._src import moe
from jmem.models import hf
from jmem.models import llama

_TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

#: family -> (config class, model class, config overrides, expected jmem fields).
FAMILIES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            router_aux_loss_coef=0.02,
        ),
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            qk_norm="head",
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=None, norm_topk_prob=True),
    ),
}

TOKENS = np.random.default_rng(3).integers(3, 97, size=(2, 24))


def _small(**fields) -> llama.LlamaConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4)
    base.update(num_kv_heads=2, num_experts=4, num_experts_per_tok=2)
    return llama.LlamaConfig(**{**base, **fields})


# --- fast: the block itself, no oracle -------------------------------------------------


def test_routed_experts_equal_a_dense_loop_over_experts():
    """The sorted ragged_dot path equals running each token through its k experts."""
    rng = np.random.default_rng(0)
    t, h, f, e, k = 10, 8, 6, 5, 2
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(h, e)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(e, h, f)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(e, f, h)), jnp.float32)
    for norm in (True, False):
        out, probs = moe.routed_experts(x, router, wg, wu, wd, top_k=k, norm_topk_prob=norm)
        xn, g, u, d = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
        logits = xn @ np.asarray(router, np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(probs), p, rtol=1e-5)
        want = np.zeros((t, h))
        for i in range(t):
            top = np.argsort(-p[i])[:k]
            w = p[i, top] / (p[i, top].sum() if norm else 1.0)
            for j, ex in zip(top, w):
                gate = xn[i] @ g[j]
                want[i] += ex * (gate / (1 + np.exp(-gate)) * (xn[i] @ u[j])) @ d[j]
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_full_finetuning_gradients_reach_router_and_every_expert():
    cfg = _small()
    params = llama.init(jax.random.PRNGKey(0), cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 64)
    grads = jax.grad(llama.loss_fn)(params, {"inputs": tokens, "targets": tokens}, cfg)
    for name in llama.MOE_NAMES:
        g = np.asarray(grads["layers"][name]["kernel"])
        assert np.all(np.abs(g).sum(axis=tuple(range(1, g.ndim))) > 0), name  # every layer
    per_expert = np.abs(np.asarray(grads["layers"]["expert_down"]["kernel"])).sum(axis=(2, 3))
    assert np.all(per_expert > 0), per_expert  # 32 tokens, k=2 of 4: every expert gets some


@pytest.mark.slow
def test_loss_terms_add_the_weighted_aux_loss_and_token_chunks_agree():
    cfg = _small(router_aux_loss_coef=0.5)
    params = llama.init(jax.random.PRNGKey(0), cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 64)
    batch = {"inputs": tokens, "targets": tokens}
    terms = llama.loss_terms(params, batch, cfg)
    np.testing.assert_allclose(
        terms["loss"], terms["cross_entropy"] + 0.5 * terms["router_aux_loss"], rtol=1e-6
    )
    assert 1.0 < float(terms["router_aux_loss"]) < 4.0  # k=2: about k when balanced
    chunked = llama.loss_fn(params, batch, cfg, levers=jmem.Levers(token_chunk=8))
    np.testing.assert_allclose(chunked, terms["loss"], rtol=1e-5)


@pytest.mark.slow
def test_remat_and_greedy_rollout_run_the_routed_block():
    """The routed layer under a remat policy (the scan body returns router statistics)
    gives the plain gradients; a greedy ``rollout`` (KV cache, left-padded rows) decodes
    what ``generate`` decodes."""
    cfg = _small()
    params = llama.init(jax.random.PRNGKey(0), cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 3, 64)
    batch = {"inputs": tokens, "targets": tokens}
    plain = jax.grad(llama.loss_fn)(params, batch, cfg)
    remat = jax.grad(jmem.remat(llama.loss_fn, "selective"))(params, batch, cfg)
    chex_close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
    jax.tree.map(chex_close, remat, plain)
    want = llama.generate(params, tokens[:, :4], cfg, max_new_tokens=3)[:, 4:]
    out = llama.rollout(
        params, tokens[:, :4], jnp.ones((2, 4), jnp.int32), cfg, num_generations=1,
        max_new_tokens=3, temperature=0.0,
    )  # fmt: skip
    np.testing.assert_array_equal(out.completion_ids, want)


def test_config_refusals():
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be in 1..num_experts=4"):
        _small(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_experts must be >= 0"):
        _small(num_experts=-1)
    with pytest.raises(ValueError, match="fused_projections is not implemented"):
        _small(fused_projections=True)


# --- against transformers --------------------------------------------------------------


def _oracle():
    torch = pytest.importorskip("torch", reason="torch (CPU) is the oracle's runtime")
    transformers = pytest.importorskip(
        "transformers", reason="the families' classes are the oracle"
    )
    return torch, transformers


def save_family(path, family, **overrides):
    """A tiny random float32 checkpoint of ``family`` written by transformers'
    ``save_pretrained`` (router weights scaled up so that routing is decisive)."""
    torch, transformers = _oracle()
    config_cls, model_cls, extra, _ = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**{**_TINY, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    _oracle()
    root = tmp_path_factory.mktemp("moe")
    return {f: (str(root / f), save_family(root / f, f)) for f in FAMILIES}


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_aux_loss_match_transformers(checkpoints, family):
    torch, _ = _oracle()
    path, model = checkpoints[family]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    for field, value in FAMILIES[family][3].items():
        assert getattr(cfg, field) == value, (field, getattr(cfg, field))
    assert params["layers"]["expert_gate"]["kernel"].shape[:2] == (2, cfg.num_experts)
    with torch.no_grad():
        out = model(torch.tensor(TOKENS), output_router_logits=True)
    got = np.asarray(llama.forward(params, jnp.asarray(TOKENS, jnp.int32), cfg))
    assert _max_diff(got, out.logits.numpy()) <= 1e-4, _max_diff(got, out.logits.numpy())
    batch = {"inputs": jnp.asarray(TOKENS), "targets": jnp.asarray(TOKENS)}
    terms = llama.loss_terms(params, batch, cfg)
    np.testing.assert_allclose(float(terms["router_aux_loss"]), float(out.aux_loss), atol=1e-5)
    # transformers' training loss: shifted cross-entropy + coef * aux
    with torch.no_grad():
        labelled = model(
            torch.tensor(TOKENS), labels=torch.tensor(TOKENS), output_router_logits=True
        )
    shifted = {"inputs": batch["inputs"][:, :-1], "targets": batch["targets"][:, 1:]}
    ce = llama.loss_terms(params, shifted, cfg)["cross_entropy"]
    # the aux loss of the shifted batch differs (one token fewer): compare on the full one
    want = float(labelled.loss) - cfg.router_aux_loss_coef * float(labelled.aux_loss)
    np.testing.assert_allclose(float(ce), want, rtol=1e-5)
    assert cfg.router_aux_loss_coef == model.config.router_aux_loss_coef


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generation_matches_transformers(checkpoints, family):
    torch, _ = _oracle()
    path, model = checkpoints[family]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    prompt = TOKENS[:, :6]
    got = llama.generate(params, jnp.asarray(prompt, jnp.int32), cfg, max_new_tokens=8)
    with torch.no_grad():
        want = model.generate(
            torch.tensor(prompt), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got)[:, 6:], want.numpy()[:, 6:])


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_params_round_trip_loads_in_transformers(checkpoints, family, tmp_path):
    torch, transformers = _oracle()
    path, model = checkpoints[family]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    hf.save_params(str(tmp_path), params, cfg, source=path)
    written = json.load(open(tmp_path / "config.json"))
    assert written["model_type"] == family
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        want = model(torch.tensor(TOKENS)).logits.numpy()
        got = back(torch.tensor(TOKENS)).logits.numpy()
    assert _max_diff(got, want) <= 1e-5, _max_diff(got, want)
    again, cfg2 = hf.load_params(str(tmp_path), dtype=jnp.float32)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, again, params)


@pytest.mark.slow
def test_missing_and_extra_expert_tensors_are_refused(checkpoints, tmp_path):
    from safetensors.numpy import load_file  # noqa: PLC0415
    from safetensors.numpy import save_file  # noqa: PLC0415

    path, _ = checkpoints["mixtral"]
    for case in ("missing", "extra"):
        d = tmp_path / case
        shutil.copytree(path, d)
        fn = str(d / "model.safetensors")
        tensors = load_file(fn)
        name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
        if case == "missing":
            del tensors[name]
        else:
            tensors[name.replace("experts.3", "experts.4")] = tensors[name]
        save_file(tensors, fn, metadata={"format": "pt"})
        with pytest.raises((FileNotFoundError, ValueError)) as e:
            hf.load_params(str(d))
        assert name.replace("experts.3", "experts.4" if case == "extra" else "experts.3") in str(
            e.value
        )
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_config_json_refusals(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3_moe"]
    for field, value, words in (
        ("decoder_sparse_step", 2, "decoder_sparse_step=2"),
        ("mlp_only_layers", [0], "mlp_only_layers=[0]"),
        ("num_experts_per_tok", 9, "num_experts_per_tok=9 must be in 1..num_experts=6"),
    ):
        d = tmp_path / field
        os.makedirs(d)
        raw = json.load(open(os.path.join(path, "config.json")))
        json.dump({**raw, field: value}, open(d / "config.json", "w"))
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            hf.load_config(str(d))


# --- the published configs -----------------------------------------------------------

#: config.json of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B (token ids left out).
PUBLISHED = {
    "mixtral_8x7b": dict(
        architectures=["MixtralForCausalLM"], attention_dropout=0.0, hidden_act="silu",
        hidden_size=4096, initializer_range=0.02, intermediate_size=14336,
        max_position_embeddings=32768, model_type="mixtral", num_attention_heads=32,
        num_experts_per_tok=2, num_hidden_layers=32, num_key_value_heads=8,
        num_local_experts=8, output_router_logits=False, rms_norm_eps=1e-05,
        rope_theta=1e6, router_aux_loss_coef=0.02, sliding_window=None,
        tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, vocab_size=32000,
    ),
    "qwen3_30b_a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], attention_bias=False, attention_dropout=0.0,
        decoder_sparse_step=1, head_dim=128, hidden_act="silu", hidden_size=2048,
        initializer_range=0.02, intermediate_size=6144, max_position_embeddings=40960,
        max_window_layers=48, mlp_only_layers=[], model_type="qwen3_moe",
        moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32,
        num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4,
        output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1e6,
        router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False,
        torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=151936,
    ),
}  # fmt: skip


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_configs_load_as_the_presets(preset):
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = hf.config_from_dict(PUBLISHED[preset])
    assert cfg == llama.get_config(preset), (cfg, llama.get_config(preset))
    # Mixtral 8x7B: 46.7B parameters, 12.9B active per token (its model card); Qwen3-30B-A3B:
    # 30.5B, 3.3B active (its model card)
    total, active = {"mixtral_8x7b": (46.7e9, 12.9e9), "qwen3_30b_a3b": (30.5e9, 3.3e9)}[preset]
    n = llama.num_params(cfg)
    idle = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size
    idle *= llama.expert_size(cfg) * cfg.num_layers
    assert abs(n - total) < 0.05e9 and abs(n - idle - active) < 0.02 * active, (n, n - idle)


# --- FLOPs ----------------------------------------------------------------------------


def _expert_flops_per_token(cfg) -> float:
    """2 * (3 H F_e) per active expert: the gate, up and down matmuls of k experts."""
    return 2 * 3 * cfg.hidden_size * llama.expert_size(cfg) * cfg.num_experts_per_tok


_FLOPS_SHAPE = dict(h=64, f=128, e=16, k=2, t=1024)  # 2,048 rows: 8-row tiles pad 6.25%


def _compiled_text(fn, args, device=None) -> str:
    if device is None:
        return jax.jit(fn).lower(*args).compile().as_text()
    with jax.default_device(device):
        return jax.jit(fn).lower(*args).compile().as_text()


def _block_flops(dtype=jnp.float32, device=None, **shape) -> tuple[float, float]:
    """``(compiled dot FLOPs per token, active)`` of one routed MLP (the router's matmul
    counted in both), compiled for ``device`` (None: this backend)."""
    s = {**_FLOPS_SHAPE, **shape}
    h, f, e, k, t = s["h"], s["f"], s["e"], s["k"], s["t"]
    args = [jax.ShapeDtypeStruct(a, dtype) for a in ((t, h), (h, e), (e, h, f), (e, h, f))]
    args.append(jax.ShapeDtypeStruct((e, f, h), dtype))

    def block(x, r, g, u, d):
        return moe.routed_experts(x, r, g, u, d, top_k=k, norm_topk_prob=True)[0]

    text = _compiled_text(block, args, device)
    return hlo_dot_flops(text) / t, 2 * 3 * h * f * k + 2 * h * e


def _lora_step_flops(dtype=jnp.float32, device=None, rank=4, **shape) -> tuple[float, float]:
    """``(compiled dot FLOPs per token, active)`` of the value and adapter gradients of a
    loss over one routed MLP with NF4 experts and per-expert LoRA (QLoRA), ``x`` and the
    router not differentiated: active is k experts' forward (base and the two LoRA
    products), down's input gradient, and each adapter's ``da``, ``db``, ``dt`` (and down's
    LoRA input gradient)."""
    from jmem import lora  # noqa: PLC0415
    from jmem import qlora  # noqa: PLC0415

    s = {**_FLOPS_SHAPE, **shape}
    h, f, e, k, t = s["h"], s["f"], s["e"], s["k"], s["t"]
    key = jax.random.split(jax.random.key(0), 5)
    shapes = {"expert_gate": (e, h, f), "expert_up": (e, h, f), "expert_down": (e, f, h)}
    base = {
        n: {"kernel": jax.random.normal(kk, sh, dtype) * 0.1}
        for kk, (n, sh) in zip(key, shapes.items())
    }
    base = qlora.quantize_params(base, modules=lambda path, leaf: True)
    ad = lora.init(key[3], base, rank=rank, modules=tuple(shapes))
    router = jax.random.normal(key[4], (h, e), dtype)
    x = jax.random.normal(key[4], (t, h), dtype)

    def loss(ad, x):
        def fn(p):
            out = moe.routed_experts(
                x, router, *(p[n]["kernel"] for n in shapes), top_k=k, norm_topk_prob=True
            )[0]
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return lora.apply(fn)(base, ad)

    text = _compiled_text(jax.value_and_grad(loss), (ad, x), device)
    r = rank
    base_mm = 2 * 4 * h * f  # forward gate, up, down; backward: down's input gradient only
    fwd_lora = 2 * 3 * r * (h + f)
    bwd_lora = 2 * 2 * (2 * r * f + r * h) + 2 * (2 * r * h + 2 * r * f)  # gate, up; down
    return hlo_dot_flops(text) / t, k * (base_mm + fwd_lora + bwd_lora) + 2 * h * e


def test_compiled_moe_flops_are_those_of_k_experts():
    """The compiled dot FLOPs per token of one routed MLP (XLA:CPU) are the active FLOPs
    (k of E experts, plus the router) within 10%: the tiled grouped matmul, not XLA's dense
    ``[T k, E K]`` rewrite of ``ragged_dot`` (E x active)."""
    flops, active = _block_flops()
    assert abs(flops - active) <= 0.1 * active, (flops, active)


def test_compiled_qlora_moe_step_flops_are_those_of_k_experts():
    """The value and adapter gradients of a QLoRA loss over the routed MLP (NF4 experts,
    per-expert LoRA), XLA:CPU: compiled dot FLOPs within 10% of active (forward, input
    gradients, LoRA factor gradients; no gradient of the frozen base)."""
    flops, active = _lora_step_flops()
    assert abs(flops - active) <= 0.1 * active, (flops, active)


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_compiled_moe_flops_for_h100_sxm():
    """XLA:GPU's compile for h100_sxm (without a GPU), bfloat16 at a larger shape: the
    forward and the QLoRA step's dot FLOPs within 10% of active."""
    reason = jmem.targets.unavailable_reason("h100_sxm")
    if reason is not None:
        pytest.skip(f"no XLA:GPU compiler here: {reason}")
    device = jmem.targets.devices("h100_sxm")[0]
    shape = dict(h=512, f=1024, t=2048)
    flops, active = _block_flops(jnp.bfloat16, device, **shape)
    assert abs(flops - active) <= 0.1 * active, (flops, active)
    flops, active = _lora_step_flops(jnp.bfloat16, device, **shape)
    assert abs(flops - active) <= 0.1 * active, (flops, active)


@pytest.mark.slow
def test_nf4_on_load_quantizes_the_experts_and_keeps_the_router_float(checkpoints):
    path, _ = checkpoints["mixtral"]
    dense, cfg = hf.load_params(path, dtype=jnp.float32)
    q, _ = hf.load_params(path, dtype=jnp.float32, quantize="nf4")
    np.testing.assert_array_equal(
        q["layers"]["router"]["kernel"], dense["layers"]["router"]["kernel"]
    )
    for name in ("expert_gate", "expert_up", "expert_down"):
        leaf = q["layers"][name]["kernel"]
        assert (
            isinstance(leaf, nf4.NF4Array) and leaf.shape == dense["layers"][name]["kernel"].shape
        )
        want = nf4.quantize(dense["layers"][name]["kernel"])  # per expert matrix
        np.testing.assert_array_equal(leaf.packed, want.packed)


@pytest.mark.slow
def test_the_job_fine_tunes_tiny_moe(tmp_path):
    """``jmem finetune --config tiny_moe`` (QLoRA, default targets) and ``--checkpoint`` of
    a Mixtral checkpoint: the experts in NF4 and the router float, ``all`` adapts the
    attention projections (``target_modules``; the experts are PEFT ``target_parameters``),
    and the loss falls."""
    from jmem import finetune  # noqa: PLC0415

    out = tmp_path / "run"
    argv = ["--config", "tiny_moe", "--batch-size", "8", "--seq-len", "32", "--steps", "12"]
    finetune.main(argv + ["--no-progress", "--lr", "3e-3", "--out", str(out)])
    summary = json.load(open(out / "summary.json"))
    assert summary["last_loss"] < summary["first_loss"] - 0.1, summary
    targets = json.load(open(out / "adapter" / "adapter_config.json"))["target_modules"]
    assert sorted(targets) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # --checkpoint: a Mixtral checkpoint read, quantized but for its router
    cfg = llama.get_config("tiny_moe")
    hf.save_params(str(tmp_path / "ckpt"), llama.init(jax.random.key(0), cfg), cfg)
    argv[:2] = ["--checkpoint", str(tmp_path / "ckpt"), "--tokenizer", "byte"]
    finetune.main(argv + ["--no-progress", "--lr", "3e-3", "--out", str(tmp_path / "run2")])
    summary = json.load(open(tmp_path / "run2" / "summary.json"))
    assert summary["last_loss"] < summary["first_loss"] - 0.1, summary
