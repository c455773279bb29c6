"""LoRA: low-rank adapters kept as their own pytree, applied without merging weights.

``apply(fn)`` computes ``x·W + s·(x·a)·b`` at every selected matmul through the
implicit-weight interpreter (``jmem/_src/implicit/``). Semantics follow Hu et al. 2021
("LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685) and Hugging Face
PEFT's ``LoraLayer``. Design and limits: ``docs/lora.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp

from jmem._src import lora_modules as _lora_modules
from jmem._src import model_table as _model_table
from jmem._src import nf4 as _nf4
from jmem._src import tree as _tree
from jmem._src.implicit import interpreter as _implicit
from jmem._src.implicit import modules as _modules

__all__ = ["LoraWeight", "init", "apply", "merge", "num_trainable", "DEFAULT_MODULES"]

#: Default modules, as PEFT's default for Llama: the query and value projections; on a
#: mixture-of-experts model also every expert's gate, up and down projections.
DEFAULT_MODULES = _modules.LORA_DEFAULT_MODULES

#: Last path keys never adapted, whatever ``modules`` says: biases (Qwen2's q/k/v biases are
#: ``[L, out]`` when stacked, rank 2 like a matrix) and norm scales. PEFT adapts only the
#: weight of a target module, never its bias or a norm.
_NEVER_ADAPTED = ("bias", "scale")


#: A keyword argument not passed.
_UNSET = object()


def renamed_keyword(where: str, old, new, default):
    """``new``, or the value of the deprecated keyword ``targets=`` (``old``) with a
    ``DeprecationWarning``; both passed raises ``TypeError``."""
    if old is _UNSET:
        return new
    if new is not default:
        raise TypeError(f"{where}: pass modules= only (targets= is its deprecated name).")
    warnings.warn(
        f"{where}(targets=...) is deprecated; pass modules=... (the same values).",
        DeprecationWarning,
        stacklevel=3,
    )
    return old


def _chosen(adaptable: list, modules) -> list:
    """The ``(path, leaf)`` of ``adaptable`` that ``modules`` (names, regex or predicate)
    selects; raises ``ValueError`` (``lora_modules.choose``'s, naming the modules of the
    weights LoRA may adapt) when none is or a name matches none."""
    if callable(modules):
        pred = _tree.path_predicate(modules)
        chosen = [(p, x) for p, x in adaptable if pred(p, x)]
        if not chosen:
            raise ValueError(
                f"No weight of rank >= 2 (biases and norm scales excluded) is selected by "
                f"modules={modules!r}; paths are {[p for p, _ in adaptable][:20]}."
            )
        return chosen
    if not isinstance(modules, (str, list, tuple)):
        _tree.path_predicate(modules)  # the TypeError naming what modules= takes
    paths = set(_lora_modules.choose(modules, [p for p, _ in adaptable]))
    return [(p, x) for p, x in adaptable if p in paths]


def _adaptable(path: str, leaf) -> bool:
    """A weight LoRA may adapt: rank >= 2, not a bias or norm scale (last key) and not in a
    mixture of experts' router (a module named ``router``)."""
    keys = path.split("/")
    return (
        len(getattr(leaf, "shape", ())) >= 2
        and keys[-1] not in _NEVER_ADAPTED
        and not any(k in _model_table.ROUTER_NAMES for k in keys)
    )


@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """Adapter of one weight ``W [*L, in, out]``: ``W + scale * a @ b``.

    Attributes:
      a: ``[*L, in, r]`` (PEFT's ``lora_A.weight`` transposed), random at init.
      b: ``[*L, r, out]`` (PEFT's ``lora_B.weight`` transposed), zeros at init.
      scale: static float, ``alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA).
      dropout: static dropout probability on the adapter's input (PEFT's ``lora_dropout``);
        applied when the applied function gets a ``lora_dropout_key`` (training without
        one raises: ``apply``).
      alpha: static LoRA alpha (PEFT's ``lora_alpha``); ``None``: derived from ``scale``.
      use_rslora: static, whether ``scale`` is ``alpha / sqrt(r)`` (PEFT's ``use_rslora``).
      init_lora_weights: static, how ``a``/``b`` were initialized (PEFT's name and values:
        ``True``, ``"gaussian"`` or ``False``); recorded in ``adapter_config.json``.
    """

    a: Any
    b: Any
    scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    dropout: float = dataclasses.field(default=0.0, metadata=dict(static=True))
    alpha: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    use_rslora: bool = dataclasses.field(default=False, metadata=dict(static=True))
    init_lora_weights: bool | str = dataclasses.field(default=True, metadata=dict(static=True))

    @property
    def rank(self) -> int:
        """The adapter rank ``r`` (``a.shape[-1]``)."""
        return int(self.a.shape[-1])

    @property
    def lora_alpha(self) -> float:
        """``alpha``, or when unset the alpha that gives ``scale`` (``scale * r``, or
        ``scale * sqrt(r)`` with rsLoRA), rounded to an integer when within 1e-9 of one."""
        if self.alpha is not None:
            return self.alpha
        r = self.rank
        x = self.scale * (math.sqrt(r) if self.use_rslora else r)
        return float(round(x)) if abs(x - round(x)) <= 1e-9 * max(1.0, abs(x)) else x

    def delta(self, dtype=jnp.float32) -> jax.Array:
        """The dense update ``scale * a @ b`` ``[*L, in, out]`` (materializes it)."""
        d = jnp.einsum("...ir,...ro->...io", self.a.astype(jnp.float32), self.b.astype(jnp.float32))
        return (d * self.scale).astype(dtype)


