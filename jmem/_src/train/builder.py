"""The train-step builder: one jitted, donating step that composes jmem's transforms.

``jmem.train_step(loss_fn, optimizer, ...)`` stacks, in this order:

1. precision: trainable params cast to the policy's compute dtype inside the loss;
2. remat: ``jmem.remat(loss, policy)`` so every layer scan body is checkpointed;
3. loss scaling: the loss is multiplied by the loss scale before differentiation;
4. gradient accumulation over ``microbatches`` with ``lax.scan``;
5. unscale, one finiteness check after accumulation, loss-scale adjustment;
6. the optimizer (optionally wrapped: ``mixed_precision`` for fp32 master weights,
   ``offload`` for host-resident optimizer state);
7. a non-finite step changes nothing but the loss scale: the optimizer runs in a
   ``lax.cond`` branch (the state is updated in place, no second copy is kept alive), and
   params, optimizer state and the step count stay bitwise as they were.

The loss function is called as ``loss_fn(params, batch, **extras)`` where ``extras``
holds ``frozen=state.frozen`` when the state has frozen params (LoRA/QLoRA base
weights: never differentiated, never updated) and ``fp8=state.fp8`` when the state
carries FP8 scaling metadata (differentiated with the "overwrite with gradient" rule:
the new metadata comes out as its gradient). It returns a scalar loss, or
``(loss, aux)`` with ``has_aux=True``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jmem._src.loss_scale import NoOpLossScale, all_finite, select_tree
from jmem._src.master_weights import mixed_precision, params_from_masters
from jmem._src.measure import MemoryReport, measure
from jmem._src.precision import Policy, get_policy
from jmem._src.remat import remat as _remat
from jmem._src.remat import resolve_policy
from jmem._src.train import accumulation


def _fresh(tree, ids):
    """Copies the leaves of ``tree`` that are the caller's own arrays (``id`` in ``ids``)."""
    return jax.tree.map(
        lambda x: (
            jnp.array(x, copy=True)
            if id(x) in ids and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            else x
        ),
        tree,
    )


def _opt_state_to_host(state):
    """Moves optimizer-state leaves that arrive in device memory (e.g. restored from a
    checkpoint into an abstract target) to ``pinned_host``, as the offloaded step expects;
    a donated buffer of the wrong memory kind would abort the runtime."""
    leaves = [x for x in jax.tree.leaves(state.opt_state) if isinstance(x, jax.Array)]
    if all(getattr(x.sharding, "memory_kind", None) == "pinned_host" for x in leaves):
        return state
    from jmem._src.offload.transform import to_host  # noqa: PLC0415

    return state.replace(opt_state=to_host(state.opt_state))


