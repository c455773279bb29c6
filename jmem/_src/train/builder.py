"""The train-step builder: one jitted, donating step that composes jmem's transforms."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jmem._src import levers as _levers
from jmem._src import targets
from jmem._src.loss_scale import NoOpLossScale
from jmem._src.loss_scale import all_finite
from jmem._src.master_weights import mixed_precision
from jmem._src.master_weights import params_from_masters
from jmem._src.measure import MemoryReport
from jmem._src.measure import compile_for_target
from jmem._src.measure import report_from_compiled
from jmem._src.offload.disk import check_directory
from jmem._src.offload.memory_kinds import to_host
from jmem._src.offload.params import in_host_space
from jmem._src.offload.params import is_on_host
from jmem._src.offload.params import offloads_params
from jmem._src.offload.params import params_to_host
from jmem._src.offload.params import streamed_norm_and_finite
from jmem._src.offload.transform import offload
from jmem._src.precision import Policy
from jmem._src.precision import get_policy
from jmem._src.remat import remat as _remat
from jmem._src.remat import resolve_policy
from jmem._src.sharding import check_strategy
from jmem._src.sharding import constrain_gradients
from jmem._src.train.accumulation import accumulate_gradients
from jmem._src.train.decay_warning import warn_if_norms_decayed
from jmem._src.train.fp8_check import check_fp8_levers
from jmem._src.train.precision_check import warn_if_precision_ignored
from jmem._src.train.sharded import ShardedInit
from jmem._src.train.sharded import ShardedStep
from jmem._src.train.sharded import sharded_init
from jmem._src.train.skip import skip_if_nonfinite
from jmem._src.train.skip import uses_select
from jmem._src.train.state import TrainState
from jmem._src.tree import is_float_array
from jmem._src.tree import select_tree

#: ``offload_optimizer`` value -> (offload, leaf by leaf).
_OFFLOAD_MODES = {
    False: (False, False),
    True: (True, False),
    "whole_tree": (True, False),
    "leaf_by_leaf": (True, True),
    "disk": (True, True),
}


@dataclasses.dataclass
class TrainStep:
    """A built train step: ``state, metrics = step(state, batch)``.

    Attributes:
      jitted: the ``jax.jit``-ed step (donates ``state``), for ``.lower()`` and ``jmem.measure``.
      optimizer: the optimizer as wrapped by the builder (master weights, offload, sharding).
      precision: the precision ``Policy`` or None.
      offload_optimizer: whether the optimizer state lives in host memory between steps.
      levers: the ``jmem.Levers``/``ResolvedLevers`` given to ``train_step`` (or None).
      offload_dir: the directory of ``offload_optimizer="disk"`` (else None); the state's
        ``opt_state`` is then a ``DiskState`` (``opt_state.full()`` for checkpoints).
      offload_params: whether the frozen params live in host memory between steps
        (``levers.offload_params``; the model streams its layers from there).
    """

    jitted: Callable
    optimizer: optax.GradientTransformation
    precision: Policy | None
    _init: Callable
    offload_optimizer: bool = False
    _user_optimizer: Any = None
    levers: Any = None
    offload_dir: str | None = None
    offload_params: bool = False

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """One step: ``(state, batch) -> (new state, metrics)``; ``state`` is donated.

        Args:
          state: a ``TrainState`` from ``init`` (or restored into ``abstract_state``).
          batch: a pytree of arrays with a leading batch axis (divisible by ``microbatches``).

        Returns:
          ``(state, metrics)``; metrics are float32/int32/bool scalars (``train_step``).
        """
        if self.offload_optimizer and self.offload_dir is None:
            state = _opt_state_to_host(state)
        if self.offload_params and not is_on_host(state.frozen):
            state = state.replace(frozen=params_to_host(state.frozen))
        if self.offload_params and state.frozen is None and not is_on_host(state.params):
            state = state.replace(params=params_to_host(state.params))  # full fine-tuning
        return self.jitted(state, batch)

    def init(
        self,
        params: Any,
        *,
        frozen: Any = None,
        fp8: Any = None,
        loss_scale: Any = None,
        dropout_key: Any = None,
    ) -> TrainState:
        """Builds the initial ``TrainState``.

        Args:
          params: trainable params, ideally in float32: with master weights the fp32 masters
            are taken from them before they are cast to the precision's param dtype.
          frozen: frozen params (see ``TrainState``).
          fp8: FP8 metadata (see ``jmem.fp8``).
          loss_scale: overrides the builder's loss scale for this state.
          dropout_key: a PRNG key (typed or raw ``uint32[2]``): the step then passes
            ``loss_fn`` a ``dropout_key=`` of its own for each step and microbatch
            (``train_step``). Stored as key data in ``TrainState.dropout_key``, so it is
            checkpointed with the state.
        """
        warn_if_norms_decayed(self._user_optimizer, params)
        return self._init(params, frozen, fp8, loss_scale, _key_data(dropout_key))

    def measure(
        self, state: TrainState, batch: Any, *, target: Any = None, flops: bool = False
    ) -> MemoryReport:
        """Compiles the step for ``state``/``batch`` (arrays or ShapeDtypeStructs) and
        reports its memory (``jmem.measure``); nothing is allocated. ``target``: a
        ``jmem.targets`` name or ``Target`` to compile for (None: the running backend); a
        step built with ``mesh=`` needs ``mesh=jmem.targets.mesh(target, ...)`` for a GPU
        target. ``flops=True`` also counts the step's dot FLOPs (``MemoryReport.dot_flops``).

        Raises:
          ValueError: for a step built on a mesh of another platform's devices than
            ``target``'s (the message says how to build it).
        """
        mesh = getattr(self.jitted, "mesh", None)
        if target is not None and isinstance(mesh, jax.sharding.Mesh):
            platform, want = mesh.devices.flat[0].platform, targets.get(target).platform
            if (platform in ("cuda", "rocm", "gpu")) != (want == "gpu"):
                raise ValueError(
                    f"this step was built on a {platform} mesh; to measure it for {target!r} "
                    f"build it with mesh=jmem.targets.mesh({target!r}, {mesh.axis_sizes}, "
                    f"{mesh.axis_names})."
                )
        compiled = compile_for_target(self.jitted, (state, batch), {}, target)
        return report_from_compiled(compiled, target, flops=flops)

    def abstract_state(self, params: Any, **kwargs: Any) -> TrainState:
        """``jax.ShapeDtypeStruct``s of the state ``init`` would build from ``params``
        (which may themselves be ShapeDtypeStructs): plan a 7B step without allocating it,
        or restore a checkpoint into it (``Checkpointer.restore``).

        Each leaf carries the sharding ``init`` gives it, memory kind included: with
        ``mesh=``, the ``NamedSharding`` of ``jmem.sharding``'s rules on that mesh
        (``memory_kind="pinned_host"`` for the optimizer state with ``offload_optimizer``);
        without a mesh, the single device (or the inputs' placement) that ``jax.jit(init)``
        uses, the optimizer state in ``pinned_host`` when offloaded. A restore into it
        therefore lands where the step wants the state: an offloaded optimizer state goes
        straight to host memory (never whole to the device first), and a checkpoint written
        on another device count is resharded onto this step's mesh.

        Args:
          params: trainable params (arrays or ``ShapeDtypeStruct``s), as for ``init``.
          **kwargs: ``frozen=``, ``fp8=``, ``loss_scale=``, ``dropout_key=``, as for ``init``.

        Returns:
          A ``TrainState`` of ``jax.ShapeDtypeStruct`` with ``sharding`` set on every leaf.

        Raises:
          ValueError: for a step built with ``offload_optimizer="disk"``.

        Note: shardings given through ``jit_kwargs`` apply to the step, not to ``init``;
        with them, build the restore target from those shardings yourself.
        """
        if self.offload_dir is not None:
            raise ValueError(
                "abstract_state: with offload_optimizer='disk' the state is built by init "
                "(it writes files); restore a checkpoint into step.init(params) instead."
            )
        args = (params, kwargs.get("frozen"), kwargs.get("fp8"), kwargs.get("loss_scale"))
        args = (*args, _key_data(kwargs.get("dropout_key")))
        warn_if_norms_decayed(self._user_optimizer, params)
        if isinstance(self._init, ShardedInit):
            return self._init.abstract(*args)
        abstract = jax.eval_shape(self._init, *args)
        # Where jit places init's outputs (device, memory kind): read from the compiled init.
        shardings = self._init.lower(*args).compile().output_shardings
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
            abstract,
            shardings,
        )


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
    offload_dir: Any = None,
    has_aux: bool = False,
    skip_nonfinite: bool = True,
    donate: bool = True,
    jit_kwargs: dict | None = None,
    mesh: Any = None,
    strategy: str = "zero3",
    levers: Any = None,
    **unknown: Any,
) -> TrainStep:
    """Builds a jitted, donating ``step(state, batch) -> (state, metrics)``.

    The step differentiates ``loss_fn`` under the precision policy, the loss scale and
    ``jmem.remat``, accumulates gradients over microbatches, unscales and checks them once,
    and applies the optimizer wrapped as mixed precision -> offload -> sharding
    constraints -> skip if non-finite. Design notes: ``docs/levers.md`` ("The train step").

    Args:
      loss_fn: ``loss_fn(params, batch, **extras) -> loss`` (or ``(loss, aux)``), a scalar
        mean over the batch's unmasked tokens; ``extras`` holds ``frozen=``, ``fp8=`` and
        ``dropout_key=`` when the state has them (a new key each step and microbatch).
      optimizer: any optax ``GradientTransformation`` (optax, jmem 8-/4-bit, chains).
      precision: a ``jmem.Policy`` or its string (``"p=f32,c=bf16,o=f32"``): params stored
        in ``param_dtype``, cast to ``compute_dtype`` inside the loss.
      master_weights: wrap the optimizer in ``jmem.mixed_precision`` (fp32 masters).
      loss_scale: ``NoOpLossScale`` (default), ``StaticLossScale`` or ``DynamicLossScale``.
      remat: a ``jmem.REMAT_POLICIES`` name, checkpoint names or a policy callable
        (default: ``levers.remat``, else none).
      microbatches: gradient accumulation steps per call; the loss and gradient are those
        of the whole batch (microbatches weighted by their unmasked tokens).
      offload_optimizer: keep the optimizer state and masters out of device memory between
        steps: ``True``/``"whole_tree"``, ``"leaf_by_leaf"`` (separable optimizers only) or
        ``"disk"`` (files under ``offload_dir``, one device; see ``jmem.offload``).
      offload_dir: the directory for ``offload_optimizer="disk"`` (its parent must exist).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux is averaged over microbatches like
        the loss and returned in ``metrics["aux"]``.
      skip_nonfinite: a step with non-finite gradients leaves params, optimizer state, step
        and FP8 metas unchanged (the loss scale still adjusts): a per-leaf ``lax.select``
        for GPU/TPU, on a mesh or with an offloaded state; a ``lax.cond`` on one XLA:CPU
        device.
      donate: donate the state buffers to the step.
      jit_kwargs: extra ``jax.jit`` arguments (e.g. ``in_shardings``/``out_shardings``).
      mesh: a ``jax.sharding.Mesh`` with ``"data"``/``"fsdp"`` axes: the step is jitted with
        ``jmem.sharding``'s rules and ``init`` returns a state placed with them.
      strategy: ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"fsdp"``; used only with ``mesh``.
      levers: the ``jmem.Levers`` (or ``ResolvedLevers``) the loss runs with: the step
        applies their ``remat``, streams ``frozen`` params from host memory with
        ``offload_params``, and records them as ``TrainStep.levers``.

    Returns:
      A ``TrainStep``: call it, ``.init(params)`` it, ``.measure(state, batch)`` it. Metrics:
      ``loss`` (unscaled mean), ``grad_norm`` (global L2 of unscaled grads), ``loss_scale``,
      ``grads_finite``, ``step`` (after the update).

    Raises:
      ValueError: an unknown remat policy, precision string or strategy, ``microbatches <
        1``, a bad ``offload_optimizer`` or ``offload_dir`` (``"disk"`` needs one and no
        ``mesh``), ``jit_kwargs`` setting shardings or donation with ``mesh``; when first
        traced, ``levers.fp8`` without FP8 metas in the state or an FP8 matmul in the loss.
      TypeError: an unknown keyword (the message names renamed ones: ``policy=`` is
        ``precision=``).

    Warns:
      UserWarning: from ``init`` when ``optimizer`` decays norm scales or biases (see
        ``jmem.decay_mask``), and, with a 16-bit compute dtype, when matmuls of the traced
        loss run with all-float32 operands.

    Source: mixed precision after Micikevicius et al. 2018 (arXiv:1710.03740); remat after
    Chen et al. 2016 and Korthikanti et al. 2022; ZeRO after Rajbhandari et al. 2020.
    """
    kw = {k: v for k, v in locals().items() if k not in ("loss_fn", "optimizer", "unknown")}
    kw["remat"] = _levers_remat(kw.pop("levers"), remat)
    kw["offload_params"] = offloads_params(levers)
    o = _parse_options(unknown, **kw)
    user_optimizer = optimizer
    optimizer, stepper = _optimizers(optimizer, o)
    step = functools.partial(_step, _differentiable_loss(loss_fn, o), stepper, o)
    if o.precision is not None:
        step = functools.partial(_precision_checked, loss_fn, o, step)
    if levers is not None and levers.fp8:
        step = functools.partial(_fp8_checked, loss_fn, levers, o, step)
    init = functools.partial(_init_state, optimizer, o)
    jitted, init = _jit(step, init, o)
    return TrainStep(
        jitted=jitted,
        optimizer=optimizer,
        precision=o.precision,
        _init=init,
        offload_optimizer=o.offload,
        _user_optimizer=user_optimizer,
        levers=levers,
        offload_dir=o.offload_dir,
        offload_params=o.offload_params,
    )


@dataclasses.dataclass(frozen=True)
class _Options:
    """The builder's keyword arguments, validated (``_parse_options``)."""

    precision: Policy | None
    master_weights: bool
    loss_scale: Any
    remat: Any
    microbatches: int
    offload: bool
    leaf_by_leaf: bool
    offload_dir: str | None
    has_aux: bool
    skip_nonfinite: bool
    donate: bool
    jit_kwargs: dict
    mesh: Any
    strategy: str
    offload_params: bool = False


_RENAMED = {"policy": "precision"}


def _levers_remat(levers: Any, remat: Any) -> Any:
    """The step's remat: ``remat=``, else the levers' (``jmem.Levers.remat``).

    Raises:
      TypeError: ``levers`` that are not ``jmem.Levers``/``ResolvedLevers``.
      ValueError: ``remat=`` and ``levers.remat`` both given and different.
    """
    if levers is None:
        return remat
    if not isinstance(levers, (_levers.Levers, _levers.ResolvedLevers)):
        raise TypeError(f"levers must be a jmem.Levers; got {type(levers).__name__}.")
    if remat is not None and levers.remat is not None and remat != levers.remat:
        raise ValueError(
            f"remat={remat!r} and levers.remat={levers.remat!r} disagree; set one of them."
        )
    return levers.remat if remat is None else remat


def _parse_options(unknown: dict, **kw: Any) -> _Options:
    """Validates the builder's options (see ``train_step`` for the errors raised)."""
    if unknown:
        name = next(iter(unknown))
        hint = f"; it is now {_RENAMED[name]}=" if name in _RENAMED else ""
        raise TypeError(f"train_step() got an unexpected keyword argument {name!r}{hint}.")
    check_strategy(kw["strategy"])
    precision = kw["precision"]
    if isinstance(precision, str):
        precision = get_policy(precision)
    resolve_policy(kw["remat"])
    mb = kw["microbatches"]
    if isinstance(mb, bool) or not isinstance(mb, int):
        raise ValueError(f"microbatches must be an int >= 1; got {mb!r}.")
    if kw["microbatches"] < 1:
        raise ValueError(f"microbatches must be >= 1, got {kw['microbatches']}.")
    mode = kw.pop("offload_optimizer")
    if not isinstance(mode, (bool, str)) or mode not in _OFFLOAD_MODES:
        raise ValueError(
            f"offload_optimizer must be False, True (= 'whole_tree'), 'leaf_by_leaf' or 'disk', "
            f"got {mode!r}."
        )
    offload_, leaf_by_leaf = _OFFLOAD_MODES[mode]
    kw["offload_dir"] = _offload_dir(mode, kw["offload_dir"], kw["mesh"], kw["offload_params"])
    if kw["loss_scale"] is None:
        kw["loss_scale"] = NoOpLossScale()
    kw.update(precision=precision, jit_kwargs=dict(kw["jit_kwargs"] or {}))
    return _Options(offload=offload_, leaf_by_leaf=leaf_by_leaf, **kw)


#: Why the disk rung and streamed params do not combine (``train_step`` and the job say it).
DISK_WITH_STREAMED_PARAMS = (
    "the optimizer state on disk cannot be combined with params streamed from host memory: "
    "JAX 0.10 cannot lower a step whose ordered I/O callbacks meet host-memory arguments"
)


def _offload_dir(mode: Any, directory: Any, mesh: Any, streamed: bool = False) -> str | None:
    """The checked directory of ``offload_optimizer="disk"`` (None for other modes)."""
    if mode != "disk":
        if directory is not None:
            raise ValueError(
                f"offload_dir is only used with offload_optimizer='disk' (got "
                f"offload_optimizer={mode!r}); drop it or set offload_optimizer='disk'."
            )
        return None
    if directory is None:
        raise ValueError("offload_optimizer='disk' needs offload_dir=PATH (a directory).")
    if mesh is not None:
        raise ValueError(
            "offload_optimizer='disk' runs on one device (ordered I/O callbacks); drop mesh= "
            "or use offload_optimizer=True."
        )
    if streamed:
        raise ValueError(
            f"offload_optimizer='disk' with Levers(offload_params=True): "
            f"{DISK_WITH_STREAMED_PARAMS}; use offload_optimizer=True (host memory)."
        )
    return check_directory(directory, arg="offload_dir")


def _optimizers(optimizer: optax.GradientTransformation, o: _Options):
    """``(optimizer, stepper)``: mixed precision -> offload -> sharding constraints.

    ``optimizer`` is that stack as an optax transformation (``TrainStep.optimizer``, whose
    ``init`` builds the state); ``stepper`` is the same stack returning the new params,
    wrapped in ``skip_if_nonfinite`` when non-finite steps are skipped.
    """
    base = mixed_precision(optimizer) if o.master_weights else optimizer
    stepper = _stack(_new_params(base, o.master_weights), o)
    if o.skip_nonfinite:
        stepper = skip_if_nonfinite(
            stepper, select_inside=o.offload, select=True if o.mesh is not None else "auto"
        )
    return _stack(base, o), stepper


def _stack(inner: optax.GradientTransformation, o: _Options):
    """Offload, then sharding constraints, each an optax wrapper (when enabled)."""
    if o.offload_dir is not None:
        inner = offload(inner, memory_kind="disk", directory=o.offload_dir)
    elif o.offload:
        inner = offload(inner, leaf_by_leaf=o.leaf_by_leaf)
    if o.mesh is not None:
        inner = constrain_gradients(inner, o.mesh, o.strategy)
    return inner


def _new_params(inner: optax.GradientTransformation, master_weights: bool):
    """``inner`` returning the new params in place of the updates.

    With master weights the new params are the new fp32 masters cast down
    (``params_from_masters``), computed where the masters are: inside the offloaded update
    when the state lives in host memory. Same state as ``inner``.
    """
    inner = optax.with_extra_args_support(inner)

    def update(grads, state, params=None, **extra_args):
        updates, state = inner.update(grads, state, params, **extra_args)
        if master_weights:
            return params_from_masters(state, params), state
        return optax.apply_updates(params, updates), state

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _differentiable_loss(loss_fn: Callable, o: _Options) -> Callable:
    """The loss the step differentiates: precision cast, loss scale, then ``jmem.remat``."""
    loss = functools.partial(_scaled_loss, loss_fn, o)
    return _remat(loss, o.remat) if resolve_policy(o.remat) is not None else loss


def _scaled_loss(loss_fn, o: _Options, diff, batch, frozen, scale, dropout_key=None):
    """``(scale * loss, (loss, aux))`` of ``loss_fn`` on ``diff = (params, fp8)``."""
    params, fp8 = diff
    if o.precision is not None:
        params = o.precision.cast_to_compute(params)
    pairs = (("frozen", frozen), ("fp8", fp8), ("dropout_key", dropout_key))
    extras = {k: v for k, v in pairs if v is not None}
    out = loss_fn(params, batch, **extras)
    loss, aux = out if o.has_aux else (out, None)
    loss = jnp.asarray(loss, jnp.float32)
    return scale.scale(loss), (loss, aux)


def _precision_checked(loss_fn: Callable, o: _Options, step: Callable, state, batch):
    """``step(state, batch)``, the loss's matmul dtypes checked against the precision
    policy first (once per loss function and process; a trace of one microbatch's loss on
    shapes only: ``precision_check``)."""
    loss, args = _microbatch_loss(loss_fn, o, state, batch)
    warn_if_precision_ignored(loss_fn, o.precision.compute_dtype, loss, *args)
    return step(state, batch)


def _microbatch_loss(loss_fn: Callable, o: _Options, state, batch):
    """``(loss, args)``: the unscaled loss of one microbatch as the step calls it (casts
    included) and its arguments, the microbatch as ``ShapeDtypeStruct``s, for a trace."""
    m = o.microbatches
    mb = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype), batch
    )

    def loss(diff, mb, frozen, scale, key_data):
        key = None if key_data is None else jax.random.wrap_key_data(key_data)
        return _scaled_loss(loss_fn, o, diff, mb, frozen, scale, key)[1][0]

    args = ((state.params, state.fp8), mb, state.frozen, state.loss_scale, state.dropout_key)
    return loss, args


