"""Context parallelism: one sequence split over a ``context`` mesh axis of 4 of the 8 CPU
devices of tests/conftest.py (docs/sharding.md, "Context parallelism").

Tolerances: float32 throughout; a split computation sums in another order than one device
does, so values and gradients agree to rounding (observed ~1e-7 absolute for O(1) values).
"""

import functools

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jmem
from jmem import sharding
from jmem import train_step
from jmem._src.attention import attention
from jmem._src.context_order import from_zigzag
from jmem._src.context_order import to_zigzag
from jmem._src.context_order import zigzag_order

STRATEGIES = ("all_gather", "ring", "ulysses")


def _mesh(context=4, fsdp=1, data=1):
    n = context * fsdp * data
    return sharding.make_mesh(data, fsdp, jax.devices()[:n], context=context)


def test_make_mesh_context_axis_and_errors():
    mesh = _mesh(context=2, fsdp=2)
    assert mesh.axis_names == ("data", "fsdp", "context")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 2}
    assert dict(sharding.make_mesh(2, 4).shape) == {"data": 2, "fsdp": 4, "context": 1}
    assert dict(sharding.make_mesh(context=4).shape) == {"data": 1, "fsdp": 2, "context": 4}
    with pytest.raises(ValueError, match="data \\* fsdp \\* context"):
        sharding.make_mesh(1, 3, context=2)
    with pytest.raises(ValueError, match="context must be a positive int"):
        sharding.make_mesh(context=0)


def test_zigzag_order_balances_and_round_trips():
    """Device i holds chunks i and 2N-1-i; to_zigzag is x[:, order], from_zigzag its inverse."""
    order = zigzag_order(16, 4)
    np.testing.assert_array_equal(order[:4], [0, 1, 14, 15])
    np.testing.assert_array_equal(np.sort(order), np.arange(16))
    # causal work (keys at or before each query) per device: equal
    work = [int(np.sum(order[4 * d : 4 * d + 4] + 1)) for d in range(4)]
    assert len(set(work)) == 1
    x = jnp.arange(2 * 16 * 3, dtype=jnp.float32).reshape(2, 16, 3)
    with jax.set_mesh(_mesh()):
        z = jax.jit(to_zigzag)(x)
        back = jax.jit(from_zigzag)(z)
    np.testing.assert_array_equal(z, x[:, order])
    np.testing.assert_array_equal(back, x)


def _qkv(b=2, s=64, h=4, kv=2, d=8):
    k = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(k[0], (b, s, h, d))
    kk = jax.random.normal(k[1], (b, s, kv, d))
    v = jax.random.normal(k[2], (b, s, kv, d))
    return q, kk, v, jax.random.normal(k[3], (b, s, h, d))


def _attn(q, k, v, w, seg, impl, strategy, split, **kw):
    """sum(attention * w) and the output, in the natural order; with ``split`` the inputs
    go through the zigzag order and attention runs over the context axis."""
    b, s = q.shape[:2]
    z = to_zigzag if split else (lambda x: x)
    index = z(jnp.broadcast_to(jnp.arange(s), (b, s)))
    seg = None if seg is None else z(seg)
    out = attention(
        z(q), z(k), z(v), q_index=index, segment_ids=seg, implementation=impl,
        context_strategy=strategy, block_q=8, block_kv=8, **kw,
    )  # fmt: skip
    out = from_zigzag(out) if split else out
    return jnp.sum(out * w), out


CASES = {
    "causal": {},
    "window": {"sliding_window": 20},
    "softcap": {"logit_softcap": 5.0},
    "packed": {"packed": True},
}


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["dense", "blockwise"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES)
def test_attention_over_context_equals_one_device(impl, strategy, case):
    """Each strategy on 4 devices gives one device's values and q/k/v gradients (<= 1e-5)."""
    kw = dict(CASES[case])
    q, k, v, w = _qkv(kv=4 if strategy == "ulysses" else 2)
    seg = None
    if kw.pop("packed", False):  # 3 examples per row, boundaries off the shard boundaries
        seg = jnp.asarray(np.repeat([0, 1, 2], [21, 30, 13])[None].repeat(2, 0), jnp.int32)

    def grad(split):
        f = functools.partial(_attn, seg=seg, impl=impl, strategy=strategy, split=split, **kw)
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

    (_, ref), gref = grad(False)(q, k, v, w)
    with jax.set_mesh(_mesh()):
        (_, got), g = jax.jit(grad(True))(q, k, v, w)
    chex.assert_trees_all_close(got, ref, atol=1e-5)
    chex.assert_trees_all_close(g, gref, atol=1e-5)


