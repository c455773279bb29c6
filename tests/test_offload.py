"""Tests for jmem.offload: host-offloaded optimizer state via memory kinds.

CPU devices address memories ``device``, ``pinned_host`` and ``unpinned_host``, so values,
memory kinds, shardings, donation and checkpointing are checked here; the memory savings
need an accelerator (benchmarks/offload_gpu.py).
"""
import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jmem.offload import abstract_like, offload, to_device, to_host

off = importlib.import_module("jmem.offload")  # `jmem.offload` the attribute is the function

HOST = "pinned_host"
DEVICE = "device"


def _kinds(tree):
  return [x.sharding.memory_kind for x in jax.tree.leaves(tree)]


def _assert_kind(tree, kind):
  kinds = _kinds(tree)
  assert kinds, "tree has no array leaves"
  assert all(k == kind for k in kinds), kinds


def _params(key, dtype=jnp.float32):
  # Leaves of >= 4096 elements so that 8-bit optimizers quantize them (block-wise).
  k1, k2 = jax.random.split(key)
  return {
      "w1": (jax.random.normal(k1, (64, 128)) * 0.1).astype(dtype),
      "b1": jnp.zeros((128,), dtype),
      "w2": (jax.random.normal(k2, (128, 64)) * 0.1).astype(dtype),
  }


def _batch(key):
  kx, ky = jax.random.split(key)
  return jax.random.normal(kx, (8, 64)), jax.random.normal(ky, (8, 64))


def _loss(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["w1"].astype(jnp.float32) + params["b1"].astype(jnp.float32))
  return jnp.mean((h @ params["w2"].astype(jnp.float32) - y) ** 2)


def _elementwise_loss(params, scale):
  # No matmuls: valid for any parameter sharding, also with Explicit mesh axes.
  return sum(jnp.mean((jnp.sin(p) - scale) ** 2) for p in jax.tree.leaves(params))


def _make_step(opt, loss_fn=_loss):
  def step(state, params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = opt.update(grads, state, params)
    return state, optax.apply_updates(params, updates), grads, loss
  # As the train-step builder will use it: state donated, passed in and out.
  return jax.jit(step, donate_argnums=0)


def _train(opt, params, num_steps, check_kinds=False):
  step = _make_step(opt)
  state = opt.init(params)
  if check_kinds:
    _assert_kind(state, HOST)
  losses = []
  for i in range(num_steps):
    state, params, grads, loss = step(state, params, _batch(jax.random.key(100)))
    losses.append(loss)
    if check_kinds:
      _assert_kind(state, HOST)
      _assert_kind(params, DEVICE)
      _assert_kind(grads, DEVICE)
  return state, params, jnp.stack(losses)


def _inner_optimizers():
  """(name, factory or skip reason) for every optimizer offload must compose with."""
  f32, bf16 = jnp.float32, jnp.bfloat16
  cases = [("optax_adamw", lambda: optax.adamw(1e-2, weight_decay=0.1), f32, None)]
  try:
    optimizers = importlib.import_module("jmem.optimizers")
    fn = getattr(optimizers, "adamw_8bit")
    cases.append(("jmem_adamw_8bit", lambda: fn(1e-2), f32, None))
  except (ImportError, AttributeError) as e:
    cases.append(("jmem_adamw_8bit", None, f32, f"jmem.optimizers.adamw_8bit missing: {e}"))
  try:
    mw = importlib.import_module("jmem.master_weights")
    mp = getattr(mw, "mixed_precision")
    # bf16 params, fp32 masters in the state: offloading moves the masters too.
    cases.append(("mixed_precision_adamw", lambda: mp(optax.adamw(1e-2)), bf16, None))
  except (ImportError, AttributeError) as e:
    cases.append(("mixed_precision_adamw", None, bf16,
                  f"jmem.master_weights.mixed_precision missing: {e}"))
  return [pytest.param(f, d, r, id=n) for n, f, d, r in cases]


@pytest.mark.parametrize("factory,dtype,skip_reason", _inner_optimizers())
def test_training_bitwise_identical_and_state_on_host(factory, dtype, skip_reason):
  if skip_reason:
    pytest.skip(skip_reason)
  params = _params(jax.random.key(0), dtype)
  ref_state, ref_params, ref_losses = _train(factory(), params, num_steps=3)
  state, new_params, losses = _train(offload(factory()), params, num_steps=3,
                                     check_kinds=True)
  chex.assert_trees_all_equal(losses, ref_losses)
  chex.assert_trees_all_equal(new_params, ref_params)
  # Same state structure as the inner optimizer (no wrapper), same values bit for bit.
  chex.assert_trees_all_equal_structs(state, ref_state)
  chex.assert_trees_all_equal(jax.device_get(state), jax.device_get(ref_state))
  assert float(losses[-1]) < float(losses[0])
  if dtype == jnp.bfloat16:  # the fp32 masters are part of the state, so on host too
    masters = [x for x in jax.tree.leaves(state)
               if x.dtype == jnp.float32 and x.shape == params["w1"].shape]
    assert masters and all(m.sharding.memory_kind == HOST for m in masters)


def test_offload_state_dtypes_and_shapes_match_inner():
  params = _params(jax.random.key(1))
  inner = optax.adamw(1e-3)
  ref = inner.init(params)
  state = offload(inner).init(params)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, ref)
  _assert_kind(state, HOST)


