"""The sharded train-step jit: in/out shardings of a ``TrainState`` from ``jmem.sharding``'s rules."""

from __future__ import annotations

import contextlib
from typing import Any
from typing import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmem._src.sharding import DEFAULT_MIN_SIZE
from jmem._src.sharding import batch_shardings_of
from jmem._src.sharding import check_mesh
from jmem._src.sharding import check_strategy
from jmem._src.sharding import param_shardings
from jmem._src.sharding import replicated
from jmem._src.sharding import shape_of
from jmem._src.sharding import shard_state
from jmem._src.sharding import state_shardings

HOST = "pinned_host"


def streamed_kinds(state: Any, offload_params: bool) -> dict:
    """``state_shardings``' ``params_memory_kind``/``frozen_memory_kind`` for a state
    whose streamed params (``jmem.Levers(offload_params=True)``) live in host memory: the
    frozen base when there is one (QLoRA), else the trainable params (full fine-tuning)."""
    if not offload_params:
        return {}
    if getattr(state, "frozen", None) is not None:
        return {"frozen_memory_kind": HOST}
    return {"params_memory_kind": HOST}


def sharded_init(
    init: Callable,
    mesh: Mesh,
    strategy: str = "zero3",
    *,
    opt_state_memory_kind: str | None = None,
    min_size: int = DEFAULT_MIN_SIZE,
    offload_params: bool = False,
) -> ShardedInit:
    """Wraps a ``TrainState`` builder ``init(params, frozen, fp8, loss_scale, dropout_key)`` so its result
    is born sharded: inputs are placed by the param rule, then ``init`` runs under
    ``jax.jit(out_shardings=state_shardings(...))``. The optimizer state is therefore never
    materialized whole on one device, and size thresholds see global shapes. With
    ``offload_params`` the streamed params (``streamed_kinds``) get their rule's
    ``PartitionSpec`` in ``pinned_host`` memory.
    """
    check_mesh(mesh)
    check_strategy(strategy)
    return ShardedInit(init, mesh, strategy, opt_state_memory_kind, min_size, offload_params)


class ShardedInit:
    """``init(params, frozen, fp8, loss_scale, dropout_key)`` placed by the rules
    (``sharded_init``)."""

    def __init__(
        self,
        init: Callable,
        mesh: Mesh,
        strategy: str,
        kind: str | None,
        min_size: int,
        offload_params: bool = False,
    ):
        self.init, self.mesh, self.strategy = init, mesh, strategy
        self._kind, self._min, self._offload_params = kind, min_size, offload_params

    def shardings(self, abstract: Any) -> Any:
        """The ``NamedSharding`` of each leaf of the state ``abstract`` (from ``init``)."""
        return state_shardings(
            abstract,
            self.mesh,
            self.strategy,
            min_size=self._min,
            opt_state_memory_kind=self._kind,
            **streamed_kinds(abstract, self._offload_params),
        )

    def abstract(self, params, frozen=None, fp8=None, loss_scale=None, dropout_key=None):
        """``ShapeDtypeStruct``s of the state with the shardings (and memory kinds) that
        ``__call__`` gives it; nothing is computed or allocated."""
        abstract = jax.eval_shape(self.init, params, frozen, fp8, loss_scale, dropout_key)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
            abstract,
            self.shardings(abstract),
        )

    def __call__(self, params, frozen=None, fp8=None, loss_scale=None, dropout_key=None):
        args = (params, frozen, fp8, loss_scale, dropout_key)
        shardings = self.shardings(jax.eval_shape(self.init, *args))
        mesh, strategy, min_size = self.mesh, self.strategy, self._min
        params = shard_state(params, param_shardings(params, mesh, strategy, min_size=min_size))
        frozen = shard_state(frozen, param_shardings(frozen, mesh, strategy, min_size=min_size))
        fp8 = shard_state(fp8, replicated(fp8, mesh))
        loss_scale = shard_state(loss_scale, replicated(loss_scale, mesh))
        dropout_key = shard_state(dropout_key, replicated(dropout_key, mesh))
        return jax.jit(self.init, out_shardings=shardings)(
            params, frozen, fp8, loss_scale, dropout_key
        )


class ShardedStep:
    """``jax.jit`` of ``step(state, batch) -> (state, metrics)`` with shardings from the rules.

    The shardings depend on the state's shapes, so the jitted function is built on first use
    for each (structure, shapes, dtypes) of ``(state, batch)`` and cached: in_shardings
    ``(state_shardings(state), batch shardings)``, out_shardings ``(state_shardings(state),
    replicated metrics)``, state donated (with ``offload_params``, the streamed params in
    ``pinned_host``: ``streamed_kinds``). Supports ``__call__`` and ``.lower`` (so
    ``jmem.measure`` and ``TrainStep.measure`` work; the figures are per device).
    """

    def __init__(
        self,
        step: Callable,
        mesh: Mesh,
        strategy: str = "zero3",
        *,
        donate: bool = True,
        opt_state_memory_kind: str | None = None,
        min_size: int = DEFAULT_MIN_SIZE,
        jit_kwargs: dict | None = None,
        offload_params: bool = False,
    ):
        check_mesh(mesh)
        check_strategy(strategy)
        jit_kwargs = dict(jit_kwargs or {})
        clash = {"in_shardings", "out_shardings", "donate_argnums", "donate_argnames"} & set(
            jit_kwargs
        )
        if clash:
            raise ValueError(
                f"jit_kwargs {sorted(clash)} conflict with mesh=: the sharding "
                f"rules set them. Drop them, or build without mesh= and pass "
                f"your own shardings."
            )
        self.step, self.mesh, self.strategy = step, mesh, strategy
        self._donate, self._kind, self._min = donate, opt_state_memory_kind, min_size
        self._jit_kwargs, self._offload_params = jit_kwargs, offload_params
        self._cache: dict = {}

    def shardings(self, state: Any, batch: Any):
        """``(state shardings, batch shardings)`` used for this state and batch."""
        st = state_shardings(
            state,
            self.mesh,
            self.strategy,
            min_size=self._min,
            opt_state_memory_kind=self._kind,
            **streamed_kinds(state, self._offload_params),
        )
        return st, batch_shardings_of(batch, self.mesh)

    def _jitted(self, state: Any, batch: Any):
        leaves, treedef = jax.tree.flatten((state, batch))
        key = (treedef, tuple((shape_of(x), str(getattr(x, "dtype", type(x)))) for x in leaves))
        fn = self._cache.get(key)
        if fn is None:
            st, bt = self.shardings(state, batch)
            fn = jax.jit(
                self.step,
                in_shardings=(st, bt),
                out_shardings=(st, NamedSharding(self.mesh, P())),
                donate_argnums=(0,) if self._donate else (),
                **self._jit_kwargs,
            )
            self._cache[key] = fn
        return fn

    def _mesh_context(self):
        """The mesh in context while tracing (``jax.set_mesh``), so that code inside the step
        can read it (cuDNN attention constrains q, k, v by it); an ``AbstractMesh``
        (``jmem.targets.mesh``) is bound by ``jmem.measure(target=)`` instead."""
        if isinstance(self.mesh, Mesh):
            return jax.set_mesh(self.mesh)
        return contextlib.nullcontext()

    def __call__(self, state: Any, batch: Any):
        fn = self._jitted(state, batch)
        # Host / single-device batches (and, across processes, host values) are placed here.
        batch = shard_state(batch, batch_shardings_of(batch, self.mesh))
        with self._mesh_context():
            return fn(state, batch)

    def lower(self, state: Any, batch: Any):
        with self._mesh_context():
            return self._jitted(state, batch).lower(state, batch)