def test_ulysses_refuses_heads_the_axis_does_not_divide():
    q, k, v, w = _qkv(kv=2)
    with jax.set_mesh(_mesh()), pytest.raises(ValueError, match="not multiples of 4"):
        jax.jit(_attn, static_argnums=(5, 6, 7))(q, k, v, w, None, "dense", "ulysses", True)


def test_unknown_strategy_and_cudnn_refused():
    with pytest.raises(ValueError, match="choose from \\('all_gather', 'ring', 'ulysses'\\)"):
        jmem.Levers(context_strategy="zigzag")
    q, k, v, w = _qkv()
    with jax.set_mesh(_mesh()), pytest.raises(ValueError, match="context axis"):
        jax.jit(_attn, static_argnums=(5, 6, 7))(q, k, v, w, None, "cudnn", "ring", True)


def test_batch_sharding_splits_sequence_and_refuses_bad_lengths():
    mesh = _mesh(context=2, fsdp=2)
    batch = {"inputs": jnp.zeros((2, 8), jnp.int32), "weight": jnp.ones((2,))}
    placed = sharding.shard_batch(batch, mesh)
    assert placed["inputs"].sharding.spec == P(("data", "fsdp"), "context")
    assert placed["weight"].sharding.spec == P(("data", "fsdp"))
    with pytest.raises(ValueError, match="multiple of 2 \\* context = 4"):
        sharding.shard_batch({"inputs": jnp.zeros((2, 6), jnp.int32)}, mesh)


@pytest.mark.slow
def test_chunked_losses_per_device_of_the_context_split():
    """linear_cross_entropy and sequence_logprobs over chunks of each device's tokens
    (context=2 x fsdp=2, 16 tokens per device in chunks of 4) equal one device's, with
    their gradients."""
    from jmem._src.linear_cross_entropy import linear_cross_entropy
    from jmem._src.sequence_logprobs import sequence_logprobs

    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], (2, 32, 16))
    head = jax.random.normal(k[1], (16, 24))
    t = jax.random.randint(k[2], (2, 32), 0, 24)

    def f(x, head):
        lp = sequence_logprobs(x, head, t, chunk=4)
        return linear_cross_entropy(x, head, t, chunk=4) + jnp.sum(lp.sum), lp.sum

    grad = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
    ref = grad(x, head)
    with jax.set_mesh(_mesh(context=2, fsdp=2)):
        got = jax.jit(grad)(x, head)
    chex.assert_trees_all_close(got, ref, atol=1e-5, rtol=1e-5)


