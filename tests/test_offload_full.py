"""Full-parameter training with the trainable params and the optimizer state in host memory
(``Levers(offload_params=True)`` without a frozen base, plus ``offload_optimizer``;
docs/offload.md). On XLA:CPU host memory is the device's own: these check values and memory
kinds; the device bytes are checked by the XLA:GPU compile test at the end."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmem
from jmem._src.offload import params as offload_params
from jmem.models import llama
from tests.helpers import load_benchmark

CFG = llama.get_config("tiny", num_layers=2, max_seq_len=64)


@functools.cache
def _model():
    """fp32 params of the 2-layer tiny Llama and a batch of 2 x 16 tokens."""
    params = llama.init(jax.random.key(0), CFG)
    ids = jax.random.randint(jax.random.key(2), (2, 17), 0, CFG.vocab_size)
    return params, {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def _driver():
    """benchmarks/full_ft_offload.py, loaded by path (the step it builds is the figure's)."""
    return load_benchmark("full_ft_offload")


def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.slow
def test_gradients_of_host_params_are_host_arrays_and_bitwise():
    """The layer scan's transposed accumulation of a host-resident stack: every gradient
    leaf comes back in ``pinned_host`` (the stacked ``[L, ...]`` ones included) and equals
    the in-memory gradient bit for bit."""
    params, batch = _model()
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    out = {}
    for off in (False, True):
        lv = jmem.Levers(remat="full", offload_params=off)
        loss = jmem.remat(lambda p, b, lv=lv: llama.loss_fn(p, b, CFG, levers=lv), "full")
        p = offload_params.params_to_host(params) if off else params
        out[off] = jax.jit(jax.value_and_grad(loss))(p, batch)
    assert _kinds(out[True][1]) == {"pinned_host"}
    chex.assert_trees_all_equal(*(jax.tree.map(np.asarray, out[k]) for k in (False, True)))


@pytest.mark.slow
def test_streamed_norm_and_finite_match_the_whole_tree_reductions():
    """``streamed_norm_and_finite`` reads host layer stacks one layer at a time: the norm
    equals ``optax.tree.norm`` to float32 rounding, the finite check exactly."""
    params, _ = _model()
    host = offload_params.params_to_host(params)
    norm, finite = jax.jit(offload_params.streamed_norm_and_finite)(host)
    np.testing.assert_allclose(norm, optax.tree.norm(params), rtol=1e-6)
    assert bool(finite)
    bad = {**params, "final_norm": {"scale": params["final_norm"]["scale"].at[3].set(jnp.nan)}}
    assert not bool(jax.jit(offload_params.streamed_norm_and_finite)(bad)[1])
    layer_nan = jax.tree.map(lambda x: x, params)
    k = layer_nan["layers"]["up_proj"]["kernel"]
    layer_nan["layers"]["up_proj"]["kernel"] = k.at[1, 0, 0].set(jnp.inf)
    host_nan = offload_params.params_to_host(layer_nan)
    assert not bool(jax.jit(offload_params.streamed_norm_and_finite)(host_nan)[1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer, mode, masters",
    [("adamw_8bit", "leaf_by_leaf", True), ("adamw", True, False)],
)
def test_full_fine_tuning_with_host_params_and_state_trains_bitwise(optimizer, mode, masters):
    """Three steps of full fine-tuning with the params streamed from host memory and the
    optimizer state (8-bit moments and fp32 masters, or optax's fp32 moments) in host
    memory: losses and params bitwise those of the in-memory run; params and state stay in
    ``pinned_host`` (a state restored to the device is moved back)."""
    params, batch = _model()
    runs = {}
    for off in (False, True):
        lv = jmem.Levers(remat="full", offload_params=off)
        opt = jmem.adamw_8bit(1e-2) if optimizer == "adamw_8bit" else optax.adamw(1e-2)
        kw = dict(precision="p=bf16,c=bf16", master_weights=True) if masters else {}
        loss = functools.partial(llama.loss_fn, config=CFG, levers=lv)
        step = jmem.train_step(loss, opt, levers=lv, offload_optimizer=mode, **kw)
        state = step.init(params)
        losses, norms = [], []
        for i in range(3):
            if off and i == 1:  # as restored from a checkpoint into device memory
                state = state.replace(params=jmem.to_device(state.params))
            state, metrics = step(state, batch)
            losses.append(np.asarray(metrics["loss"]))
            norms.append(np.asarray(metrics["grad_norm"]))
        runs[off] = (losses, jax.tree.map(np.asarray, state.params), norms)
        assert _kinds(state.params) == {"pinned_host" if off else "device"}
        assert _kinds(state.opt_state) == {"pinned_host"}
    chex.assert_trees_all_equal(runs[False][:2], runs[True][:2])
    # The streamed norm sums in float32 per layer; the in-memory one in bf16 per leaf.
    np.testing.assert_allclose(*(np.float32(runs[k][2]) for k in (False, True)), rtol=1e-2)


@pytest.mark.slow
def test_zero3_with_host_params_and_8bit_state_on_a_mesh_trains_bitwise():
    """ZeRO-3 + offload, full fine-tuning: on a 4-device FSDP mesh, bf16 params streamed
    from ``pinned_host`` (their FSDP ``PartitionSpec`` kept), 8-bit moments and fp32 masters
    in ``pinned_host`` updated leaf by leaf: two steps' losses and params are bitwise those
    of the same mesh with params on the device (and the state still offloaded), and the
    params keep the in-memory run's specs after init and after the steps."""
    params, batch = _model()
    batch = jax.tree.map(lambda x: jnp.concatenate([x, x[::-1]]), batch)  # 4 rows: 1 a device
    mesh = jmem.sharding.make_mesh(fsdp=4, devices=jax.devices()[:4])
    runs = {}
    for off in (False, True):
        step = _full_step(off, mesh=mesh)
        state = step.init(params)
        specs = [x.sharding.spec for x in jax.tree.leaves(state.params)]
        losses = []
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(np.asarray(metrics["loss"]))
        assert [x.sharding.spec for x in jax.tree.leaves(state.params)] == specs
        runs[off] = (losses, jax.tree.map(np.asarray, state.params), specs)
        assert _kinds(state.params) == {"pinned_host" if off else "device"}
        assert _kinds(state.opt_state) == {"pinned_host"}
    assert runs[True][2] == runs[False][2]
    assert any("fsdp" in str(spec) for spec in runs[True][2])  # the params are really split
    chex.assert_trees_all_equal(runs[False][:2], runs[True][:2])


def _full_step(off: bool, microbatches: int = 1, mesh=None):
    """The job's full fine-tuning step: bf16 params (streamed from host memory with
    ``off``), 8-bit moments and fp32 masters in host memory, updated leaf by leaf."""
    lv = jmem.Levers(remat="full", offload_params=off)
    loss = functools.partial(llama.loss_fn, config=CFG, levers=lv)
    return jmem.train_step(
        loss,
        jmem.adamw_8bit(1e-2),
        levers=lv,
        offload_optimizer="leaf_by_leaf",
        precision="p=bf16,c=bf16",
        master_weights=True,
        microbatches=microbatches,
        mesh=mesh,
    )


def test_a_host_struct_on_one_device_compiles_as_a_host_value():
    """``jmem.measure`` (the dry run's compile) traces a ``ShapeDtypeStruct`` on one device
    in ``pinned_host`` in host memory, as JAX traces the array it stands for (JAX itself
    traces such a struct in device memory)."""
    seen = []

    def f(x):
        seen.append(jax.typeof(x).memory_space)
        return x * 2

    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    jmem.measure(f, jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=host))
    assert seen == [jax.memory.Space.Host]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_gradient_accumulation_with_host_params_is_the_in_memory_accumulation(devices):
    """``microbatches=2`` with the params (so the gradients) in host memory: the accumulator
    stays in host memory, and two steps' losses and params are bitwise those of the
    in-memory accumulation (one device, and a 2-device FSDP mesh); one microbatch of the
    whole batch gives the same losses to the rounding of bf16 compute."""
    params, batch = _model()
    batch = jax.tree.map(lambda x: jnp.concatenate([x, x[::-1]]), batch)  # 4 rows
    mesh = None
    if devices > 1:
        mesh = jmem.sharding.make_mesh(fsdp=devices, devices=jax.devices()[:devices])
    runs = {}
    for off, microbatches in ((False, 2), (True, 2), (False, 1)):
        step = _full_step(off, microbatches, mesh)
        state, losses = step.init(params), []
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(np.asarray(metrics["loss"]))
        runs[off, microbatches] = (losses, jax.tree.map(np.asarray, state.params))
        assert _kinds(state.params) == {"pinned_host" if off else "device"}
    chex.assert_trees_all_equal(runs[False, 2], runs[True, 2])
    np.testing.assert_allclose(runs[True, 2][0], runs[False, 1][0], rtol=2e-3)


@pytest.mark.slow
def test_a_host_state_restored_on_one_device_trains_on_bitwise(tmp_path):
    """A checkpoint of the host-resident state restored on one device (into the fresh
    state, as the job does): every host leaf is traced in host memory, so the step
    compiled for it (called as the job calls it, without ``TrainStep``'s moves) returns
    the params in host memory again, and two more steps give the uninterrupted losses."""
    params, batch = _model()
    step = _full_step(True)
    state, _ = step(step.init(params), batch)
    ck = jmem.Checkpointer(str(tmp_path / "ck"), save_every=1)
    ck.save(1, state)
    ck.wait()
    restored, _ = ck.restore(step.init(params))
    ck.close()
    host = [x for x in jax.tree.leaves(restored) if x.sharding.memory_kind == "pinned_host"]
    assert len(host) > len(jax.tree.leaves(restored.params))
    assert {jax.typeof(x).memory_space for x in host} == {jax.memory.Space.Host}
    compiled = step.jitted.lower(restored, batch).compile()
    out_kinds = {s.memory_kind for s in jax.tree.leaves(compiled.output_shardings[0].params)}
    assert out_kinds == {"pinned_host"}
    runs = []
    for s, run in ((state, step), (restored, compiled)):
        losses = []
        for _ in range(2):
            s, metrics = run(s, batch)
            losses.append(np.asarray(metrics["loss"]))
        runs.append((losses, jax.tree.map(np.asarray, s.params)))
    chex.assert_trees_all_equal(*runs)


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_full_fine_tuning_step_on_the_target_keeps_params_and_grads_in_host_memory():
    """XLA:GPU compile for h100_sxm (no GPU) of the tiny full fine-tuning step (bf16 params,
    8-bit AdamW leaf by leaf, full remat): params and optimizer state are host arguments
    (their bytes exactly), the device arguments are the batch and scalars only, the device
    peak is below the in-memory step's by more than the params' bytes, and the backward
    loop carries the stacked gradients only in host memory (``S(5)``)."""
    reason = jmem.targets.unavailable_reason("h100_sxm")
    if reason:
        pytest.skip(f"no XLA:GPU compiler here: {reason}")
    build = _driver().build
    from jmem._src.measure import _compile_for  # noqa: PLC0415
    from jmem._src.measure import report_from_compiled  # noqa: PLC0415

    target = jmem.targets.get("h100_sxm")
    step, state, batch, _ = build("tiny", 256)
    compiled = _compile_for(step.jitted, target, (state, batch), {})
    report = report_from_compiled(compiled, "h100_sxm")
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
    assert report.host_argument_bytes == param_bytes + opt_bytes
    assert report.argument_bytes < 4096  # tokens and the step counter
    plain = build("tiny", 256, streamed=False)
    plain_report = plain[0].measure(plain[1], plain[2], target="h100_sxm")
    assert report.peak_bytes + param_bytes < plain_report.peak_bytes
    stacked = {
        f"bf16[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(state.params["layers"])
    }
    loops = [ln for ln in compiled.as_text().splitlines() if " while(" in ln and "transpose" in ln]
    assert loops
    for line in loops:  # the backward loop's stacked gradient accumulators
        for s in stacked:
            for hit in line.split(s + "{")[1:]:
                assert hit.split("}")[0].endswith("S(5)"), line[:200]


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_zero3_offload_step_compiles_for_8_devices_with_host_params_and_state():
    """XLA:GPU compile for 8 h100_sxm devices (no GPU) of the tiny full fine-tuning step
    with ZeRO-3 + offload (bf16 params streamed per layer, 8-bit AdamW leaf by leaf): each
    device's host arguments are its shards of the params and the state (an eighth of the
    split leaves), the device arguments are the batch and scalars, and each device's shard
    of every split stacked param is a host (``S(5)``) parameter of the program."""
    reason = jmem.targets.unavailable_reason("h100_sxm")
    if reason:
        pytest.skip(f"no XLA:GPU compiler here: {reason}")
    driver = _driver()
    from jmem._src.measure import _compile_for  # noqa: PLC0415
    from jmem._src.measure import report_from_compiled  # noqa: PLC0415

    step, state, batch, _ = driver.build("tiny", 256, fsdp=8)
    compiled = _compile_for(step.jitted, jmem.targets.get("h100_sxm"), (state, batch), {})
    report = report_from_compiled(compiled, "h100_sxm")

    def shard_bytes(tree):
        return sum(
            x.size * x.dtype.itemsize // (8 if "fsdp" in str(x.sharding.spec) else 1)
            for x in jax.tree.leaves(tree)
        )

    host = shard_bytes(state.params) + shard_bytes(state.opt_state)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"pinned_host"}
    np.testing.assert_allclose(report.host_argument_bytes, host, rtol=0.02)
    assert report.argument_bytes < 4096  # tokens and the step counter
    layers = [x for x in jax.tree.leaves(state.params["layers"]) if "fsdp" in str(x.sharding.spec)]
    assert layers
    text = compiled.as_text()
    # Not asserted: XLA's SPMD partitioner all-gathers some whole stacks on the device in
    # this ZeRO-3 step with or without offload (docs/offload.md, "ZeRO-3 + offload").
    params = [ln for ln in text.splitlines() if " parameter(" in ln]
    for x in layers:  # the device's shard of each stacked param: a host parameter
        shard = list(x.shape)
        shard[list(x.sharding.spec).index("fsdp")] //= 8
        s = f"= bf16[{','.join(map(str, shard))}]{{"
        layouts = [ln.split(s)[1].split("}")[0] for ln in params if s in ln]
        assert any(lay.endswith("S(5)") for lay in layouts), (s, layouts)


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_zero3_step_without_offload_holds_no_second_copy_of_the_sharded_state():
    """XLA:GPU compile for 8 h100_sxm devices (no GPU) of a ZeRO-3 full
    fine-tuning step without offload (2 layers of Llama-2-7B's width, fp32 AdamW + masters,
    bf16 params): the device temporaries stay below the device's shard of the state (its
    arguments). With the non-finite skip as a ``lax.cond`` the SPMD program copied every
    shard the cond passed through: 612 MB of temporaries for 536 MB of arguments (now 281)."""
    reason = jmem.targets.unavailable_reason("h100_sxm")
    if reason:
        pytest.skip(f"no XLA:GPU compiler here: {reason}")
    from jmem._src.measure import _compile_for  # noqa: PLC0415
    from jmem._src.measure import report_from_compiled  # noqa: PLC0415

    width = dict(hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32)
    cfg = llama.get_config("tiny", num_layers=2, **width)
    lv = jmem.Levers(remat="full")
    step = jmem.train_step(
        functools.partial(llama.loss_fn, config=cfg, levers=lv),
        optax.adamw(1e-5),
        levers=lv,
        precision="p=bf16,c=bf16",
        master_weights=True,
        mesh=jmem.targets.mesh("h100_sxm", (1, 8), ("data", "fsdp")),
    )
    state = step.abstract_state(llama.abstract_params(cfg))
    tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    compiled = _compile_for(step.jitted, jmem.targets.get("h100_sxm"), (state, batch), {})
    report = report_from_compiled(compiled, "h100_sxm")
    state_bytes = sum(  # this device's shards of the params and the optimizer state
        x.size * x.dtype.itemsize // (8 if "fsdp" in str(x.sharding.spec) else 1)
        for x in jax.tree.leaves((state.params, state.opt_state))
    )
    np.testing.assert_allclose(report.argument_bytes, state_bytes, rtol=0.01)
    assert report.temp_bytes < state_bytes, (report.temp_bytes, state_bytes)
