"""Expert parallelism: the routed experts of a mixture-of-experts layer split over an
``expert`` mesh axis of 4 of the 8 CPU devices of tests/conftest.py (docs/sharding.md,
"Expert parallelism"), against one device.

Tolerances: float32 throughout in the library tests; the split computation sums the
experts' outputs and the gradients in another order than one device does (observed
~1e-7 absolute for O(1) values), so 1e-5 bounds rounding, far below any lost or
duplicated pair (O(0.1)).
"""

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmem
from jmem import lora
from jmem import qlora
from jmem import sharding
from jmem import train_step
from jmem._src import moe
from jmem._src.measure import compile_for_target
from jmem._src.measure import report_from_compiled
from jmem.models import llama


def _mesh(expert=4, fsdp=1, data=1):
    n = expert * fsdp * data
    return sharding.make_mesh(data, fsdp, jax.devices()[:n], expert=expert)


def test_make_mesh_expert_axis_and_errors():
    mesh = _mesh(expert=2, fsdp=2)
    assert mesh.axis_names == ("data", "fsdp", "expert", "context")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 2, "context": 1}
    assert sharding.make_mesh(2, 4).axis_names == ("data", "fsdp", "context")  # no expert axis
    assert dict(sharding.make_mesh(expert=4).shape)["fsdp"] == 2
    with pytest.raises(ValueError, match="data \\* fsdp \\* expert \\* context"):
        sharding.make_mesh(1, 3, expert=2)
    with pytest.raises(ValueError, match="expert must be a positive int"):
        sharding.make_mesh(expert=0)
    assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp", "expert"))