@struct.dataclass
class TrainState:
    """Everything a step reads and writes; a pytree that jits, donates and checkpoints.

    Attributes:
      step: int32 scalar, number of applied (finite) optimizer steps.
      params: trainable params (for LoRA/QLoRA: the adapters).
      opt_state: the optimizer's state (fp32 masters live here with ``master_weights``).
      loss_scale: a ``NoOpLossScale``/``StaticLossScale``/``DynamicLossScale``.
      frozen: params that are read but never trained (LoRA/QLoRA base, NF4 leaves), or None.
      fp8: FP8 delayed-scaling metadata (``jmem.fp8``), or None.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: Any
    frozen: Any = None
    fp8: Any = None


@dataclasses.dataclass
class TrainStep:
    """A built train step: ``state, metrics = step(state, batch)``.

    Attributes:
      jitted: the ``jax.jit``-ed step (donates ``state``), for ``.lower()`` and ``jmem.measure``.
      optimizer: the optimizer as wrapped by the builder (master weights, offload).
      policy: the precision ``Policy`` or None.
    """

    jitted: Callable
    optimizer: optax.GradientTransformation
    policy: Policy | None
    _init: Callable
    offload_optimizer: bool = False

    def __call__(self, state: TrainState, batch: Any):
        if self.offload_optimizer:
            state = _opt_state_to_host(state)
        return self.jitted(state, batch)

    def init(
        self, params: Any, *, frozen: Any = None, fp8: Any = None, loss_scale: Any = None
    ) -> TrainState:
        """Builds the initial ``TrainState``.

        Args:
          params: trainable params, ideally in float32: with master weights the fp32 masters
            are taken from them before they are cast to the policy's param dtype.
          frozen: frozen params (see ``TrainState``).
          fp8: FP8 metadata (see ``jmem.fp8``).
          loss_scale: overrides the builder's loss scale for this state.
        """
        return self._init(params, frozen, fp8, loss_scale)

    def measure(self, state: TrainState, batch: Any) -> MemoryReport:
        """Compiles the step for ``state``/``batch`` (arrays or ShapeDtypeStructs) and
        reports its memory (``jmem.measure``); nothing is allocated."""
        return measure(self.jitted, state, batch)

    def abstract_state(self, params: Any, **kwargs) -> TrainState:
        """``jax.ShapeDtypeStruct`` of the state ``init`` would build from ``params``
        (which may themselves be ShapeDtypeStructs): plan a 7B step without allocating it."""
        return jax.eval_shape(
            lambda p, kw: self._init(p, kw.get("frozen"), kw.get("fp8"), kw.get("loss_scale")),
            params,
            kwargs,
        )


def _new_params_from_masters(mp: optax.GradientTransformation) -> optax.GradientTransformation:
    """``mp`` (a ``mixed_precision`` optimizer) returning the new params instead of updates:
    ``params_from_masters(new_state, params)``, computed where the new masters are (on the
    device, inside ``jmem.offload``). Same state; for the builder only."""

    def update(grads, state, params=None, **extra_args):
        _, new_state = mp.update(grads, state, params, **extra_args)
        return params_from_masters(new_state, params), new_state

    return optax.GradientTransformationExtraArgs(mp.init, update)


def train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    precision: Policy | str | None = None,
    master_weights: bool = False,
    loss_scale: Any = None,
    remat: str | Callable | None = None,
    microbatches: int = 1,
    offload_optimizer: bool | str = False,
    has_aux: bool = False,
    skip_nonfinite: bool = True,
    donate: bool = True,
    jit_kwargs: dict | None = None,
    mesh: Any = None,
    strategy: str = "zero3",
) -> TrainStep:
    """Builds a jitted, donating ``step(state, batch) -> (state, metrics)``.

    Args:
      loss_fn: ``loss_fn(params, batch, **extras) -> loss`` (or ``(loss, aux)`` with
        ``has_aux``), a float scalar mean over the batch. ``extras`` has ``frozen=`` and/or
        ``fp8=`` when the state holds them (module docstring).
      optimizer: any optax ``GradientTransformation`` (optax, jmem 8-/4-bit, chains).
      precision: a ``jmem.Policy`` or its string form (``"p=f32,c=bf16,o=f32"``): params are
        stored in ``param_dtype`` and cast to ``compute_dtype`` inside the loss.
      master_weights: wrap the optimizer in ``jmem.mixed_precision``: params live in the
        policy's param dtype (e.g. bf16), fp32 masters in the optimizer state.
      loss_scale: initial ``NoOpLossScale`` (default), ``StaticLossScale`` or ``DynamicLossScale``.
      remat: a ``jmem.REMAT_POLICIES`` name, checkpoint names or a policy callable; applied
        with ``jmem.remat`` to the loss, so each layer scan body is checkpointed.
      microbatches: gradient accumulation steps within one call (``jmem.accumulation``).
      offload_optimizer: keep the optimizer state (and the masters, with ``master_weights``)
        in ``pinned_host`` memory between steps (``jmem.offload``). ``True`` or
        ``"whole_tree"``: ``offload(opt)``, any optimizer. ``"leaf_by_leaf"``:
        ``offload(opt, leaf_by_leaf=True)``, the update runs one parameter leaf at a time,
        so about two leaves' state is on the device at once; separable optimizers only
        (AdamW, 8-/4-bit AdamW, with or without ``master_weights``; not global-norm
        clipping), checked when the step is traced.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux is averaged over microbatches and
        returned in ``metrics["aux"]``.
      skip_nonfinite: a step with non-finite gradients leaves params, optimizer state and
        step unchanged (the loss scale still adjusts). The update runs in a ``lax.cond`` on
        the finiteness, not as a select of new and old values, so the state is still
        updated in place (a select kept the old state alive next to the new one: 15 GiB
        more temporaries for Llama-2-7B with ``optax.adamw``, see
        ``benchmarks/optimizer_memory.py``). XLA compiles the branch apart, so results can
        differ in the last bit from ``skip_nonfinite=False``.
      donate: donate the state buffers to the step.
      jit_kwargs: extra ``jax.jit`` arguments (e.g. ``in_shardings``/``out_shardings``).
      mesh: a ``jax.sharding.Mesh`` with ``"data"``/``"fsdp"`` axes (``jmem.sharding.make_mesh``):
        the step is jitted with in/out shardings from ``jmem.sharding``'s rules (state
        donated) and ``init`` returns a state placed with them. None: no sharding.
      strategy: ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"fsdp"`` (``jmem.sharding``); used
        only with ``mesh``.

    Returns:
      A ``TrainStep``: call it, ``.init(params)`` it, ``.measure(state, batch)`` it.

    Metrics: ``loss`` (unscaled mean), ``grad_norm`` (global L2 of unscaled grads),
    ``loss_scale``, ``grads_finite``, ``step`` (after the update).

    Raises:
      ValueError: for an unknown remat policy or precision string, ``microbatches < 1``,
        or an ``offload_optimizer`` other than False/True/"whole_tree"/"leaf_by_leaf".
    """
    policy = get_policy(precision) if isinstance(precision, str) else precision
    resolve_policy(remat)  # validate early
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}.")
    if isinstance(offload_optimizer, str) and offload_optimizer in ("whole_tree", "leaf_by_leaf"):
        leaf_by_leaf, offload_optimizer = offload_optimizer == "leaf_by_leaf", True
    elif isinstance(offload_optimizer, bool):
        leaf_by_leaf, offload_optimizer = False, bool(offload_optimizer)
    else:
        raise ValueError(
            f"offload_optimizer must be False, True (= 'whole_tree') or 'leaf_by_leaf', got "
            f"{offload_optimizer!r}."
        )
    base = mixed_precision(optimizer) if master_weights else optimizer
    # Offloaded masters are in host memory after the update, so the new params cannot be
    # cast from them there: the step's optimizer returns the new params (the masters cast
    # down, on the device, inside the offloaded update) in place of the updates.
    stepper = _new_params_from_masters(base) if master_weights and offload_optimizer else base

    def wrap(o):
        if offload_optimizer:
            from jmem._src.offload.transform import offload  # noqa: PLC0415

            o = offload(o, leaf_by_leaf=leaf_by_leaf)
        if mesh is not None:  # jmem.sharding (issue 8): gradients placed per strategy
            o = _sharding.constrain_gradients(o, mesh, strategy)
        return o

    if mesh is not None:
        from jmem._src import sharding as _sharding  # noqa: PLC0415
    opt = wrap(base)
    step_opt = wrap(stepper) if stepper is not base else opt
    default_scale = loss_scale if loss_scale is not None else NoOpLossScale()

    def init(params, frozen, fp8, scale):
        callers = {id(x) for x in jax.tree.leaves((params, frozen, fp8))}
        opt_state = opt.init(params)
        if policy is not None:
            params = policy.cast_to_param(params)
        # The step donates the state: own fresh buffers, so the caller's arrays survive.
        params, frozen, fp8 = _fresh((params, frozen, fp8), callers)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            loss_scale=scale if scale is not None else default_scale,
            frozen=frozen,
            fp8=fp8,
        )

    def scaled_loss(diff, batch, frozen, scale):
        params, fp8 = diff
        if policy is not None:
            params = policy.cast_to_compute(params)
        extras = {}
        if frozen is not None:
            extras["frozen"] = frozen
        if fp8 is not None:
            extras["fp8"] = fp8
        out = loss_fn(params, batch, **extras)
        loss, aux = out if has_aux else (out, None)
        loss = jnp.asarray(loss, jnp.float32)
        return scale.scale(loss), (loss, aux)

    loss_for_grad = _remat(scaled_loss, remat) if resolve_policy(remat) is not None else scaled_loss

    def step(state: TrainState, batch):
        scale = state.loss_scale

        def grad_fn(diff, mb):
            return jax.grad(loss_for_grad, has_aux=True)(diff, mb, state.frozen, scale)

        (grads, fp8_new), (loss, aux) = accumulation.accumulate_gradients(
            grad_fn, (state.params, state.fp8), batch, microbatches, maximum=(False, True)
        )
        if master_weights and not isinstance(scale, NoOpLossScale):
            # unscale in float32: fp16 would flush tiny gradients again
            grads = jax.tree.map(
                lambda g: g.astype(jnp.float32) if jnp.issubdtype(g.dtype, jnp.floating) else g,
                grads,
            )
        grads = scale.unscale(grads)
        finite = all_finite(grads)
        new_scale = scale.adjust(finite)
        if not master_weights:  # keep the optimizer state's dtypes stable across steps
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        grad_norm = optax.tree.norm(grads)
        # The norm, a metric, is computed before the update: an update may write over the
        # gradients' buffers (chunked 8-bit Adam does), and a read after it costs a copy.
        # In the lax.cond path below the branch predicate reads it (a term that is always
        # true: a norm is never negative, NaN < 0 is false); elsewhere an optimization
        # barrier orders it.
        if skip_nonfinite and not offload_optimizer:
            finite = jnp.logical_and(finite, jnp.logical_not(grad_norm < 0))
        else:
            grads, grad_norm = jax.lax.optimization_barrier((grads, grad_norm))

        def apply(grads, opt_state, params, **skip):
            updates, opt_state = step_opt.update(grads, opt_state, params, **skip)
            if master_weights and offload_optimizer:
                params = updates  # the new masters cast down (see _new_params_from_masters)
            elif master_weights:
                params = params_from_masters(opt_state, params)  # bitwise masters cast down
            else:
                params = optax.apply_updates(params, updates)
            return params, opt_state

        if skip_nonfinite and offload_optimizer:
            # The host-resident state is selected inside the offload wrapper, on the device.
            params, opt_state = apply(
                grads, state.opt_state, state.params, skip=jnp.logical_not(finite)
            )
            params = select_tree(finite, params, state.params)
        elif skip_nonfinite:
            # A branch, not a select of old and new values: the update can then write the
            # state in place (a select keeps the old state alive next to the new one, which
            # costs a copy of any state leaf updated through a loop, e.g. chunked 8-bit Adam).
            try:
                params, opt_state = jax.lax.cond(
                    finite, apply, lambda g, s, p: (p, s), grads, state.opt_state, state.params
                )
            except TypeError as e:
                if "branch" not in str(e):
                    raise
                raise TypeError(
                    "train_step(skip_nonfinite=True): the optimizer's update returns params or a "
                    "state whose types differ from those it was given (a skipped step keeps the "
                    "old ones, so they must match; e.g. a state leaf whose dtype changes after "
                    f"the first step). Initialize the state in the dtypes the update returns, or "
                    f"pass skip_nonfinite=False. JAX said: {e}"
                ) from e
        else:
            params, opt_state = apply(grads, state.opt_state, state.params)
        new = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            fp8=fp8_new if state.fp8 is not None else None,
        )
        if skip_nonfinite:
            kept = select_tree(finite, (new.step, new.fp8), (state.step, state.fp8))
            new = new.replace(step=kept[0], fp8=kept[1])
        new = new.replace(loss_scale=new_scale)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "loss_scale": jnp.asarray(getattr(new_scale, "loss_scale", 1.0), jnp.float32),
            "grads_finite": finite,
            "step": new.step,
        }
        if has_aux:
            metrics["aux"] = aux
        return new, metrics

    if mesh is not None:  # jmem.sharding (issue 8): sharded jit + sharded init
        mem_kind = "pinned_host" if offload_optimizer else None
        jitted = _sharding.ShardedStep(
            step,
            mesh,
            strategy,
            donate=donate,
            jit_kwargs=jit_kwargs,
            opt_state_memory_kind=mem_kind,
        )
        init = _sharding.sharded_init(init, mesh, strategy, opt_state_memory_kind=mem_kind)
        return TrainStep(
            jitted=jitted,
            optimizer=opt,
            policy=policy,
            _init=init,
            offload_optimizer=offload_optimizer,
        )
    jitted = jax.jit(step, donate_argnums=(0,) if donate else (), **(jit_kwargs or {}))
    # One compiled program builds the state (op-by-op quantization of 8-bit moments is slow).
    return TrainStep(
        jitted=jitted,
        optimizer=opt,
        policy=policy,
        _init=jax.jit(init),
        offload_optimizer=offload_optimizer,
    )