def _fp8_checked(loss_fn: Callable, levers, o: _Options, step: Callable, state, batch):
    """``step(state, batch)``, refused when ``levers.fp8`` is set but the state has no FP8
    metas or the loss runs no FP8 matmul (``fp8_check``: a trace of one microbatch's loss
    on shapes only, once per loss function and process once it passes)."""
    loss, args = _microbatch_loss(loss_fn, o, state, batch)
    check_fp8_levers(loss_fn, levers, state.fp8, loss, *args)
    return step(state, batch)


def _key_data(key: Any) -> Any:
    """The uint32 data of a PRNG key (typed keys unwrapped; raw keys and None as given)."""
    if key is not None and jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return key


def _init_state(
    optimizer, o: _Options, params, frozen, fp8, loss_scale, dropout_key=None
) -> TrainState:
    """The initial state: optimizer state from ``params``, then params in the param dtype."""
    callers = {id(x) for x in jax.tree.leaves((params, frozen, fp8))}
    opt_state = optimizer.init(params)
    if o.precision is not None:
        params = o.precision.cast_to_param(params)
    # The step donates the state: own fresh buffers, so the caller's arrays survive.
    params, frozen, fp8 = _fresh((params, frozen, fp8), callers)
    if o.offload_params:  # the model streams them from host memory (levers.offload_params)
        frozen = params_to_host(frozen)
        if frozen is None:  # full fine-tuning: the trainable params are the streamed ones
            params = params_to_host(params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        loss_scale=o.loss_scale if loss_scale is None else loss_scale,
        frozen=frozen,
        fp8=fp8,
        dropout_key=dropout_key,
    )