def test_init_under_jit_places_state_on_host():
  params = _params(jax.random.key(2))
  state = jax.jit(offload(optax.adam(1e-3)).init)(params)
  _assert_kind(state, HOST)
  chex.assert_trees_all_equal(jax.device_get(state),
                              jax.device_get(optax.adam(1e-3).init(params)))


def test_extra_args_and_chains_pass_through():
  params = _params(jax.random.key(3))
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  grads = jax.tree.map(jnp.ones_like, params)
  opt = offload(inner)
  state = opt.init(params)
  upd, state = jax.jit(lambda g, s, p: opt.update(g, s, p, unused_extra=1))(
      grads, state, params)
  ref_upd, _ = inner.update(grads, inner.init(params), params)
  chex.assert_trees_all_close(upd, ref_upd, rtol=1e-6, atol=0)
  _assert_kind(state, HOST)
  _assert_kind(upd, DEVICE)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_named_sharding_state_keeps_spec_on_host(axis_type):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  specs = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data")}
  params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                        _params(jax.random.key(4)), specs)
  opt = offload(optax.adamw(1e-2))
  ref_opt = optax.adamw(1e-2)
  step = _make_step(opt, _elementwise_loss)
  ref_step = _make_step(ref_opt, _elementwise_loss)
  state, ref_state = opt.init(params), ref_opt.init(params)
  ref_params = params
  with jax.set_mesh(mesh):
    for i in range(2):
      batch = jnp.float32(0.1 * (i + 1))
      state, params, grads, _ = step(state, params, batch)
      ref_state, ref_params, _, _ = ref_step(ref_state, ref_params, batch)
      _assert_kind(state, HOST)
      _assert_kind(params, DEVICE)
      for tree in (state[0].mu, state[0].nu):
        for name, x in tree.items():
          assert isinstance(x.sharding, NamedSharding), x.sharding
          assert x.sharding.mesh.shape == mesh.shape
          assert x.sharding.spec == specs[name], (name, x.sharding.spec)
      # Scalar count: replicated over the mesh (not committed to device 0).
      assert len(state[0].count.sharding.device_set) == 8
  chex.assert_trees_all_equal(jax.device_get(params), jax.device_get(ref_params))
  chex.assert_trees_all_equal(jax.device_get(state), jax.device_get(ref_state))


def test_orbax_save_restore_keeps_memory_kind_and_values(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))),
                        _params(jax.random.key(5)))
  opt = offload(optax.adamw(1e-2))
  step = _make_step(opt)
  state = opt.init(params)
  state, params, _, _ = step(state, params, _batch(jax.random.key(0)))
  expected = jax.device_get(state)
  target = abstract_like(state)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "opt_state", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "opt_state", target)
  ckpt.close()
  _assert_kind(restored, HOST)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert a.sharding == b.sharding, (a.sharding, b.sharding)
  chex.assert_trees_all_equal(jax.device_get(restored), expected)
  # Training continues identically from the restored state.
  batch = _batch(jax.random.key(1))
  s1, p1, _, _ = step(restored, params, batch)
  s2, p2, _, _ = step(state, params, batch)
  chex.assert_trees_all_equal(jax.device_get((s1, p1)), jax.device_get((s2, p2)))
  _assert_kind(s1, HOST)


def test_abstract_like_carries_memory_kind():
  x = to_host({"a": jnp.ones((3, 2), jnp.bfloat16), "n": None})
  abstract = abstract_like(x)
  assert abstract["a"].shape == (3, 2) and abstract["a"].dtype == jnp.bfloat16
  assert abstract["a"].sharding.memory_kind == HOST
  assert abstract["n"] is None


class ToHostToDeviceTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_roundtrip_keeps_values_and_dtypes(self):
    tree = {"codes": jnp.arange(512, dtype=jnp.uint8).reshape(2, 256),
            "absmax": jnp.linspace(0.5, 2.0, 2, dtype=jnp.float32),
            "count": jnp.zeros((), jnp.int32)}
    host = self.variant(to_host)(tree)
    _assert_kind(host, HOST)
    back = self.variant(to_device)(host)
    _assert_kind(back, DEVICE)
    chex.assert_trees_all_equal(back, tree)
    chex.assert_trees_all_equal_shapes_and_dtypes(host, tree)

  @chex.variants(with_jit=True, without_jit=True)
  def test_keeps_named_sharding(self):
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("b", "a")))
    host = self.variant(to_host)(x)
    assert host.sharding.memory_kind == HOST
    assert host.sharding.spec == P("b", "a")
    back = self.variant(to_device)(host)
    assert back.sharding.memory_kind == DEVICE
    assert back.sharding.spec == P("b", "a")
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))

  def test_non_array_leaves_pass_through(self):
    tree = (None, 3, optax.EmptyState(), np.ones(3, np.float32))
    host = to_host(tree)
    assert host[0] is None and host[1] == 3 and host[2] == optax.EmptyState()
    assert host[3].sharding.memory_kind == HOST

  def test_unpinned_host_outside_jit_only(self):
    x = jnp.ones((4,))
    assert to_host(x, "unpinned_host").sharding.memory_kind == "unpinned_host"
    with self.assertRaisesRegex(ValueError, "inside jit"):
      jax.jit(lambda a: to_host(a, "unpinned_host"))(x)


def test_bad_memory_kind_lists_available_kinds():
  available = [m.kind for m in jax.devices()[0].addressable_memories()]
  assert set(off.memory_kinds()) == set(available)
  params = _params(jax.random.key(6))
  with pytest.raises(ValueError) as e:
    to_host(params, "hbm")
  for kind in available:
    assert repr(kind) in str(e.value)
  with pytest.raises(ValueError, match="'pinned_host'"):
    offload(optax.adam(1e-3), memory_kind="hbm")
  with pytest.raises(ValueError, match="unpinned_host.*not supported"):
    offload(optax.adam(1e-3), memory_kind="unpinned_host")
  with pytest.raises(TypeError, match="memory_kind must be a str"):
    offload(optax.adam(1e-3), memory_kind=None)
  with pytest.raises(TypeError, match="memory_kind must be a str"):
    to_host(params, 5)
  with pytest.raises(TypeError, match="GradientTransformation"):
    offload(lambda x: x)


def test_backend_without_memory_kind_raises_at_init(monkeypatch):
  # Simulates a backend whose devices address only "device" (as some plugins do).
  class _Mem:
    kind = "device"

  class _Dev:
    platform = "fake"
    def addressable_memories(self):
      return [_Mem()]
    def __repr__(self):
      return "FakeDevice(0)"

  monkeypatch.setattr(off.jax, "local_devices", lambda: [_Dev()])
  opt = offload(optax.adam(1e-3))
  with pytest.raises(ValueError, match=r"pinned_host.*\['device'\]"):
    opt.init({"w": np.ones(3, np.float32)})


def test_device_memory_kind_is_a_no_op_switch():
  params = _params(jax.random.key(7))
  state = offload(optax.adam(1e-3), memory_kind=DEVICE).init(params)
  _assert_kind(state, DEVICE)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_keeps_old_state_on_device_side(skip):
  params = _params(jax.random.key(8))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  inner = optax.adamw(1e-2)
  opt = offload(inner)
  state = opt.init(params)
  before = jax.device_get(state)
  upd, new_state = jax.jit(lambda g, s, p, k: opt.update(g, s, p, skip=k))(
      grads, state, params, jnp.bool_(skip))
  _assert_kind(new_state, HOST)
  if skip:
    chex.assert_trees_all_equal(jax.device_get(new_state), before)
    chex.assert_trees_all_equal(upd, jax.tree.map(jnp.zeros_like, params))
  else:
    ref_upd, ref_state = inner.update(grads, inner.init(params), params)
    chex.assert_trees_all_equal(jax.device_get(new_state), jax.device_get(ref_state))
    chex.assert_trees_all_close(upd, ref_upd, rtol=1e-6, atol=0)
  with pytest.raises(TypeError, match="scalar bool"):
    opt.update(grads, state, params, skip=jnp.ones((2,), bool))