def _llama_runs(cfg, lv, meshes, batches):
    from jmem.models import llama

    loss = lambda p, b: llama.loss_fn(p, b, cfg, levers=lv)
    params = llama.init(jax.random.key(0), cfg)
    runs = []
    for mesh in meshes:
        step = train_step(loss, optax.adam(1e-2, eps=1e-4), mesh=mesh, levers=lv)
        state, losses = step.init(jax.tree.map(jnp.copy, params)), []
        for b in batches:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        runs.append((losses, state.params))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, balance", [(s, True) for s in STRATEGIES] + [("all_gather", False)]
)
def test_llama_train_step_on_context_mesh_matches_one_device(strategy, balance):
    """Two steps of a 2-layer Llama (GQA, packed rows, positions restarting, token and loss
    chunks) on a context=2 x fsdp=2 mesh: the losses and params of one device (zigzag
    order, and contiguous shards with ``context_load_balance=False``)."""
    cfg = helpers.small_config()
    lv = jmem.Levers(
        token_chunk=16,
        loss_chunk=16,
        attention="blockwise",
        context_strategy=strategy,
        context_load_balance=balance,
    )
    batches = []
    for i in range(2):
        b = helpers.token_batch(cfg, 2, 64, seed=i)
        seg = np.repeat([0, 1], [40, 24])[None].repeat(2, 0)
        pos = np.concatenate([np.arange(40), np.arange(24)])[None].repeat(2, 0)
        b.update(segment_ids=jnp.asarray(seg, jnp.int32), positions=jnp.asarray(pos, jnp.int32))
        batches.append(b)
    one, cp = _llama_runs(cfg, lv, (None, _mesh(context=2, fsdp=2)), batches)
    np.testing.assert_allclose(cp[0], one[0], rtol=1e-5)
    chex.assert_trees_all_close(cp[1], one[1], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# The job: --mesh context=N, --context-strategy, checkpoints across mesh shapes.
# ----------------------------------------------------------------------------------------

_JOB = ["--config", "tiny", "--batch-size", "1", "--lora-rank", "4", "--no-progress"]
_JOB += ["--lr", "3e-3", "--eval-split", "0", "--attention", "blockwise"]
_RUN = _JOB + ["--seq-len", "2048", "--steps", "4", "--save-every", "2"]


@pytest.fixture(scope="module")
def context_run(tmp_path_factory):
    """The issue's acceptance run, ``jmem finetune --config tiny --seq-len 2048 --attention
    blockwise --mesh context=4`` (the strategy left to ``auto``: ``all_gather`` at this
    length), 4 steps with each 2,048-token sequence split over 4 of the CPU devices,
    checkpoints at 2 and 4: ``(out, summary)``."""
    from jmem import finetune

    out = tmp_path_factory.mktemp("context") / "run"
    return out, finetune.main(_RUN + ["--mesh", "context=4", "--out", str(out)])


@pytest.mark.slow
def test_job_on_context_mesh_gives_one_devices_losses(context_run, tmp_path):
    """The issue's acceptance: on 4 CPU devices, ``jmem finetune --config tiny --seq-len
    2048 --attention blockwise --mesh context=4`` gives the losses of one device within
    1e-4 relative (bf16 compute, the reductions in another order)."""
    from jmem import finetune

    one = finetune.main(_RUN + ["--mesh", "fsdp=1", "--out", str(tmp_path / "one")])
    np.testing.assert_allclose(context_run[1]["losses"], one["losses"], rtol=1e-4)
    assert context_run[1]["mesh"] == {"data": 1, "fsdp": 1, "context": 4}


@pytest.mark.slow
def test_context_checkpoint_resumes_on_another_mesh_shape(context_run, tmp_path):
    """Params are replicated over ``context``: checkpoint 2 of the context=4 run resumes on
    one device and on a context=2 mesh, and continues with the context run's losses (bf16,
    another order)."""
    import shutil

    from jmem import finetune

    for spec, axes in (("fsdp=1", {"data": 1, "fsdp": 1}), ("context=2", {"context": 2})):
        out = tmp_path / spec
        shutil.copytree(context_run[0], out)
        shutil.rmtree(out / "checkpoints" / "4")
        resumed = finetune.main(_RUN + ["--mesh", spec, "--out", str(out), "--resume"])
        np.testing.assert_array_equal(resumed["losses"][:2], context_run[1]["losses"][:2])
        np.testing.assert_allclose(resumed["losses"], context_run[1]["losses"], rtol=1e-4)
        assert resumed["mesh"] == {"data": 1, "fsdp": 1, **axes}


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--offload", "params"], ["--remat", "offload_inputs"]])
def test_job_on_context_mesh_composes_with_host_offload(extra, tmp_path):
    """``--offload params`` (the NF4 base streamed per layer from host) and ``--remat
    offload_inputs`` on ``--mesh context=2``: the losses of the same mesh with everything on
    the device (1e-5 relative)."""
    from jmem import finetune

    argv = _JOB + ["--seq-len", "128", "--steps", "2", "--mesh", "context=2"]
    ref = finetune.main(argv + ["--out", str(tmp_path / "device")])["losses"]
    got = finetune.main(argv + extra + ["--out", str(tmp_path / "host")])["losses"]
    assert len(ref) == 2
    np.testing.assert_allclose(got, ref, rtol=1e-5)


REFUSALS = {
    "length": (["--seq-len", "36", "--mesh", "context=4"], ["--seq-len 36", "multiple of 8"]),
    "cudnn": (
        ["--seq-len", "64", "--mesh", "context=2", "--attention", "cudnn"],
        ["--attention cudnn", "context axis"],
    ),
    "ulysses heads": (
        ["--seq-len", "64", "--mesh", "context=8", "--context-strategy", "ulysses"],
        ["--context-strategy ulysses", "not multiples of 8"],
    ),
    "preference": (
        ["--seq-len", "64", "--mesh", "context=2", "--objective", "dpo"],
        ["--objective dpo", "[B, 2, S]"],
    ),
    "strategy": (["--context-strategy", "zigzag"], ["--context-strategy", "all_gather"]),
    "mesh spec": (["--mesh", "context=0"], ["--mesh", "context=C"]),
    "devices": (["--seq-len", "64", "--mesh", "fsdp=2,context=8"], ["needs 16 devices"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_job_refuses_what_context_cannot_split(case, tmp_path, capsys):
    from jmem import finetune

    argv, words = REFUSALS[case]
    base = [a for a in _JOB if a not in ("--attention", "blockwise")]
    with pytest.raises(SystemExit) as e:
        finetune.main(base + argv + ["--steps", "1", "--out", str(tmp_path / "o")])
    helpers.one_line_error(capsys, e, *words)