def _fresh(tree: Any, ids: set[int]) -> Any:
    """Copies the leaves of ``tree`` that are the caller's own arrays (``id`` in ``ids``)."""

    def copy(x):
        own = id(x) in ids and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        return jnp.array(x, copy=True) if own else x

    return jax.tree.map(copy, tree)


def _step(loss: Callable, stepper, o: _Options, state: TrainState, batch: Any):
    """One training step: ``(state, batch) -> (state, metrics)``."""
    (grads, fp8), (loss_value, aux) = _gradients(loss, state, batch, o.microbatches)
    grads, finite, new_scale, grad_norm = _unscale(grads, state, o)
    grads, grad_norm, finite = _norm_before_update(grads, finite, o, grad_norm)
    skip_args = {"finite": finite} if o.skip_nonfinite else {}
    params, opt_state = stepper.update(grads, state.opt_state, state.params, **skip_args)
    new = _advance(state, params, opt_state, fp8, finite, new_scale, o)
    metrics = {
        "loss": loss_value,
        "grad_norm": grad_norm,
        "loss_scale": jnp.asarray(getattr(new_scale, "loss_scale", 1.0), jnp.float32),
        "grads_finite": finite,
        "step": new.step,
    }
    if o.has_aux:
        metrics["aux"] = aux
    return new, metrics


