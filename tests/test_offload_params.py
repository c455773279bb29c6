"""Tests for ``jmem.Levers(offload_params=True)``: the layer stack in ``pinned_host``,
streamed to the device layer by layer inside the scan (docs/offload.md). On XLA:CPU host
memory is the device's own, so these check values, memory kinds and program structure; the
device bytes saved are checked by XLA:GPU's compile in tests/test_gpu_compile.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmem
from jmem import lora
from jmem import qlora
from jmem._src.cli import CliError
from jmem._src.finetune import config as fc
from jmem._src.finetune import config_file
from jmem._src.finetune.config_file import parse_args
from jmem._src.offload import params as offload_params
from jmem.models import llama

CFG = llama.get_config("tiny", num_layers=2, max_seq_len=64)


@functools.cache
def _model():
    """A 2-layer tiny QLoRA model: NF4 base, nonzero rank-4 adapters, a batch of 2 x 16."""
    frozen = qlora.quantize_params(llama.init(jax.random.key(0), CFG))
    adapters = lora.init(jax.random.key(1), frozen, rank=4)
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # b starts at 0: make it count
    ids = jax.random.randint(jax.random.key(2), (2, 17), 0, CFG.vocab_size)
    return frozen, adapters, {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def _loss_fn(levers):
    def loss_fn(adapters, batch, *, frozen):
        fn = qlora.apply(lambda p, b: llama.loss_fn(p, b, CFG, levers=levers))
        return fn(frozen, adapters, batch)

    return loss_fn


def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def test_levers_reject_offload_params_without_remat():
    with pytest.raises(ValueError, match="offload_params=True needs a remat policy"):
        jmem.Levers(remat="none", offload_params=True)
    with pytest.raises(ValueError, match="offload_params must be a bool"):
        jmem.Levers(offload_params=1)
    lv = jmem.resolve_levers(jmem.Levers(remat="full", offload_params=True), CFG, (1, 16))
    assert lv.offload_params and "streamed" in lv.reason("offload_params")


@pytest.mark.slow
def test_scan_body_copies_its_layer_to_the_device():
    """The jaxpr: inside the layer scan's body one ``device_put`` to device memory per
    array of the layer (NF4 codes and absmax, norm scales, LoRA factors), each taking that
    layer's slice, never an ``[L, ...]`` stack."""
    frozen, adapters, batch = _model()
    lv = jmem.Levers(remat="full", offload_params=True)
    jaxpr = jax.make_jaxpr(functools.partial(_loss_fn(lv), frozen=frozen))(adapters, batch)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1
    body = scans[0].params["jaxpr"].jaxpr
    puts = [e for e in body.eqns if e.primitive.name == "device_put"]
    assert {d for e in puts for d in e.params["devices"]} == {jax.memory.Space.Device}
    stacks = jax.tree.leaves(frozen["layers"]) + jax.tree.leaves(adapters)
    got = sorted(str(v.aval.shape) for e in puts for v in e.invars)
    assert got == sorted(str(x.shape[1:]) for x in stacks)  # one layer's slice of each


@pytest.mark.slow
def test_streamed_loss_and_adapter_grads_equal_in_memory_run():
    """Loss and adapter gradients with the base in ``pinned_host`` and streamed per layer
    are bitwise those of the in-memory run (the same arithmetic; the copies move bytes)."""
    frozen, adapters, batch = _model()
    out = {}
    for off in (False, True):
        lv = jmem.Levers(remat="full", offload_params=off)
        fr = offload_params.params_to_host(frozen) if off else frozen
        assert _kinds(fr) == {"pinned_host" if off else "device"}
        grad = jax.jit(jax.value_and_grad(_loss_fn(lv)))
        out[off] = grad(adapters, batch, frozen=fr)
    chex.assert_trees_all_equal(out[False], out[True])


@pytest.mark.slow
def test_train_step_keeps_the_base_on_host_and_trains_bitwise():
    """``train_step(levers=Levers(offload_params=True))``: ``frozen`` in ``pinned_host``
    after init and after every step (a state restored to the device is moved back), the
    adapters and their 8-bit state on the device, and the losses and adapters of two
    steps bitwise those of the in-memory step."""
    frozen, adapters, batch = _model()
    runs = {}
    for off in (False, True):
        lv = jmem.Levers(remat="full", offload_params=off)
        step = jmem.train_step(_loss_fn(lv), jmem.adamw_8bit(1e-2), levers=lv)
        state = step.init(adapters, frozen=frozen)
        losses = []
        for i in range(2):
            if off and i == 1:  # as restored from a checkpoint into device memory
                state = state.replace(frozen=jmem.to_device(state.frozen))
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        runs[off] = (losses, state.params)
        assert _kinds(state.frozen) == {"pinned_host" if off else "device"}
        assert _kinds((state.params, state.opt_state)) == {"device"}
        assert step.offload_params is off
    chex.assert_trees_all_equal(runs[False], runs[True])
    abstract = step.abstract_state(adapters, frozen=frozen)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(abstract.frozen)} == {"pinned_host"}


def test_the_job_shards_over_every_device_with_offload_params():
    """``jmem finetune --offload params`` with no ``--mesh`` builds FSDP over all the
    devices like a run without it (no note): it no longer falls back to one device."""
    from jmem._src.finetune.mesh import job_mesh

    assert jax.device_count() > 1  # conftest: 8 host devices
    config = parse_args(["--config", "tiny", "--offload", "params", "--batch-size", "8"])
    mesh, notes = job_mesh(config)
    assert mesh is not None and mesh.size == jax.device_count() and not notes


