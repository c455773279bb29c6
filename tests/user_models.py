"""Small transformers written the way users write them, in three styles, for the tests and
benchmark of ``jmem.remat`` on user code (``tests/test_remat_user_code.py``,
``benchmarks/remat.py``):

- ``"nnx"``: Flax NNX, layers created with ``nnx.vmap`` and run with ``nnx.scan``; the step
  updates an ``nnx.Optimizer`` in place;
- ``"linen"``: Flax linen, layers stacked by ``nn.scan``;
- ``"jax"``: plain JAX, stacked layer params run by ``lax.scan`` (``"jax_unrolled"``: the
  same params run by a Python loop).

Each block: pre-norm causal attention (one head per 32 features) and a GELU MLP whose
hidden activation is tagged ``checkpoint_name(h, "mlp_hidden")``; the model: embedding,
blocks, final norm (``ln_f``) and output projection (``head``) under those name scopes.
``make(style, ...)`` returns a ``UserModel`` whose ``step(policy, where, **remat_kw)`` is a functional
train step (AdamW update inside) with ``jmem.remat`` around the whole step
(``where="step"``), around the loss inside it (``"loss"``) or nowhere (``"none"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

import jmem

STYLES = ("nnx", "linen", "jax")


def _attention(q, k, v):
    b, s, d = q.shape
    h = max(d // 32, 1)
    q, k, v = (t.reshape(b, s, h, d // h) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h)
    mask = jnp.tril(jnp.ones((s, s), bool))
    p = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, d)


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _block(x, w):
    """One block on plain params ``w`` (dict of ``[D, D]`` q/k/v/o, ``[D, F]`` up, ``[F, D]``
    down)."""
    h = _norm(x)
    x = x + _attention(h @ w["wq"], h @ w["wk"], h @ w["wv"]) @ w["wo"]
    h = checkpoint_name(jax.nn.gelu(_norm(x) @ w["up"]), "mlp_hidden")
    return x + h @ w["down"]


def _cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _head(x, w_head):
    with jax.named_scope("ln_f"):
        x = _norm(x)
    with jax.named_scope("head"):
        return x @ w_head


@dataclasses.dataclass
class UserModel:
    """A model in one style: ``state`` (arrays pytree: params and optimizer state),
    ``batch`` ({"inputs", "targets"} int32 [B, S]) and ``step(policy, where)`` ->
    ``f(state, batch) -> (new_state, loss)``."""

    style: str
    state: Any
    batch: dict
    step: Callable[[str, str], Callable]
    loss: Callable[[Any, dict], jax.Array]  # params-level loss (for the unrolled warning)


def _wrap(fn, policy, here, where, **remat_kw):
    wrap = where == here and (policy != "none" or remat_kw)
    return jmem.remat(fn, policy, **remat_kw) if wrap else fn


def _plain_params(key, layers, hidden, vocab):
    ks = jax.random.split(key, 8)
    d, f = hidden, 4 * hidden
    n = lambda k, shape, fan: jax.random.normal(k, shape) / jnp.sqrt(fan)
    return {
        "embed": n(ks[0], (vocab, d), 1.0),
        "layers": {
            "wq": n(ks[1], (layers, d, d), d),
            "wk": n(ks[2], (layers, d, d), d),
            "wv": n(ks[3], (layers, d, d), d),
            "wo": n(ks[4], (layers, d, d), d),
            "up": n(ks[5], (layers, d, f), d),
            "down": n(ks[6], (layers, f, d), f),
        },
        "head": n(ks[7], (d, vocab), d),
    }


def _plain_loss(unrolled, layer_transform=None):
    block = _block if layer_transform is None else layer_transform(_block)

    def loss(params, batch):
        x = params["embed"][batch["inputs"]]
        if unrolled:
            for i in range(params["layers"]["wq"].shape[0]):
                x = block(x, jax.tree.map(lambda a: a[i], params["layers"]))
        else:
            x, _ = jax.lax.scan(lambda c, w: (_block(c, w), None), x, params["layers"])
        return _cross_entropy(_head(x, params["head"]), batch["targets"])

    return loss


def _optax_model(style, params, loss, batch):
    tx = optax.adamw(1e-3)

    def step(policy, where, **remat_kw):
        inner_loss = _wrap(loss, policy, "loss", where, **remat_kw)

        def train_step(state, batch):
            params, opt_state = state
            value, grads = jax.value_and_grad(inner_loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        return _wrap(train_step, policy, "step", where, **remat_kw)

    return UserModel(style, (params, tx.init(params)), batch, step, loss)


def _linen_model(key, layers, hidden, vocab, batch):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            d = x.shape[-1]
            w = {n: self.param(n, nn.initializers.lecun_normal(), (d, d)) for n in "qkvo"}
            up = self.param("up", nn.initializers.lecun_normal(), (d, 4 * d))
            down = self.param("down", nn.initializers.lecun_normal(), (4 * d, d))
            return _block(
                x, {"wq": w["q"], "wk": w["k"], "wv": w["v"], "wo": w["o"], "up": up, "down": down}
            ), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, hidden)(tokens)
            Blocks = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=layers,
            )
            x, _ = Blocks(name="blocks")(x, None)
            w_head = self.param("head", nn.initializers.lecun_normal(), (hidden, vocab))
            return _head(x, w_head)

    model = Model()
    params = model.init(key, batch["inputs"])["params"]

    def loss(params, batch):
        return _cross_entropy(model.apply({"params": params}, batch["inputs"]), batch["targets"])

    return _optax_model("linen", params, loss, batch)


def _nnx_classes(layers, hidden, vocab, extras):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            d = hidden
            lin = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
            self.q, self.k, self.v, self.o = lin(d, d), lin(d, d), lin(d, d), lin(d, d)
            self.up, self.down = lin(d, 4 * d), lin(4 * d, d)

        def __call__(self, x):
            w = {
                "wq": self.q.kernel[...],
                "wk": self.k.kernel[...],
                "wv": self.v.kernel[...],
                "wo": self.o.kernel[...],
                "up": self.up.kernel[...],
                "down": self.down.kernel[...],
            }
            return _block(x, w)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, hidden, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create_blocks(rngs):
                return Block(rngs)

            self.blocks = create_blocks(rngs)
            if extras:  # state that changes in a train step besides params
                self.drop = nnx.Dropout(0.1, rngs=rngs)
                self.bn = nnx.BatchNorm(hidden, use_running_average=False, rngs=rngs)
            self.head = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (hidden, vocab)))
            self.extras = extras

        def __call__(self, tokens):
            x = self.embed(tokens)

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                return block(x)

            x = run(x, self.blocks)
            if self.extras:
                x = self.bn(self.drop(x))
            return _head(x, self.head[...])

    return Model


def nnx_step_fns(layers, hidden, vocab, extras=False, seed=0):
    """NNX objects as users write them: ``(model, optimizer, step)``, ``step(model,
    optimizer, batch, loss_transform=identity) -> loss`` updating both in place."""
    from flax import nnx

    model = _nnx_classes(layers, hidden, vocab, extras)(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    def train_step(model, optimizer, batch, loss_transform=lambda f: f):
        def loss_fn(model):
            return _cross_entropy(model(batch["inputs"]), batch["targets"])

        value, grads = nnx.value_and_grad(loss_transform(loss_fn))(model)
        optimizer.update(model, grads)
        return value

    return model, optimizer, train_step


def _nnx_model(layers, hidden, vocab, batch, seed):
    from flax import nnx

    model, optimizer, train_step = nnx_step_fns(layers, hidden, vocab, seed=seed)
    graphdef, state = nnx.split((model, optimizer))

    def step(policy, where, **remat_kw):
        loss_transform = lambda f: _wrap(f, policy, "loss", where, **remat_kw)
        user_step = _wrap(train_step, policy, "step", where, **remat_kw)

        def functional(state, batch):  # what nnx.jit does around the user's step
            model, optimizer = nnx.merge(graphdef, state, copy=True)
            value = user_step(model, optimizer, batch, loss_transform=loss_transform)
            return nnx.state((model, optimizer)), value

        return functional

    def loss(state, batch):
        model, _ = nnx.merge(graphdef, state)
        return _cross_entropy(model(batch["inputs"]), batch["targets"])

    return UserModel("nnx", state, batch, step, loss)


def make(
    style, layers=4, hidden=64, seq=128, batch_size=2, vocab=128, seed=0, layer_transform=None
) -> UserModel:
    """A ``UserModel`` of ``style`` (``STYLES`` or ``"jax_unrolled"``) with float32 params;
    ``layer_transform`` (plain JAX styles) wraps the block function, e.g.
    ``lambda f: jax.checkpoint(f)`` for per-layer checkpoints in the Python loop."""
    key = jax.random.key(seed)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch_size, seq + 1), 0, vocab)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if style in ("jax", "jax_unrolled"):
        params = _plain_params(key, layers, hidden, vocab)
        loss = _plain_loss(style == "jax_unrolled", layer_transform)
        return _optax_model(style, params, loss, batch)
    if style == "linen":
        return _linen_model(key, layers, hidden, vocab, batch)
    if style == "nnx":
        return _nnx_model(layers, hidden, vocab, batch, seed)
    raise ValueError(f"unknown style {style!r}; one of {STYLES + ('jax_unrolled',)}")


def grad_accumulation_step(loss, opt):
    """A step that scans over microbatches (``xs [M, ...]``) and takes ``value_and_grad``
    of ``loss(p, x)`` inside that scan's body, then applies ``opt``: ``step(p, s, xs) ->
    (p, s, mean loss)``."""

    def step(p, s, xs):
        def microbatch(acc, x):
            value, g = jax.value_and_grad(loss)(p, x)
            return jax.tree.map(jnp.add, acc, g), value

        g, values = jax.lax.scan(microbatch, jax.tree.map(jnp.zeros_like, p), xs)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, values.mean()

    return step