def _gradients(loss: Callable, state: TrainState, batch: Any, microbatches: int):
    """``((grads, new fp8 metadata), (loss, aux))``, accumulated over microbatches."""

    def grad_fn(diff, mb, key=None):
        return jax.grad(loss, has_aux=True)(diff, mb, state.frozen, state.loss_scale, key)

    diff = (state.params, state.fp8)
    key = None
    if state.dropout_key is not None:  # this step's key; microbatch i folds in i
        key = jax.random.fold_in(jax.random.wrap_key_data(state.dropout_key), state.step)
    return accumulate_gradients(grad_fn, diff, batch, microbatches, maximum=(False, True), key=key)


def _unscale(grads: Any, state: TrainState, o: _Options):
    """``(grads, finite, new loss scale, norm or None)``: unscaled grads, checked once after
    accumulation. Host-resident gradients (full-parameter training with streamed params)
    are read one layer at a time for the check, and their norm is taken in the same pass."""
    scale = state.loss_scale
    if o.master_weights and not isinstance(scale, NoOpLossScale):
        # unscale in float32: fp16 would flush tiny gradients again
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) if is_float_array(g) else g, grads)
    grads = scale.unscale(grads)
    norm = None
    if any(in_host_space(g) for g in jax.tree.leaves(grads)):
        norm, finite = streamed_norm_and_finite(grads)
    else:
        finite = all_finite(grads)
    if not o.master_weights:  # keep the optimizer state's dtypes stable across steps
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    return grads, finite, scale.adjust(finite), norm


