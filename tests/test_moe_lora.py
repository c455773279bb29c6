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
    with pytest.raises(ValueError, match="routers excluded"):
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
