"""Leaf-by-leaf offload updating a layer stack ``[L, ...]`` one row at a time
(``jmem/_src/offload/stack_rows.py``; docs/offload.md, "Updating a layer stack row by row").

On XLA:CPU host memory is the device's own, so these check values (bitwise against the
whole-leaf update and the in-memory optimizer), the structural refusal of anything that is
not elementwise along the rows, and, in the traced program, that no whole stacked float32
leaf is copied to the device; the device bytes are the XLA:GPU compile's
(``benchmarks/zero3_offload.py``, the ``gpu_compile`` test at the end)."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

import jmem
from jmem._src.master_weights import mixed_precision
from jmem._src.offload import leaf_by_leaf as lbl
from jmem._src.offload import stack_rows
from jmem._src.offload.transform import offload
from jmem.models import llama
from tests.helpers import load_benchmark

CFG = llama.get_config("tiny", num_layers=2, max_seq_len=64)


@functools.cache
def _model():
    """fp32 params of the 2-layer tiny Llama and a batch of 4 x 16 tokens."""
    params = llama.init(jax.random.key(0), CFG)
    ids = jax.random.randint(jax.random.key(2), (4, 17), 0, CFG.vocab_size)
    return params, {"inputs": ids[:, :-1], "targets": ids[:, 1:], "scale": jnp.ones((4,))}


def _loss(params, batch):
    # ``scale`` NaN makes the step's gradients non-finite (the step is skipped).
    return llama.loss_fn(params, batch, CFG) * jnp.mean(batch["scale"])


def _spy(monkeypatch, rows: bool) -> list:
    """Counts the leaves updated row by row; ``rows=False`` forces the whole-leaf update."""
    calls = []
    run_rows = stack_rows.run_rows

    def counted(*args, **kw):
        calls.append(1)
        return run_rows(*args, **kw)

    monkeypatch.setattr(stack_rows, "run_rows", counted)
    if not rows:
        monkeypatch.setattr(lbl, "_stacked", lambda *a, **k: False)
    return calls


def _train(mode, mesh=None, steps=3, nan_at=1):
    """Params and optimizer state after each of ``steps`` steps of full fine-tuning (bf16
    params, fp32 masters, AdamW; ``mode``: the ``offload_optimizer`` value); the batch of
    step ``nan_at`` has a NaN loss scale."""
    params, batch = _model()
    step = jmem.train_step(
        _loss,
        optax.adamw(1e-2, weight_decay=0.1, mask=jmem.decay_mask),
        precision="p=bf16,c=bf16",
        master_weights=True,
        offload_optimizer=mode,
        mesh=mesh,
    )
    state = step.init(params)
    out = []
    for i in range(steps):
        scale = jnp.full((4,), jnp.nan if i == nan_at else 1.0)
        state, _ = step(state, {**batch, "scale": scale})
        out.append(jax.tree.map(np.asarray, (state.params, state.opt_state)))
    return out


def _check_runs(runs: dict, nan_at: int = 1) -> None:
    chex.assert_trees_all_equal(runs["rows"], runs["whole"])
    chex.assert_trees_all_equal(runs["rows"], runs["memory"])
    # The NaN step kept params and state bitwise; the others moved them.
    chex.assert_trees_all_equal(runs["rows"][nan_at], runs["rows"][nan_at - 1])
    assert not np.array_equal(
        runs["rows"][0][0]["layers"]["gate_proj"]["kernel"],
        runs["rows"][2][0]["layers"]["gate_proj"]["kernel"],
    )


def _runs(monkeypatch, mesh):
    runs = {}
    for name, mode, rows in (
        ("memory", False, True),
        ("whole", "leaf_by_leaf", False),
        ("rows", "leaf_by_leaf", True),
    ):
        with monkeypatch.context() as m:
            calls = _spy(m, rows)
            runs[name] = _train(mode, mesh)
        if name == "rows":
            assert calls, "no leaf was updated row by row"
        if name == "whole":
            assert not calls
    return runs


@pytest.mark.slow
def test_rows_bitwise_like_whole_leaf_and_in_memory_on_one_device(monkeypatch):
    """One device: three steps (the second with a NaN loss) of AdamW + fp32 masters give the
    same params and state, bit for bit, updated row by row, whole leaf by whole leaf, and
    in memory; the NaN step keeps everything."""
    _check_runs(_runs(monkeypatch, None))


@pytest.mark.slow
def test_rows_bitwise_like_whole_leaf_and_in_memory_on_an_fsdp_mesh(monkeypatch):
    """The same on a 4-device FSDP mesh (ZeRO-3): each device updates its shard's rows."""
    mesh = jmem.sharding.make_mesh(fsdp=4, devices=jax.devices()[:4])
    _check_runs(_runs(monkeypatch, mesh))


