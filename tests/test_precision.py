"""Tests for jmem.precision: policy grammar, casting of floating leaves only."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import Policy
from jmem import cast_floating
from jmem import get_policy
from jmem._src import precision

F32, BF16, F16, F64 = (jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("p=full,c=half,o=single", (F32, F16, F32)),
        (" P = fp32 , C = BF16 ", (F32, BF16, BF16)),  # output follows compute
        ("c=f16", (F32, F16, F16)),  # params default to f32
        ("p=bf16", (BF16, BF16, BF16)),  # compute follows params
        ("o=float16", (F32, F32, F16)),
        ("param=f64,compute=double,out=float64", (F64, F64, F64)),
        ("bf16", (BF16, BF16, BF16)),  # a single dtype means all three
        ("half", (F16, F16, F16)),
        ("float32", (F32, F32, F32)),
    ],
)
def test_get_policy_grammar(text, expected):
    pol = get_policy(text)
    assert (pol.param_dtype, pol.compute_dtype, pol.output_dtype) == expected
    # str() parses back to an equal policy.
    assert get_policy(str(pol)) == pol


def test_get_policy_agrees_with_jmp_where_jmp_is_platform_independent():
    jmp = pytest.importorskip("jmp")
    for text in [
        "p=f32,c=bf16,o=f32",
        "c=f16",
        "p=bf16",
        "params=float32,compute=bfloat16",
        "bf16",
        "f32",
        "full",
    ]:
        ours, theirs = get_policy(text), jmp.get_policy(text)
        assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
            jnp.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
        )


def test_policy_normalises_and_compares_by_value():
    a = Policy(jnp.float32, "bf16", np.float32)
    b = Policy(F32, BF16, F32)
    assert a == b and hash(a) == hash(b)
    assert a.with_output_dtype("f16").output_dtype == F16
    assert get_policy(a) is a
    assert str(a) == "params=f32,compute=bf16,output=f32"


@pytest.mark.parametrize(
    "text, match",
    [
        ("p=f32,x=bf16", r"Unknown key 'x'.*valid keys are: .*compute.*output.*params"),
        ("p=f33", r"Unknown dtype name 'f33'.*valid names are: .*bf16.*float32.*half"),
        ("int8", r"Unknown dtype name 'int8'"),
        ("p=f32,p=bf16", r"given twice"),
        ("p=f32,,c=bf16", r"Malformed entry"),
        ("p=f32=bf16", r"Malformed entry"),
        ("", r"Empty policy"),
    ],
)
def test_get_policy_errors(text, match):
    with pytest.raises(ValueError, match=match):
        get_policy(text)


def test_type_errors():
    with pytest.raises(TypeError, match="policy must be a string"):
        get_policy(jnp.float32)
    with pytest.raises(TypeError, match="floating dtype"):
        Policy(jnp.int32, jnp.float32, jnp.float32)
    with pytest.raises(TypeError, match="floating dtype"):
        cast_floating({"a": jnp.ones(2)}, jnp.int8)
    with pytest.raises(ValueError, match="Unknown dtype name"):
        cast_floating({"a": jnp.ones(2)}, "bf17")


def _mixed_tree():
    return {
        "w": jnp.linspace(-2, 2, 12, dtype=jnp.float32).reshape(3, 4),
        "b16": jnp.ones((4,), jnp.bfloat16),
        "np": np.arange(3, dtype=np.float64) / 3,
        "ids": jnp.arange(5, dtype=jnp.int32),
        "codes": jnp.arange(7, dtype=jnp.uint8),
        "mask": jnp.array([True, False]),
        "step": 3,  # python scalars are not arrays: untouched
        "lr": 0.5,
        "none": None,
    }


class CastTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_policy_casts_only_floating_leaves(self):
        pol = get_policy("p=f32,c=bf16,o=f16")
        tree = {k: v for k, v in _mixed_tree().items() if hasattr(v, "dtype")}
        for method, dtype in (
            (pol.cast_to_param, F32),
            (pol.cast_to_compute, BF16),
            (pol.cast_to_output, F16),
        ):
            out = self.variant(method)(tree)
            self.assertEqual(jax.tree_util.tree_structure(out), jax.tree_util.tree_structure(tree))
            for k in ("w", "b16", "np"):
                self.assertEqual(out[k].dtype, dtype)
                # Values are the rounded originals.
                np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(tree[k]).astype(dtype))
            for k in ("ids", "codes", "mask"):
                self.assertEqual(out[k].dtype, tree[k].dtype)
                np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(tree[k]))


def test_cast_floating_leaves_non_arrays_alone_and_keeps_identity():
    tree = _mixed_tree()
    out = cast_floating(tree, "bf16")
    assert out["step"] == 3 and out["lr"] == 0.5 and out["none"] is None
    assert out["ids"] is tree["ids"] and out["codes"] is tree["codes"]
    assert out["b16"] is tree["b16"]  # already bf16: no copy
    assert isinstance(out["np"], np.ndarray)  # NumPy leaves stay NumPy
    assert out["np"].dtype == BF16 and out["w"].dtype == BF16


def test_cast_floating_shape_dtype_structs():
    abstract = {
        "w": jax.ShapeDtypeStruct((4, 8), jnp.float32),
        "codes": jax.ShapeDtypeStruct((16,), jnp.uint8),
    }
    out = cast_floating(abstract, jnp.bfloat16)
    assert out["w"].shape == (4, 8) and out["w"].dtype == BF16
    assert out["codes"].dtype == jnp.uint8


def test_parse_and_name_roundtrip():
    for name in [
        "bf16",
        "bfloat16",
        "f16",
        "fp16",
        "float16",
        "half",
        "f32",
        "fp32",
        "float32",
        "full",
        "single",
        "f64",
        "double",
    ]:
        d = precision.parse_dtype(name)
        assert precision.parse_dtype(precision.dtype_name(d)) == d
    with pytest.raises(TypeError):
        precision.parse_dtype(32)


# --- the policy reaches the matmuls, or a warning -----------------------------------------


def _nnx_step(dtype):
    """A Flax NNX model (Embed -> Linear -> relu -> Linear head) trained with
    precision='p=f32,c=bf16,o=f32'; ``dtype`` is what Embed and Linear are built with."""
    import optax
    from flax import nnx

    import jmem

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(97, 32, dtype=dtype, rngs=rngs)
            self.up = nnx.Linear(32, 64, dtype=dtype, rngs=rngs)
            self.head = nnx.Linear(64, 97, dtype=dtype, rngs=rngs)

        def __call__(self, tokens):
            return self.head(jax.nn.relu(self.up(self.embed(tokens))))

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["inputs"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, batch["targets"][..., None], -1).mean()

    step = jmem.train_step(loss_fn, optax.adam(1e-3), precision="p=f32,c=bf16,o=f32")
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 97)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return step, step.init(params), batch, loss_fn


def _dot_dtypes(step, state, batch) -> list[str]:
    """The operand dtypes of every dot_general in the step's jaxpr (forward and backward)."""
    from jax.extend import core as jcore

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append({str(v.aval.dtype) for v in eqn.invars})
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(step.jitted)(state, batch).jaxpr)
    return found


