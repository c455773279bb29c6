"""LoRA and NF4 on mixture-of-experts weights: the ``ragged_dot_general`` rule of the
implicit-weight interpreter against a per-expert dense reference, NF4 experts, the module
rules (defaults, ``all``, PEFT spellings, the router), and the job on an MoE model."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import lora
from jmem import nf4
from jmem import qlora
from jmem._src import lora_modules

E, M, D_IN, D_OUT = 3, 10, 64, 6
#: Rows per expert; 9 of the 10 rows are grouped (the last one is in no group: zeros).
GROUPS = (4, 0, 5)


def _setup(seed=0, layers=None):
    k = jax.random.split(jax.random.key(seed), 4)
    shape = (E, D_IN, D_OUT) if layers is None else (layers, E, D_IN, D_OUT)
    params = {"moe": {"kernel": jax.random.normal(k[0], shape)}}
    x = jax.random.normal(k[1], (M, D_IN))
    ad = lora.init(k[2], params, rank=2, alpha=4.0, modules="moe/kernel", init_lora_weights=False)
    return params, ad, x, jnp.asarray(GROUPS, jnp.int32)


def _experts(p, x, gs):
    return jax.lax.ragged_dot(x, p["moe"]["kernel"], gs)


def _reference(w_dense, a, b, scale, x, groups=GROUPS, transpose=False):
    """Per-expert loop: ``x_e @ (W_e + s a_e b_e)`` (or its transpose), zeros for rows in
    no group."""
    out, start = [], 0
    for e, n in enumerate(groups):
        merged = w_dense[e] + scale * a[e] @ b[e]
        out.append(x[start : start + n] @ (merged.T if transpose else merged))
        start += n
    width = w_dense.shape[1] if transpose else w_dense.shape[2]
    out.append(jnp.zeros((x.shape[0] - start, width), x.dtype))
    return jnp.concatenate(out)


def _sq(y):
    return jnp.sum(y**2)


@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "nf4"])
def test_ragged_dot_values_and_gradients_match_per_expert_loop(quantized):
    params, ad, x, gs = _setup()
    w = ad["moe/kernel"]
    if quantized:
        params = qlora.quantize_params(params, modules="moe/kernel")
        dense = nf4.dequantize(params["moe"]["kernel"], jnp.float32)
    else:
        dense = params["moe"]["kernel"]
    f = lora.apply(_experts)
    y = jax.jit(f)(params, ad, x, gs)
    chex.assert_trees_all_close(y, _reference(dense, w.a, w.b, w.scale, x), atol=1e-5, rtol=1e-5)
    got = jax.grad(lambda ad, x: _sq(f(params, ad, x, gs)), argnums=(0, 1))(ad, x)
    want = jax.grad(lambda a, b, x: _sq(_reference(dense, a, b, w.scale, x)), argnums=(0, 1, 2))(
        w.a, w.b, x
    )
    g = got[0]["moe/kernel"]
    chex.assert_trees_all_close((g.a, g.b, got[1]), want, atol=1e-4, rtol=1e-5)
    assert float(jnp.abs(g.a).max()) > 0 and float(jnp.abs(g.b).max()) > 0


def test_ragged_dot_contracting_the_experts_output_axis():
    """``ragged_dot(x, swapaxes(W, 1, 2))``: per expert ``x_e @ (W_e + s a_e b_e)ᵀ``."""
    params, ad, _, gs = _setup()
    w = ad["moe/kernel"]
    x_out = jax.random.normal(jax.random.key(5), (M, D_OUT))

    def f(p, x, gs):
        return jax.lax.ragged_dot(x, jnp.swapaxes(p["moe"]["kernel"], 1, 2), gs)

    y = lora.apply(f)(params, ad, x_out, gs)
    ref = _reference(params["moe"]["kernel"], w.a, w.b, w.scale, x_out, transpose=True)
    chex.assert_trees_all_close(y, ref, atol=1e-5, rtol=1e-5)


def test_nf4_experts_are_quantized_per_expert_and_get_no_gradient():
    params, ad, x, gs = _setup()
    q = qlora.quantize_params(params, modules="moe/kernel")["moe"]["kernel"]
    assert q.shape == (E, D_IN, D_OUT) and q.batch_ndim == 1 and q.double_quant
    whole = nf4.dequantize(q, jnp.float32)
    for e in range(E):
        one = nf4.quantize(params["moe"]["kernel"][e])
        np.testing.assert_array_equal(whole[e], nf4.dequantize(one, jnp.float32))
    qparams = {"moe": {"kernel": q}}
    grads = jax.grad(
        lambda qp, ad: _sq(lora.apply(_experts)(qp, ad, x, gs)), argnums=(0, 1), allow_int=True
    )(qparams, ad)
    for leaf in jax.tree.leaves(grads[0]):
        if leaf.dtype != jax.dtypes.float0:
            np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


@pytest.mark.slow
def test_stacked_experts_in_a_layer_scan_match_the_reference():
    """``[L, E, in, out]`` experts, NF4, scanned over layers (each step sees ``[E, in, out]``)."""
    params, ad, x, gs = _setup(layers=2)
    qp = qlora.quantize_params(params, modules="moe/kernel")

    def model(p, x, gs):
        def step(h, w):
            return jnp.tanh(jax.lax.ragged_dot(h, w, gs)) @ jnp.ones((D_OUT, D_IN)), None

        return jax.lax.scan(step, x, p["moe"]["kernel"])[0]

    dense = nf4.dequantize(qp["moe"]["kernel"], jnp.float32)
    w = ad["moe/kernel"]

    def ref(a, b):
        h = x
        for i in range(2):
            h = jnp.tanh(_reference(dense[i], a[i], b[i], w.scale, h)) @ jnp.ones((D_OUT, D_IN))
        return h

    f = lora.apply(model)
    chex.assert_trees_all_close(f(qp, ad, x, gs), ref(w.a, w.b), atol=1e-4, rtol=1e-5)
    g = jax.grad(lambda ad: _sq(f(qp, ad, x, gs)))(ad)["moe/kernel"]
    ga, gb = jax.grad(lambda a, b: _sq(ref(a, b)), argnums=(0, 1))(w.a, w.b)
    chex.assert_trees_all_close((g.a, g.b), (ga, gb), atol=1e-3, rtol=1e-4)


def test_adapted_ragged_dot_is_named_lora_matmul():
    """The remat policies save the adapted grouped matmul by its name, as a dense one."""
    params, ad, x, gs = _setup()
    jaxpr = str(jax.make_jaxpr(lambda ad: lora.apply(_experts)(params, ad, x, gs))(ad))
    assert "lora_matmul" in jaxpr and "lora_batched_matmul" not in jaxpr


def test_ragged_dot_lora_dropout():
    """With a key the adapter's input is dropped (the output changes, the base term does
    not: at ``b = 0`` it is the base matmul); with ``lora_dropout_key=None`` it is the
    program without dropout, bitwise."""
    params, ad, x, gs = _setup()
    drop = lora.init(
        jax.random.key(2), params, rank=2, alpha=4.0, modules="moe/kernel", dropout=0.5,
        init_lora_weights=False,
    )  # fmt: skip
    keep = {k: v.__class__(v.a, v.b, scale=v.scale) for k, v in drop.items()}
    f = lora.apply(_experts)
    np.testing.assert_array_equal(
        f(params, drop, x, gs, lora_dropout_key=None), f(params, keep, x, gs)
    )
    dropped = f(params, drop, x, gs, lora_dropout_key=jax.random.key(3))
    assert float(jnp.abs(dropped - f(params, keep, x, gs)).max()) > 1e-3
    zero_b = {
        k: v.__class__(v.a, jnp.zeros_like(v.b), scale=v.scale, dropout=0.5)
        for k, v in drop.items()
    }
    chex.assert_trees_all_close(
        f(params, zero_b, x, gs, lora_dropout_key=jax.random.key(3)),
        _experts(params, x, gs),
        atol=1e-5,
    )


def test_weight_as_group_sizes_or_left_operand_refused():
    params, ad, x, gs = _setup()

    def left(p, x, gs):  # the weight as the ragged left operand
        return jax.lax.ragged_dot(p["moe"]["kernel"][0], jnp.ones((E, D_OUT, 2)), gs[:E])

    with pytest.raises(lora.ImplicitWeightError, match="ragged_dot_general"):
        lora.apply(left)(params, ad, x, gs)
    merged = lora.merge(params, ad)  # allow_materialize: the merged weight for this call
    chex.assert_trees_all_close(
        lora.apply(left, allow_materialize=True)(params, ad, x, gs),
        left(merged, x, gs),
        atol=1e-5,
    )


# --------------------------------------------------------------------------------------
# Module rules on an MoE params tree (synthetic: the leaves an MoE layer holds).

L_, H_, F_ = 2, 8, 4


def _moe_params():
    z = jnp.zeros
    return {
        "embed": {"embedding": z((16, H_))},
        "layers": {
            "attn_norm": {"scale": z((L_, H_))},
            "q_proj": {"kernel": z((L_, H_, H_))},
            "k_proj": {"kernel": z((L_, H_, H_))},
            "v_proj": {"kernel": z((L_, H_, H_))},
            "o_proj": {"kernel": z((L_, H_, H_))},
            "mlp_norm": {"scale": z((L_, H_))},
            "router": {"kernel": z((L_, H_, E))},
            "expert_gate": {"kernel": z((L_, E, H_, F_))},
            "expert_up": {"kernel": z((L_, E, H_, F_))},
            "expert_down": {"kernel": z((L_, E, F_, H_))},
        },
        "final_norm": {"scale": z((H_,))},
        "lm_head": {"kernel": z((H_, 16))},
    }


EXPERTS = {f"layers/expert_{n}/kernel" for n in ("gate", "up", "down")}
ATTN = {f"layers/{n}_proj/kernel" for n in "qkvo"}


def test_default_lora_modules_on_moe_are_q_v_and_every_expert_projection():
    ad = lora.init(jax.random.key(0), _moe_params(), rank=2)
    assert set(ad) == {"layers/q_proj/kernel", "layers/v_proj/kernel"} | EXPERTS
    gate = ad["layers/expert_gate/kernel"]
    assert gate.a.shape == (L_, E, H_, 2) and gate.b.shape == (L_, E, 2, F_)


@pytest.mark.parametrize(
    "targets, want",
    [
        ("all", ATTN | EXPERTS),
        ("all-linear", ATTN | EXPERTS),
        ("gate_up_proj", {"layers/expert_gate/kernel", "layers/expert_up/kernel"}),
        ("gate_proj,up_proj,down_proj", EXPERTS),
        ("w1,w3,w2", EXPERTS),
        ("experts", EXPERTS),
        ("q_proj,expert_down", {"layers/q_proj/kernel", "layers/expert_down/kernel"}),
    ],
)
def test_lora_targets_on_moe(targets, want):
    mods = lora_modules.modules(lora_modules.parse(targets))
    assert set(lora.init(jax.random.key(0), _moe_params(), rank=2, modules=mods)) == want


@pytest.mark.parametrize("targets", ["router", "gate"])
def test_router_is_never_adapted(targets):
    with pytest.raises(ValueError, match="never adapts the router"):
        lora.init(jax.random.key(0), _moe_params(), modules=lora_modules.modules(targets))
    with pytest.raises(ValueError, match="as are MoE routers"):
        lora.init(jax.random.key(0), _moe_params(), modules=r"layers/router/.*")


def test_targets_matching_no_expert_refused():
    with pytest.raises(ValueError, match="no module named 'expert_gaet'.*expert_gate"):
        lora.init(jax.random.key(0), _moe_params(), modules=("expert_gaet",))


def test_qlora_default_quantizes_experts_not_router():
    qp = qlora.quantize_params(_moe_params())
    flat = {
        "/".join(str(k.key) for k in p): x
        for p, x in jax.tree_util.tree_flatten_with_path(
            qp, is_leaf=lambda x: isinstance(x, nf4.NF4Array)
        )[0]
    }
    quantized = {p for p, x in flat.items() if isinstance(x, nf4.NF4Array)}
    assert quantized == ATTN | EXPERTS
    assert flat["layers/expert_down/kernel"].batch_ndim == 2  # per layer, per expert
    assert flat["layers/router/kernel"].dtype == jnp.float32


# --------------------------------------------------------------------------------------
# The fused gate_up conversion (numpy) and PEFT round trips on tiny transformers models.


def _factors(seed, lead, n_in, r, n_out):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((*lead, n_in, r)).astype(np.float32)
    b = rng.standard_normal((*lead, r, n_out)).astype(np.float32)
    return lora.LoraWeight(a=a, b=b, scale=2.0)


@pytest.mark.parametrize("which", ["both", "shared_a", "gate", "up"])
def test_fused_gate_up_is_exact_and_splits_back(which):
    """PEFT's fused update ``scale * B_e A_e`` [2F, H] equals jmem's
    ``[(s a_g b_g)ᵀ; (s a_u b_u)ᵀ]``; reading it back gives jmem's factors again."""
    from jmem.models import peft_experts as px  # noqa: PLC0415

    lead, h, f = (2, E), 8, 5
    gate, up = _factors(0, lead, h, 3, f), _factors(1, lead, h, 3, f)
    if which == "shared_a":
        up = lora.LoraWeight(a=gate.a, b=up.b, scale=2.0)
    gate, up = (None if which == "up" else gate), (None if which == "gate" else up)
    A, B, scale = px.fused_gate_up(gate, up, f)
    fused = scale * np.einsum("...or,...ri->...oi", B, A)
    zero = np.zeros((*lead, f, h), np.float32)
    want = np.concatenate(
        [zero if w is None else np.swapaxes(np.asarray(w.delta()), -1, -2) for w in (gate, up)],
        axis=-2,
    )
    np.testing.assert_allclose(fused, want, rtol=1e-5, atol=1e-5)
    assert A.shape[-2] == {"both": 6, "shared_a": 3, "gate": 3, "up": 3}[which]
    a_w, b_w = px.to_peft(A[0], B[0])  # PEFT's flattened layout of layer 0, and back
    assert a_w.shape == (E * A.shape[-2], h) and b_w.shape == (2 * f, A.shape[-2] * E)
    R = A.shape[-2]
    for e in range(E):  # expert e: rows e*R.. of lora_A, columns j*E + e of lora_B
        np.testing.assert_array_equal(a_w[e * R : (e + 1) * R], A[0, e])
        np.testing.assert_array_equal(b_w[:, e::E], B[0, e])
    back = px.from_peft(a_w, b_w, E)
    np.testing.assert_array_equal(back[0], A[0])
    np.testing.assert_array_equal(back[1], B[0])
    for w, pair in zip((gate, up), px.split_gate_up(A, B)):
        if w is None:
            assert pair is None
        else:
            np.testing.assert_array_equal(pair[0], w.a)
            np.testing.assert_array_equal(pair[1], w.b)