def _norm_before_update(grads: Any, finite: jax.Array, o: _Options, norm: Any = None):
    """``(grads, grad_norm, finite)`` with the norm computed before the update.

    An update may write over the gradients' buffers (chunked 8-bit Adam does), and a read
    after it costs a copy. Under the ``lax.cond`` of ``skip_if_nonfinite`` the branch
    predicate reads the norm (a term that is always true: a norm is never negative,
    NaN < 0 is false); elsewhere an optimization barrier orders it. ``norm``: the norm
    when already taken (``_unscale``'s, for host-resident gradients).
    """
    grad_norm = optax.tree.norm(grads) if norm is None else norm
    if o.skip_nonfinite and not o.offload and o.mesh is None and not uses_select("auto"):
        return grads, grad_norm, jnp.logical_and(finite, jnp.logical_not(grad_norm < 0))
    grads, grad_norm = jax.lax.optimization_barrier((grads, grad_norm))
    return grads, grad_norm, finite


def _advance(state, params, opt_state, fp8, finite, new_scale, o: _Options) -> TrainState:
    """The next state; a skipped step keeps step count and FP8 metadata."""
    step, fp8 = state.step + 1, fp8 if state.fp8 is not None else None
    if o.skip_nonfinite:
        step, fp8 = select_tree(finite, (step, fp8), (state.step, state.fp8))
    return state.replace(
        step=step, params=params, opt_state=opt_state, fp8=fp8, loss_scale=new_scale
    )