def _stacked_loads(jaxpr, shapes: set) -> list:
    """``device_put`` equations (in ``jaxpr`` and its sub-jaxprs) moving a float32 value of
    one of ``shapes`` from host to device memory."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put" and jax.memory.Space.Device in eqn.params["devices"]:
            found += [
                v.aval.shape
                for u, v in zip(eqn.invars, eqn.outvars)
                if v.aval.shape in shapes
                and v.aval.dtype == jnp.float32
                and getattr(u.aval, "memory_space", None) == jax.memory.Space.Host
            ]
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    found += _stacked_loads(sub.jaxpr, shapes)
                elif isinstance(sub, jcore.Jaxpr):
                    found += _stacked_loads(sub, shapes)
    return found


def _update_jaxpr(inner, params):
    opt = offload(inner, leaf_by_leaf=True)
    state = opt.init(params)
    return jax.make_jaxpr(lambda g, s, p: opt.update(g, s, p))(params, state, params).jaxpr


def test_no_whole_stacked_float32_leaf_is_copied_to_the_device(monkeypatch):
    """In the traced update (AdamW + fp32 masters) no float32 ``[L, ...]`` value (a stacked
    leaf's moments or master) is moved to the device: only rows are; with the row path
    turned off, they are (the check sees them)."""
    params = {
        "layers": {"kernel": jnp.ones((4, 8, 16), jnp.bfloat16)},
        "head": jnp.ones((16, 8), jnp.bfloat16),
    }
    stacked = {(4, 8, 16)}
    assert _stacked_loads(_update_jaxpr(mixed_precision(optax.adamw(1e-2)), params), stacked) == []
    monkeypatch.setattr(lbl, "_stacked", lambda *a, **k: False)
    whole = _stacked_loads(_update_jaxpr(mixed_precision(optax.adamw(1e-2)), params), stacked)
    assert len(whole) == 3  # m, v and the master


def _program(inner, params):
    leaves, treedef = jax.tree.flatten(params)
    state = inner.init(params)
    names = [str(k) for k in range(len(leaves))]
    return lbl._trace_program(inner, treedef, leaves, leaves, state, {}, names), state


def _separable(inner, params) -> list[bool]:
    """Per parameter leaf: whether leaf-by-leaf mode would update it row by row."""
    prog, state = _program(inner, params)
    leaves = jax.tree.leaves(params)
    s_leaves = [x for x in jax.tree.leaves(state) if hasattr(x, "shape")]
    owned = [[m for m, k in enumerate(prog.owner) if k == i] for i in range(len(leaves))]
    env = dict(prog.consts)
    for e in prog.shared:  # shared values: abstract scalars
        env.update({r: v.aval for r, v in zip(e.outs, e.eqn.outvars)})
    for m, k in enumerate(prog.owner):
        if k < 0:
            env[("in", prog.state_base + m)] = s_leaves[m]
    return [
        lbl._stacked(prog, env, i, owned[i], leaves + leaves, s_leaves) for i in range(len(leaves))
    ]


def test_row_check_accepts_elementwise_and_refuses_the_rest():
    """AdamW (+ masters) is elementwise along the rows of a stack; a per-leaf norm (LAMB's
    trust ratio), a quantized state (8-bit AdamW: codes ``[blocks, 256]``) and a leaf of
    rank < 3 are not updated row by row."""
    params = {
        "b": jnp.ones((4, 16), jnp.float32),
        "w": jnp.ones((4, 64, 128), jnp.float32),
    }
    assert _separable(optax.adamw(1e-2), params) == [False, True]
    assert _separable(mixed_precision(optax.adamw(1e-2)), params) == [False, True]
    assert _separable(optax.lamb(1e-2), params) == [False, False]
    assert _separable(jmem.adamw_8bit(1e-2), params) == [False, False]


@pytest.mark.parametrize(
    "inner",
    [
        pytest.param(lambda: jmem.adamw_8bit(1e-2), id="adamw_8bit"),
        pytest.param(lambda: optax.lamb(1e-2), id="lamb"),
    ],
)
def test_leaves_that_are_not_row_separable_keep_the_whole_leaf_update(monkeypatch, inner):
    """An optimizer whose per-leaf update is not elementwise along the rows (8-bit AdamW's
    block-quantized state, LAMB's per-leaf norm) is updated whole leaf by whole leaf, with
    the in-memory optimizer's values."""
    params = {
        "b": jnp.full((4, 16), 0.5, jnp.float32),
        "w": jax.random.normal(jax.random.key(0), (4, 64, 128)),
    }
    grads = jax.tree.map(lambda p: jnp.sin(3 * p) + 0.1, params)
    calls = _spy(monkeypatch, rows=True)
    opt = offload(inner(), leaf_by_leaf=True)
    ref = inner()
    state, ref_state = opt.init(params), ref.init(params)
    step, ref_step = jax.jit(opt.update), jax.jit(ref.update)
    for _ in range(2):
        u, state = step(grads, state, params)
        ref_u, ref_state = ref_step(grads, ref_state, params)
    assert not calls
    chex.assert_trees_all_equal(u, ref_u)
    chex.assert_trees_all_equal(jax.device_get(state), jax.device_get(ref_state))


def _driver():
    """benchmarks/full_ft_offload.py, loaded by path (its ``build`` and ``stacked_on_device``)."""
    return load_benchmark("full_ft_offload")


def _buffers_text(hlo: str) -> str:
    """``hlo`` without the bodies of fusions (their values get no buffer of their own)."""
    fused = set(re.findall(r"kind=k\w+, calls=(%[\w.\-]+)", hlo))
    keep, skip = [], False
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            skip = head.group(1) in fused
        if not skip:
            keep.append(line)
    return "\n".join(keep)


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_zero3_update_holds_no_whole_stacked_float32_leaf_on_the_device(monkeypatch):
    """XLA:GPU compile for h100_sxm (no GPU) of the tiny ZeRO-3 step over 8 devices with
    AdamW + fp32 masters offloaded leaf by leaf (``benchmarks/zero3_offload.py``'s
    ``optimizer`` rung): no device buffer has the float32 shape of a device's shard of a
    stacked leaf (the masters and moments are in host memory, ``S(5)``, and only rows come
    to the device; values inside fusions, which get no buffer, are not looked at). With the
    whole-leaf update the same check finds such buffers."""
    reason = jmem.targets.unavailable_reason("h100_sxm")
    if reason:
        pytest.skip(f"no XLA:GPU compiler here: {reason}")
    from jmem._src.measure import _compile_for  # noqa: PLC0415

    driver = _driver()
    found = {}
    for rows in (True, False):
        with monkeypatch.context() as m:
            _spy(m, rows)
            step, state, batch, _ = driver.build(
                "tiny", 256, "adamw", masters=True, streamed=False, fsdp=8, target="h100_sxm"
            )
            compiled = _compile_for(step.jitted, jmem.targets.get("h100_sxm"), (state, batch), {})
        text = compiled.as_text()
        shards = {  # a device's shard of each stacked master and moment
            "f32[" + ",".join(map(str, x.sharding.shard_shape(x.shape))) + "]"
            for x in jax.tree.leaves(state.opt_state)
            if x.ndim >= 3 and x.dtype == jnp.float32
        }
        assert shards and all(s in text for s in shards)  # the shapes are there, on host
        found[rows] = driver.stacked_on_device(_buffers_text(text), sorted(shards))
    assert found[True] == []
    assert found[False]