MOE_FAMILIES = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    pytest.importorskip("torch", reason="the oracle is transformers' MoE on torch")
    pytest.importorskip("peft", reason="PEFT loads the adapters")
    from test_moe import save_family  # noqa: PLC0415

    root = tmp_path_factory.mktemp("moe_lora")
    return {f: str(root / f) for f in MOE_FAMILIES if save_family(root / f, f) is not None}


def _hf_model(path):
    import transformers  # noqa: PLC0415

    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _jmem_adapters(params, modules, seed=1):
    ad = lora.init(jax.random.key(seed), params, rank=2, alpha=4.0, modules=modules,
                   init_lora_weights=False)  # fmt: skip
    # b at a third of nn.Linear's init: a visible, not overwhelming, update
    return {p: lora.LoraWeight(w.a, w.b * 0.3, scale=w.scale, alpha=w.alpha,
                               init_lora_weights=False) for p, w in ad.items()}  # fmt: skip


def _logits(model, tokens):
    import torch  # noqa: PLC0415

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_save_adapters_on_experts_loads_in_peft(moe_checkpoints, family, tmp_path):
    """jmem's expert adapters -> PEFT ``target_parameters`` on transformers 5's fused
    experts: ``PeftModel.from_pretrained`` gives jmem's logits (<= 1e-4, float32), and
    ``load_adapters`` gives back jmem's factors exactly."""
    import json  # noqa: PLC0415

    import peft  # noqa: PLC0415
    from test_moe import TOKENS  # noqa: PLC0415

    from jmem.models import hf  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    path = moe_checkpoints[family]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    ad = _jmem_adapters(params, ("q_proj", "v_proj", "experts"))
    hf.save_adapters(str(tmp_path), ad, cfg)
    c = json.load(open(tmp_path / "adapter_config.json"))
    assert c["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert c["rank_pattern"] == {r".*\.gate_up_proj": 4}
    assert c["alpha_pattern"] == {r".*\.gate_up_proj": 8}
    tokens = jnp.asarray(TOKENS, jnp.int32)
    got = np.asarray(lora.apply(llama.forward)(params, ad, tokens, cfg))
    base = np.asarray(llama.forward(params, tokens, cfg))
    want = _logits(peft.PeftModel.from_pretrained(_hf_model(path), str(tmp_path)).eval(), TOKENS)
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    assert np.abs(got - base).max() > 1e-2  # the adapters change the logits
    back = hf.load_adapters(str(tmp_path), params, cfg)
    assert list(back) == list(ad)
    for p, w in ad.items():
        np.testing.assert_array_equal(back[p].a, w.a)
        np.testing.assert_array_equal(back[p].b, w.b)
        assert back[p].scale == w.scale


@pytest.mark.slow
def test_peft_fused_expert_adapter_loads_in_jmem(moe_checkpoints, tmp_path):
    """A PEFT adapter on ``mlp.experts.gate_up_proj``/``down_proj`` (rank 4 fused, as PEFT's
    all-linear makes) -> ``load_adapters`` -> jmem's logits equal PEFT's; written back, PEFT
    computes the same; PEFT's all-linear (which also adapts the router) is refused."""
    import peft  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from test_moe import TOKENS  # noqa: PLC0415

    from jmem.models import hf  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    path = moe_checkpoints["qwen3_moe"]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=2, lora_alpha=8, target_modules=["q_proj", "k_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        rank_pattern={r".*\.gate_up_proj": 4}, alpha_pattern={r".*\.gate_up_proj": 16},
        init_lora_weights=False,
    )  # fmt: skip
    pm = peft.get_peft_model(_hf_model(path), config).eval()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(0.3)
    want = _logits(pm, TOKENS)
    pm.save_pretrained(str(tmp_path / "peft"))
    ad = hf.load_adapters(str(tmp_path / "peft"), params, cfg)
    assert ad["layers/expert_gate/kernel"].a.shape == (cfg.num_layers, cfg.num_experts, 32, 4)
    got = np.asarray(lora.apply(llama.forward)(params, ad, jnp.asarray(TOKENS, jnp.int32), cfg))
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    hf.save_adapters(str(tmp_path / "again"), ad, cfg)
    again = peft.PeftModel.from_pretrained(_hf_model(path), str(tmp_path / "again")).eval()
    np.testing.assert_allclose(_logits(again, TOKENS), want, atol=1e-5)
    linear = peft.get_peft_model(_hf_model(path), peft.LoraConfig(r=2, target_modules="all-linear"))
    linear.save_pretrained(str(tmp_path / "all_linear"))
    with pytest.raises(ValueError, match="never adapts the router"):
        hf.load_adapters(str(tmp_path / "all_linear"), params, cfg)


@pytest.mark.slow
def test_merged_export_of_expert_adapters_loads_in_transformers(moe_checkpoints, tmp_path):
    """``save_params(adapters=)`` on NF4 experts merges each expert's adapter; transformers'
    logits equal jmem's QLoRA logits (<= 1e-4)."""
    from test_moe import TOKENS  # noqa: PLC0415

    from jmem.models import hf  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    path = moe_checkpoints["qwen3_moe"]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    q = qlora.quantize_params(params)
    assert isinstance(q["layers"]["expert_gate"]["kernel"], nf4.NF4Array)
    assert not isinstance(q["layers"]["router"]["kernel"], nf4.NF4Array)
    ad = _jmem_adapters(q, lora_modules.modules("all"))
    hf.save_params(str(tmp_path), q, cfg, adapters=ad, dtype=jnp.float32)
    got = np.asarray(lora.apply(llama.forward)(q, ad, jnp.asarray(TOKENS, jnp.int32), cfg))
    want = _logits(_hf_model(str(tmp_path)), TOKENS)
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


@pytest.mark.slow
def test_planner_counts_one_adapter_pair_per_expert():
    """The planner's LoRA elements on an MoE preset equal ``lora.num_trainable`` of
    ``lora.init`` on its params (``--lora-targets all``: attention and every expert)."""
    from jmem._src.planner.shapes import MODEL_SHAPES  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    cfg = llama.get_config("tiny_moe")
    params = llama.abstract_params(cfg, jnp.float32)
    for targets in ("all", "q_proj,expert_down", "gate_up_proj"):
        selection = lora_modules.parse(targets)
        ad = lora.init(jax.random.key(0), params, rank=4, modules=lora_modules.modules(selection))
        names = lora_modules.planner_names(selection)
        assert MODEL_SHAPES["tiny_moe"].lora_elements(names, 4) == lora.num_trainable(ad)
        dry = lora_modules.linear_names(lora_modules.module_names(list(ad)))
        assert dry == names  # the dry run's count of the adapters it made


@pytest.mark.slow
def test_finetune_qlora_on_tiny_moe_trains_expert_adapters(tmp_path):
    """``jmem finetune --config tiny_moe``: NF4 experts (router float), LoRA pairs on every
    expert projection, the loss falls over 20 steps, and the adapter directory is PEFT's
    ``target_parameters`` form."""
    import json  # noqa: PLC0415

    from jmem import finetune  # noqa: PLC0415

    out = tmp_path / "run"
    argv = ["--config", "tiny_moe", "--steps", "20", "--batch-size", "8", "--seq-len", "64"]
    argv += ["--lr", "3e-3", "--no-progress", "--eval-split", "0", "--out", str(out)]
    summary = finetune.main(argv)
    losses = summary["losses"]
    assert len(losses) == 20 and np.mean(losses[-5:]) < losses[0] - 0.3, losses
    c = json.load(open(out / "adapter" / "adapter_config.json"))
    assert c["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert sorted(c["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]


@pytest.mark.gpu_compile
def test_nf4_experts_cost_one_dequantized_stack_on_xla_gpu():
    """XLA:GPU compile for h100_sxm (no GPU needed): the adapter gradient of one grouped
    matmul over NF4 experts (128 of 2048 x 768, Qwen3-30B-A3B's) needs one dequantized
    bf16 stack of temporaries more than over a bf16 base (within 10%): the experts are
    dequantized per call and never kept beside it."""
    import jmem  # noqa: PLC0415

    reason = jmem.targets.unavailable_reason("h100_sxm")
    if reason is not None:
        pytest.skip(f"no XLA:GPU compiler here: {reason}")
    e, h, f, m = 128, 2048, 768, 4096
    dense = jax.ShapeDtypeStruct((e, h, f), jnp.bfloat16)
    quantize = lambda w: qlora.quantize_params({"moe": {"kernel": w}}, modules="moe/kernel")  # noqa: E731
    nf4_params = jax.eval_shape(quantize, dense)
    ad = jax.eval_shape(
        lambda k: lora.init(k, {"moe": {"kernel": dense}}, rank=16, modules="moe/kernel"),
        jax.random.key(0),
    )

    def loss(ad, p, x, gs):
        return jnp.mean(jnp.square(lora.apply(_experts)(p, ad, x, gs).astype(jnp.float32)))

    x = jax.ShapeDtypeStruct((m, h), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((e,), jnp.int32)
    temp = {
        name: jmem.measure(jax.grad(loss), ad, p, x, gs, target="h100_sxm").temp_bytes
        for name, p in (("nf4", nf4_params), ("bf16", {"moe": {"kernel": dense}}))
    }
    # one stack (two would be +100%); the tiled grouped matmul's NF4 path measures 1.08
    np.testing.assert_allclose(temp["nf4"] - temp["bf16"], e * h * f * 2, rtol=0.1)


@pytest.mark.slow
def test_finetune_offload_params_on_tiny_moe_equals_the_device_run(tmp_path):
    """``--offload params`` on tiny_moe (NF4 expert stacks ``[L, E, in, out]`` in
    ``pinned_host``, each layer's experts fetched inside the layer scan): 3 steps give the
    losses of the run with the base on the device (1e-5)."""
    from jmem import finetune  # noqa: PLC0415

    argv = ["--config", "tiny_moe", "--steps", "3", "--batch-size", "2", "--seq-len", "32"]
    argv += ["--no-progress", "--eval-split", "0"]
    device = finetune.main(argv + ["--out", str(tmp_path / "device")])["losses"]
    host = finetune.main(argv + ["--offload", "params", "--out", str(tmp_path / "host")])
    assert len(device) == 3
    np.testing.assert_allclose(host["losses"], device, rtol=1e-5)


_MOE_MEMORY = "benchmarks/results/moe_memory_h100.json"
#: (preset, --offload params): the job's dry runs ``benchmarks/moe_memory.py`` records
_MOE_ROWS = [(p, off) for p in ("qwen3_30b_a3b", "mixtral_8x7b") for off in (False, True)]


def _moe_plan(preset: str, offload: bool):
    """The planner's ledger for ``jmem finetune --config PRESET --lora-rank 16 --seq-len 4096
    --batch-size 1 --dry-run --target h100_sxm [--offload params]``, with the options
    ``dry_run`` passes (the job's levers resolved for the target, the default targets:
    attention and every expert projection)."""
    import jmem  # noqa: PLC0415
    from jmem import finetune  # noqa: PLC0415
    from jmem import planner  # noqa: PLC0415
    from jmem._src.finetune import dry_run  # noqa: PLC0415
    from jmem._src.finetune.setup import job_levers  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    flat = dict(config=preset, seq_len=4096, batch_size=1, lora_rank=16)
    config = finetune.FinetuneConfig.from_flat(**flat, offload="params" if offload else "none")
    cfg = llama.get_config(preset)
    lv = jmem.resolve_levers(job_levers(config), cfg, (1, 4096), "h100_sxm")
    modules = lora_modules.planner_names(lora_modules.parse(config.training.lora_targets))
    kw = dry_run._planner_kwargs(config, lv, "bfloat16", modules, 1)  # noqa: SLF001
    return planner.estimate(cfg, **kw)


@pytest.mark.parametrize("preset,offload", _MOE_ROWS)
def test_planner_within_10_percent_of_the_stored_moe_dry_runs(preset, offload):
    """The planner (as the dry run calls it) against the committed h100_sxm compiles of the
    job's MoE QLoRA dry runs (``moe_memory_h100.json``, ``benchmarks/moe_memory.py``): the
    total within 10% of the compiled device peak, the state ledgers equal to the compile's
    arguments (the streamed base holds none), and the streamed peaks under the goals."""
    import json  # noqa: PLC0415
    import pathlib  # noqa: PLC0415

    path = pathlib.Path(__file__).parent.parent / _MOE_MEMORY
    rows = json.loads(path.read_text())["rows"]
    (row,) = [r for r in rows if r["config"] == preset and r["offload_params"] == offload]
    est = _moe_plan(preset, offload)
    gib = 2**30
    np.testing.assert_allclose(est.total / gib, row["compiled_peak_gib"], rtol=0.10)
    state = est.params + est.optimizer_state + est.master_weights
    np.testing.assert_allclose(state / gib, row["compiled_args_gib"], atol=0.01)
    if offload:
        assert row["compiled_peak_gib"] <= row["goal_gib"] and row["meets_goal"], row


@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.parametrize("preset,offload", _MOE_ROWS)
def test_planner_within_10_percent_of_the_moe_dry_run(tmp_path, preset, offload):
    """XLA:GPU compile for h100_sxm (no GPU; under a minute each on 2 cores): ``jmem finetune
    --config PRESET --lora-rank 16 --seq-len 4096 --batch-size 1 --dry-run`` with the base
    on the device and streamed: the dry run's planner total is the compiled device peak
    within 10%, and the streamed peaks are under the goals (16 GiB for Qwen3-30B-A3B, 24
    GiB for Mixtral 8x7B)."""
    import json  # noqa: PLC0415

    import jmem  # noqa: PLC0415
    from jmem import finetune  # noqa: PLC0415

    reason = jmem.targets.unavailable_reason("h100_sxm")
    if reason is not None:
        pytest.skip(f"no XLA:GPU compiler here: {reason}")
    argv = ["--config", preset, "--lora-rank", "16", "--seq-len", "4096"]
    argv += ["--batch-size", "1", "--dry-run", "--target", "h100_sxm", "--out", str(tmp_path)]
    finetune.main(argv + ["--no-check-advice"] + ["--offload", "params"] * offload)
    rec = json.load(open(tmp_path / "dry_run.json"))
    peak, planned = rec["compiled"]["peak_bytes"], rec["estimate"]["total"]
    np.testing.assert_allclose(planned, peak, rtol=0.10)
    assert planned == _moe_plan(preset, offload).total  # the fast test's ledger
    if offload:
        assert peak <= {"qwen3_30b_a3b": 16, "mixtral_8x7b": 24}[preset] * 2**30, peak