def _jit(step: Callable, init: Callable, o: _Options) -> tuple[Callable, Callable]:
    """``(jitted step, init)``: sharded by ``jmem.sharding``'s rules with a mesh."""
    if o.mesh is None:
        donate = (0,) if o.donate else ()
        # One compiled program builds the state (op-by-op 8-bit quantization is slow); on
        # disk, init writes files leaf by leaf (jitted per leaf) and runs eagerly.
        init = init if o.offload_dir is not None else jax.jit(init)
        return jax.jit(step, donate_argnums=donate, **o.jit_kwargs), init
    kind = "pinned_host" if o.offload else None
    jitted = ShardedStep(
        step,
        o.mesh,
        o.strategy,
        donate=o.donate,
        jit_kwargs=o.jit_kwargs,
        opt_state_memory_kind=kind,
        offload_params=o.offload_params,
    )
    init = sharded_init(
        init, o.mesh, o.strategy, opt_state_memory_kind=kind, offload_params=o.offload_params
    )
    return jitted, init


def _opt_state_to_host(state: TrainState) -> TrainState:
    """Moves optimizer-state leaves that arrive in device memory (e.g. restored from a
    checkpoint into an abstract target) to ``pinned_host``, as the offloaded step expects;
    a donated buffer of the wrong memory kind would abort the runtime."""
    leaves = [x for x in jax.tree.leaves(state.opt_state) if isinstance(x, jax.Array)]
    if all(getattr(x.sharding, "memory_kind", None) == "pinned_host" for x in leaves):
        return state
    return state.replace(opt_state=to_host(state.opt_state))