def _layer(t=32, h=16, f=24, e=8, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(k[0], (t, h))
    router = jax.random.normal(k[1], (h, e))
    gate, up = (jax.random.normal(k[i], (e, h, f)) * 0.1 for i in (2, 3))
    down = jax.random.normal(k[4], (e, f, h)) * 0.1
    return x, router, gate, up, down


def _loss(x, router, gate, up, down):
    out, probs = moe.routed_experts(x, router, gate, up, down, top_k=2, norm_topk_prob=True)
    selected, prob_sum = moe.router_stats(probs, 2)
    aux = moe.load_balancing_loss(selected[None], prob_sum[None], probs.shape[0])
    return jnp.sum(out * jnp.cos(out)) + aux


@pytest.mark.parametrize("fsdp, batch", [(1, 32), (2, 32), (1, 2)])
def test_routed_experts_on_expert_mesh_equal_one_device(fsdp, batch):
    """Values and gradients (tokens, router, every expert kernel) and the aux loss of one
    layer on an expert=4 (x fsdp=2) mesh: those of one device; with 2 tokens (fewer rows
    than devices: the tokens are not split over ``expert``) the psum path."""
    args = _layer(t=batch)
    grad = jax.value_and_grad(_loss, argnums=range(5))
    ref = grad(*args)
    mesh = _mesh(expert=4, fsdp=fsdp)
    with jax.set_mesh(mesh):
        kernels = [jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in args[2:]]
        fn = jax.jit(grad)
        got = fn(*args[:2], *kernels)
        hlo = fn.lower(*args[:2], *kernels).as_text()
    chex.assert_trees_all_close(got, ref, atol=1e-5, rtol=1e-5)
    assert "all_gather" in hlo if batch > 2 else "all_reduce" in hlo
    assert got[1][2].sharding.spec[0] == "expert"  # the kernels' gradients stay split


def test_expert_axis_not_dividing_experts_refused():
    args = _layer(e=6)
    with jax.set_mesh(_mesh(expert=4)):
        with pytest.raises(ValueError, match="does not divide the 6 experts"):
            jax.jit(_loss)(*args)


CFG = llama.get_config("tiny_moe", num_layers=2, max_seq_len=64)


def _qlora_runs(meshes, steps=2):
    """Two QLoRA steps (NF4 experts, rank-4 adapters on every expert projection and q/v)
    of a 2-layer tiny_moe on each mesh: ``[(losses, adapters, aux)]``."""
    frozen = qlora.quantize_params(llama.init(jax.random.key(0), CFG))
    adapters = lora.init(jax.random.key(1), frozen, rank=4)
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # b starts at 0: make it count
    lv = jmem.Levers()

    def loss_fn(ad, batch, *, frozen):
        fn = qlora.apply(lambda p, b: llama.loss_fn(p, b, CFG, levers=lv))
        return fn(frozen, ad, batch)

    batches = [helpers.token_batch(CFG, 4, 16, seed=i) for i in range(steps)]
    runs = []
    for mesh in meshes:
        step = train_step(loss_fn, optax.adam(1e-2, eps=1e-4), mesh=mesh)
        state, losses = step.init(jax.tree.map(jnp.copy, adapters), frozen=frozen), []
        for b in batches:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        runs.append((losses, state))
    return runs


@pytest.mark.slow
def test_qlora_step_on_expert_mesh_equals_one_device():
    """Two train steps of QLoRA on a 2-layer tiny_moe (8 experts, NF4 expert stacks with a
    LoRA pair per expert) on an expert=4 mesh: the losses and adapters of one device
    (1e-5); the NF4 codes, scales and expert factors are split on ``E``."""
    one, ep = _qlora_runs((None, _mesh(expert=4)))
    np.testing.assert_allclose(ep[0], one[0], rtol=1e-5)
    chex.assert_trees_all_close(ep[1].params, one[1].params, atol=1e-5, rtol=1e-5)
    codes = ep[1].frozen["layers"]["expert_gate"]["kernel"].packed
    assert codes.sharding.spec[1] == "expert"
    assert {s.data.shape[1] for s in codes.addressable_shards} == {CFG.num_experts // 4}
    a = ep[1].params["layers/expert_up/kernel"].a
    assert a.sharding.spec[1] == "expert"


# ----------------------------------------------------------------------------------------
# The job: --mesh expert=N and its refusals.
# ----------------------------------------------------------------------------------------

_JOB = ["--config", "tiny_moe", "--batch-size", "4", "--seq-len", "32", "--no-progress"]
_JOB += ["--eval-split", "0"]


@pytest.mark.slow
def test_job_on_expert_mesh_gives_one_devices_losses(tmp_path):
    """``jmem finetune --config tiny_moe --steps 2 --mesh expert=4`` (QLoRA, bf16 compute):
    the losses of one device within 1e-4 relative (the reductions in another order;
    observed 2e-5)."""
    from jmem import finetune

    argv = _JOB + ["--steps", "2"]
    ep = finetune.main(argv + ["--mesh", "expert=4", "--out", str(tmp_path / "ep")])
    one = finetune.main(argv + ["--mesh", "fsdp=1", "--out", str(tmp_path / "one")])
    np.testing.assert_allclose(ep["losses"], one["losses"], rtol=1e-4)
    assert ep["mesh"] == {"data": 1, "fsdp": 1, "expert": 4}


REFUSALS = {
    "divide": (["--mesh", "expert=3"], ["expert=3", "does not divide", "8 experts"]),
    "dense": (["--config", "tiny", "--mesh", "expert=2"], ["no routed experts"]),
    "context": (["--mesh", "expert=2,context=2"], ["context axis do not combine"]),
    "batch": (["--batch-size", "2", "--mesh", "expert=4"], ["data * fsdp * expert = 4"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_job_refuses_what_an_expert_axis_cannot_split(case, tmp_path, capsys):
    """One line, before the output directory is written."""
    from jmem import finetune

    argv, words = REFUSALS[case]
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        finetune.main(_JOB + argv + ["--steps", "1", "--out", str(out)])
    helpers.one_line_error(capsys, e, *words)
    assert not out.exists()


# ----------------------------------------------------------------------------------------
# XLA:GPU compile for 8 x h100_sxm (no GPU).
# ----------------------------------------------------------------------------------------


@pytest.mark.gpu_compile
def test_expert_layer_compiles_for_8_h100_with_split_kernels():
    """XLA:GPU compile for 8 h100_sxm devices (no GPU needed): the value and gradients of
    one routed-experts layer (64 experts of 512 x 256, 8 per token, 2,048 tokens per
    device, bf16) on an expert=8 mesh compile; the program gathers the group's tokens
    (all-gather) and reduce-scatters their outputs, and each device's arguments hold 1/8
    of the expert kernels (and of the tokens) plus the replicated router."""
    reason = jmem.targets.unavailable_reason("h100_sxm")
    if reason is not None:
        pytest.skip(f"no XLA:GPU compiler here: {reason}")
    axes = ("data", "fsdp", "expert", "context")
    mesh = jmem.targets.mesh("h100_sxm", (1, 1, 8, 1), axes)
    e, h, f, t = 64, 512, 256, 8 * 2048
    spec = lambda shape, s: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.bfloat16, sharding=NamedSharding(mesh, s)
    )
    x, router = spec((t, h), P("expert")), spec((h, e), P())
    kernels = [spec((e, h, f), P("expert")), spec((e, h, f), P("expert"))]
    kernels.append(spec((e, f, h), P("expert")))

    def loss(x, router, gate, up, down):
        out, probs = moe.routed_experts(x, router, gate, up, down, top_k=8, norm_topk_prob=True)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(probs**2)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    compiled = compile_for_target(jax.jit(grad), (x, router, *kernels), {}, "h100_sxm")
    report = report_from_compiled(compiled, "h100_sxm", flops=True)
    per_device = (t * h + 3 * e * h * f) // 8 * 2 + h * e * 2
    assert report.argument_bytes == per_device
    kinds = report.collective_bytes
    assert kinds.get("all-gather", 0) > 0 and kinds.get("reduce-scatter", 0) > 0, kinds