jax.tree_util.register_dataclass(
    LoraWeight,
    data_fields=["a", "b"],
    meta_fields=["scale", "dropout", "alpha", "use_rslora", "init_lora_weights"],
)


def _init_choice(init_lora_weights, init, use_rslora, rslora):
    """Resolves the PEFT-named options against their older jmem names (``init``, ``rslora``)."""
    if init is not None:
        if init not in ("kaiming", "gaussian"):
            raise ValueError(f"init must be 'kaiming' or 'gaussian'; got {init!r}.")
        old = True if init == "kaiming" else "gaussian"
        if init_lora_weights is not True and init_lora_weights != old:
            raise ValueError(
                f"init={init!r} contradicts init_lora_weights={init_lora_weights!r}; "
                "pass only init_lora_weights (PEFT's name)."
            )
        init_lora_weights = old
    if init_lora_weights == "default":
        init_lora_weights = True
    if isinstance(init_lora_weights, str) and init_lora_weights.lower() == "gaussian":
        init_lora_weights = "gaussian"
    if not (
        init_lora_weights is True or init_lora_weights is False or init_lora_weights == "gaussian"
    ):
        raise ValueError(
            f"init_lora_weights must be True (kaiming-uniform a, zero b), 'gaussian' "
            f"(a ~ N(0, 1/r^2), zero b) or False (random a and b); got {init_lora_weights!r}. "
            "PEFT's data- or SVD-based inits (pissa, olora, loftq, eva, corda, ...) are not "
            "implemented."
        )
    if rslora is not None:
        if use_rslora and not rslora:
            raise ValueError("rslora=False contradicts use_rslora=True; pass only use_rslora.")
        use_rslora = bool(rslora)
    return init_lora_weights, bool(use_rslora)


def _init_factors(key, shape, rank: int, how, dtype):
    """``(a, b)`` for a weight of ``shape [*L, in, out]``, initialized as PEFT's ``how``."""
    *lead, fan_in, fan_out = shape
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) on lora_A [r, in]
    if how == "gaussian":
        a = jax.random.normal(key, (*lead, fan_in, rank), jnp.float32) / rank
    else:
        a = jax.random.uniform(key, (*lead, fan_in, rank), jnp.float32, -bound, bound)
    if how is False:  # nn.Linear(r, out)'s default init of lora_B [out, r]: U(+-1/sqrt(r))
        b_bound = 1.0 / math.sqrt(rank)
        b = jax.random.uniform(
            jax.random.fold_in(key, 1), (*lead, rank, fan_out), jnp.float32, -b_bound, b_bound
        )
    else:
        b = jnp.zeros((*lead, rank, fan_out), jnp.float32)
    return a.astype(dtype), b.astype(dtype)