@pytest.mark.slow
def test_nnx_embed_pinned_to_float32_gets_the_precision_warning():
    """nnx.Embed without dtype= computes in float32 and every Linear after it promotes: all
    matmuls are float32 under a bf16 policy, and the step warns once naming how many."""
    step, state, batch, loss_fn = _nnx_step(None)
    with pytest.warns(UserWarning, match=r"2 of the 2 matmuls .* float32.*nnx.Embed"):
        step.jitted.lower(state, batch)
    dots = _dot_dtypes(step, state, batch)
    assert dots and all(d == {"float32"} for d in dots), dots  # the policy did not apply
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per loss function
        step.jitted.lower(state, batch)


@pytest.mark.slow
def test_nnx_recipe_gives_bf16_matmuls_and_no_warning():
    """The documented recipe (Embed and Linear built with dtype=jnp.bfloat16, params kept
    float32): every matmul of the step, forward and backward, takes bf16 operands."""
    import warnings

    step, state, batch, _ = _nnx_step(jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step.jitted.lower(state, batch)
    dots = _dot_dtypes(step, state, batch)
    assert len(dots) >= 6 and all(d == {"bfloat16"} for d in dots), dots
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_jmem_llama_under_bf16_does_not_warn():
    import warnings

    import optax

    import jmem
    from jmem.models import llama

    cfg = llama.get_config("tiny")
    params = llama.init(jax.random.key(0), cfg)
    loss_fn = lambda p, b: llama.loss_fn(p, b, cfg)  # noqa: E731
    step = jmem.train_step(loss_fn, optax.adam(1e-3), precision="p=f32,c=bf16,o=f32")
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.eval_shape(
            step.jitted, step.init(params), {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        )