@pytest.mark.slow
def test_the_job_streams_the_base_on_a_mesh(tmp_path):
    """``jmem finetune --offload params --mesh data=1,fsdp=2`` trains on that mesh (two
    finite losses; the values against the in-memory mesh run are checked by
    ``test_qlora_on_an_fsdp_mesh_streams_the_sharded_base_bitwise``)."""
    import json

    from jmem import finetune

    argv = ["--config", "tiny", "--batch-size", "4", "--seq-len", "16", "--lora-rank", "4"]
    argv += ["--steps", "2", "--mesh", "data=1,fsdp=2", "--offload", "params"]
    finetune.main(argv + ["--out", str(tmp_path / "r")])
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["mesh"] == {"data": 1, "fsdp": 2} and summary["devices"] == 2
    assert len(summary["losses"]) == 2 and np.isfinite(summary["losses"]).all()


def _specs(tree) -> list:
    return [x.sharding.spec for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_qlora_on_an_fsdp_mesh_streams_the_sharded_base_bitwise():
    """ZeRO-3 + offload, QLoRA: on a 4-device FSDP mesh the NF4 base lives in
    ``pinned_host`` with the ``PartitionSpec`` of the in-memory run (split by blocks over
    ``fsdp``), before and after the steps; adapters and their 8-bit state stay on the
    device; the two steps' losses and adapters are bitwise those of the same mesh in
    memory (each device copies its shard of a layer; the all-gather is the same)."""
    frozen, adapters, batch = _model()
    batch = jax.tree.map(lambda x: jnp.concatenate([x, x[::-1]]), batch)  # 4 rows: 1 a device
    mesh = jmem.sharding.make_mesh(fsdp=4, devices=jax.devices()[:4])
    runs = {}
    for off in (False, True):
        lv = jmem.Levers(remat="full", offload_params=off)
        step = jmem.train_step(_loss_fn(lv), jmem.adamw_8bit(1e-2), levers=lv, mesh=mesh)
        state = step.init(adapters, frozen=frozen)
        assert _kinds(state.frozen) == {"pinned_host" if off else "device"}
        losses = []
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        runs[off] = (losses, state.params, _specs(state.frozen))
        assert _kinds(state.frozen) == {"pinned_host" if off else "device"}
        assert _kinds((state.params, state.opt_state)) == {"device"}
    assert runs[True][2] == runs[False][2]
    assert any("fsdp" in str(spec) for spec in runs[True][2])  # the base is really split
    chex.assert_trees_all_equal(runs[False][:2], runs[True][:2])
    abstract = step.abstract_state(adapters, frozen=frozen)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(abstract.frozen)} == {"pinned_host"}
    assert _specs(abstract.frozen) == runs[True][2]


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, "optimizer"),
        (False, "none"),
        ("params", "params"),
        ("params,optimizer", "optimizer,params"),
        ("none", "none"),
    ],
)
def test_offload_flag_values(value, expected):
    """``--offload``: ``optimizer``/``params``/both (any order); true/false (old config
    files' bool) read as ``optimizer``/``none``."""
    levers = fc.ExecutionConfig(offload=value)
    assert levers.offload == expected
    assert fc.offload_of(levers).params == ("params" in expected)
    assert fc.offload_of(levers).optimizer == ("optimizer" in expected)


def test_offload_flag_on_the_command_line(tmp_path):
    parser = config_file.make_parser("jmem finetune")
    assert parser.parse_args(["--offload"]).offload == "optimizer"  # bare: as before
    assert parser.parse_args(["--offload", "params"]).offload == "params"
    path = tmp_path / "old.yaml"
    path.write_text("execution: {offload: true}\n")
    assert config_file.read_config_file(str(path))["offload"] == "optimizer"
    with pytest.raises(CliError, match="offload: expected optimizer, params"):
        fc.ExecutionConfig(offload="gpu")


@pytest.mark.slow
def test_streamed_forward_is_the_in_memory_forward():
    """``forward`` (logits) with the plain bf16 weights in host memory equals the
    in-memory forward: the embedding and head are fetched whole, the layers per layer."""
    params = llama.init(jax.random.key(0), CFG, jnp.bfloat16)
    tokens = _model()[2]["inputs"]
    lv = jmem.Levers(remat="full", offload_params=True)
    fwd = jax.jit(functools.partial(llama.forward, config=CFG))
    streamed = jax.jit(functools.partial(llama.forward, config=CFG, levers=lv))
    host = offload_params.params_to_host(params)
    np.testing.assert_array_equal(fwd(params, tokens), streamed(host, tokens))


@pytest.mark.parametrize(
    "offload, offload_dir, planner_value, job_value",
    [
        ("none", None, False, "none"),
        ("params", None, "params", "params"),
        ("optimizer", None, "optimizer", "optimizer"),
        ("optimizer,params", None, "optimizer,params", "optimizer,params"),
        ("optimizer,params", "/tmp/state", "disk,params", "optimizer,params"),
    ],
)
def test_job_offload_flags_map_to_the_planner_rungs(offload, offload_dir, planner_value, job_value):
    """The job's offload rungs (``offload_of``: ``--offload``/``--offload-dir`` as the planner's
    ``Offload``), and back: the
    ``jmem estimate --target`` compile's job flags for the planner's value."""
    from jmem._src.finetune import compiled_plan

    levers = fc.ExecutionConfig(offload=offload, offload_dir=offload_dir)
    assert fc.offload_of(levers) == jmem.planner.Offload.parse(planner_value)
    flags = compiled_plan.job_flags(
        "tiny", lora_rank=8, quant="nf4", lora_targets=None, offload=planner_value
    )
    assert flags["offload"] == job_value