def init(
    key: jax.Array,
    params,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    modules: str | Sequence[str] | Callable[[str, Any], bool] = DEFAULT_MODULES,
    init_lora_weights: bool | str = True,
    use_rslora: bool = False,
    dropout: float = 0.0,
    dtype=jnp.float32,
    init: str | None = None,
    rslora: bool | None = None,
    targets: Any = _UNSET,
) -> dict[str, LoraWeight]:
    """Creates LoRA adapters for the weights of ``params`` that ``modules`` selects.

    Options are named as in PEFT's ``LoraConfig`` (``r`` -> ``rank``, ``lora_alpha`` ->
    ``alpha``, ``lora_dropout`` -> ``dropout``) and are recorded on each ``LoraWeight`` so
    ``jmem.models.hf.save_adapters`` writes them to ``adapter_config.json``.

    Args:
      key: PRNG key.
      params: the base params pytree (arrays, ``NF4Array`` or ``ShapeDtypeStruct`` leaves).
      rank: r, the adapter rank (>= 1).
      alpha: LoRA alpha; the scale is ``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA).
      modules: module names as PEFT's ``target_modules`` (a list or tuple such as
        ``["q_proj", "v_proj"]``: a weight whose module path, its path less the last key,
        is a name or ends with ``/name``; each name must match), a regex matched
        (``re.fullmatch``) against each leaf's '/'-joined path, or a predicate
        ``(path, leaf) -> bool``. Only weights are adapted, as in PEFT (which
        adapts a module's weight, never its bias): leaves of rank >= 2 whose last path key
        is not ``bias`` or ``scale`` (so ``.*q_proj.*`` takes ``layers/q_proj/kernel``, not
        Qwen2's stacked ``layers/q_proj/bias [L, out]`` nor a stacked norm scale); rank-3+
        leaves are stacks ``[*L, in, out]``.
      init_lora_weights: as PEFT (``LoraLayer.reset_lora_parameters``): ``True`` (or
        ``"default"``): ``a ~ U(-1/sqrt(in), 1/sqrt(in))`` (kaiming-uniform, ``a=sqrt(5)``),
        ``b = 0``; ``"gaussian"``: ``a ~ N(0, (1/r)^2)``, ``b = 0``; ``False``: ``a`` as
        ``True`` and ``b ~ U(-1/sqrt(r), 1/sqrt(r))`` (nn.Linear's init; for testing: the
        adapter is not a no-op at init).
      use_rslora: rank-stabilized scaling ``alpha / sqrt(rank)`` (Kalajdzievski 2023).
      dropout: probability in ``[0, 1)`` of dropping an element of the adapter's input
        (PEFT's ``lora_dropout``: ``y = x·W + s·(dropout(x)·a)·b``). Applied when the
        ``lora.apply``'d function is called with ``lora_dropout_key=key``; with
        ``lora_dropout_key=None`` (or, for an evaluation that is not differentiated, none)
        the output is bitwise that of ``dropout=0``; differentiating without the argument
        raises (``apply``).
      dtype: dtype of ``a`` and ``b`` (float32 by default, as PEFT keeps adapters).
      init: older name of ``init_lora_weights``: ``"kaiming"`` (= ``True``) or ``"gaussian"``.
      rslora: older name of ``use_rslora``.
      targets: deprecated name of ``modules``.

    Returns:
      ``{path: LoraWeight}``, ordered as the leaves of ``params``.

    Raises:
      ValueError: for rank < 1, alpha <= 0, a dropout outside ``[0, 1)``, an unknown or
        contradictory init choice, a module name that matches no weight, or when no
        weight is selected.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int; got {rank!r}.")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be in [0, 1); got {dropout!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(
            f"alpha must be a number > 0 (the scale is alpha / rank; 0 would make adapters "
            f"that never change the output, so never learn); got {alpha!r}."
        )
    how, use_rslora = _init_choice(init_lora_weights, init, use_rslora, rslora)
    scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    modules = renamed_keyword("lora.init", targets, modules, DEFAULT_MODULES)
    flat, _ = _implicit.flatten_params(params)
    chosen = _chosen([(p, x) for p, x in flat if _adaptable(p, x)], modules)
    keys = jax.random.split(key, len(chosen))
    out: dict[str, LoraWeight] = {}
    for k, (path, w) in zip(keys, chosen):
        a, b = _init_factors(k, w.shape, rank, how, dtype)
        out[path] = LoraWeight(
            a=a,
            b=b,
            scale=float(scale),
            dropout=float(dropout),
            alpha=float(alpha),
            use_rslora=use_rslora,
            init_lora_weights=how,
        )
    return out


#: ``lora_dropout_key`` not passed (``None`` passed says "no dropout" explicitly).
_NO_KEY = object()


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _no_dropout_key(message: str, a, b):
    """Identity on an adapter's factors whose derivative raises ``ValueError(message)``:
    a differentiated call of ``fn_lora`` without ``lora_dropout_key`` (under ``jit``,
    ``checkpoint``, ``scan`` or any nesting, since the rule runs wherever JAX
    differentiates it); an evaluation, which is not differentiated, is untouched."""
    return a, b


@_no_dropout_key.defjvp
def _no_dropout_key_jvp(message, primals, tangents):
    raise ValueError(message)


def _refuse_training_without_key(lora):
    """``lora`` with the factors of each adapter of ``dropout > 0`` passed through
    ``_no_dropout_key``; adapters without dropout (and ``None``) are returned as they are."""
    if not lora or not any(getattr(w, "dropout", 0.0) > 0 for w in lora.values()):
        return lora
    out = dict(lora)
    for path, w in lora.items():
        if getattr(w, "dropout", 0.0) > 0:
            message = (
                f"LoRA adapter {path!r} has dropout={w.dropout}, but the lora.apply'd function "
                "is differentiated without lora_dropout_key=, so it would train with no "
                "dropout. Pass lora_dropout_key=<a new PRNG key each step> (in "
                "jmem.train_step: step.init(..., dropout_key=key) and forward the loss_fn's "
                "dropout_key= argument), or lora_dropout_key=None to train without dropout."
            )
            a, b = _no_dropout_key(message, w.a, w.b)
            out[path] = dataclasses.replace(w, a=a, b=b)
    return out


def apply(fn: Callable, *, allow_materialize: bool = False) -> Callable:
    """Wraps ``fn(params, *args, **kwargs)`` as ``fn_lora(params, lora, *args, **kwargs)``.

    ``fn_lora`` computes ``fn(merge(params, lora), ...)`` as ``x·W + s·(x·a)·b`` at each
    selected matmul (no merged weight is built). ``params`` may contain ``NF4Array`` leaves
    (QLoRA: dequantized per matmul, recomputed in backward). ``lora`` may be ``None``.

    LoRA dropout (PEFT's ``lora_dropout``): ``fn_lora(params, lora, *args,
    lora_dropout_key=key, **kwargs)`` computes ``x·W + s·(dropout(x)·a)·b`` for adapters
    with ``dropout > 0``: each element of the adapter's input is zeroed with probability
    ``dropout`` and the rest scaled by ``1 / (1 - dropout)`` (inverted dropout, as
    ``torch.nn.Dropout`` in training); the base matmul ``x·W`` sees ``x`` unchanged. Every
    adapted weight, every layer of a stacked weight and every matmul using it draws its own
    mask from ``key``. With ``lora_dropout_key=None`` the call is bitwise the same as with
    ``dropout = 0``. Without the argument it is too, for evaluation (``fn_lora`` called
    plainly, e.g. by ``jmem.models.llama.generate``), but differentiating such a call with
    respect to adapters of ``dropout > 0`` raises ``ValueError`` naming
    ``lora_dropout_key``: training would silently use no dropout (as ``flax.linen.Dropout``
    refuses to guess ``deterministic``). ``lora_dropout_key`` is consumed here and not
    passed to ``fn``.

    Args:
      fn: any JAX function whose first argument is a params pytree: a pure model function,
        an NNX ``nnx.merge(graphdef, state)(x)`` wrapper, the reference Llama.
      allow_materialize: where a selected weight cannot stay implicit (see ``docs/lora.md``),
        materialize its merged, dequantized value for that operation instead of raising.

    Returns:
      ``fn_lora(params, lora, *args, lora_dropout_key=..., **kwargs)``.

    Raises (when called):
      ValueError: an adapter path missing from ``params`` or of the wrong shape; when
        differentiated (``jax.grad``, ``jax.vjp``, ...) with respect to an adapter of
        ``dropout > 0`` and called without ``lora_dropout_key`` (pass a key to train with
        dropout, ``None`` to train without).
      jmem.lora.ImplicitWeightError: a selected weight used other than in a matmul (also
        with ``allow_materialize`` when dropout is active: a merged weight cannot drop its
        adapter's input).
    """

    @functools.wraps(fn)
    def fn_lora(params, lora, *args, lora_dropout_key=_NO_KEY, **kwargs):
        if lora_dropout_key is _NO_KEY:
            lora, lora_dropout_key = _refuse_training_without_key(lora), None
        return _implicit.call(
            fn,
            params,
            lora,
            args,
            kwargs,
            allow_materialize=allow_materialize,
            dropout_key=lora_dropout_key,
        )

    return fn_lora


def merge(params, lora: dict[str, LoraWeight]):
    """Merges and unloads: returns params with ``W + scale * a @ b`` at each adapted leaf.

    ``NF4Array`` leaves with an adapter are dequantized (to their original dtype) and merged;
    other leaves are returned as they are. The result has ``W``'s dtype.

    Args:
      params: the base params pytree (arrays or ``NF4Array`` leaves).
      lora: ``{path: LoraWeight}`` (``init``).

    Returns:
      ``params`` with each adapted leaf replaced by its merged dense weight.

    Raises:
      ValueError: if an adapter names no leaf of ``params``.
    """
    flat, treedef = _implicit.flatten_params(params)
    names = {p for p, _ in flat}
    missing = sorted(set(lora) - names)
    if missing:
        raise ValueError(f"LoRA adapters for {missing} have no matching leaf in params.")
    out = []
    for path, w in flat:
        ad = lora.get(path)
        if ad is None:
            out.append(w)
            continue
        dense = _nf4.dequantize(w, w.dtype) if isinstance(w, _nf4.NF4Array) else w
        out.append((dense.astype(jnp.float32) + ad.delta(jnp.float32)).astype(dense.dtype))
    return jax.tree.unflatten(treedef, out)


def num_trainable(lora: dict[str, LoraWeight]) -> int:
    """Number of trainable parameters (elements of every ``a`` and ``b``)."""
    return sum(int(math.prod(x.shape)) for x in jax.tree.leaves(lora))
