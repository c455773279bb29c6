"""The ``shard_map`` rule of the NF4/LoRA interpreter: a ``jax.shard_map`` whose operands
include an implicit ``Weight`` (expert parallelism's local experts,
``jmem._src.expert_parallel``) is rebound as a ``shard_map`` over the weight's arrays
(NF4 codes and scales, LoRA factors, dropout keys), each split as the weight's spec
says, and its body is interpreted with the local ``Weight`` rebuilt from the local
arrays: the rules inside (the grouped matmul's) see the device's own slice.

A weight may be replicated (``P()``) or split on its leading stacked axis only (``P(axis)``
on a view whose axis 0 is the stored axis 0); every array of the weight then carries
that stacked axis first and is split on it. Anything else raises ``ImplicitWeightError``
(or, with ``allow_materialize``, is merged for the call).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from jmem._src import partial_sums
from jmem._src.implicit.weight import Weight
from jmem._src.implicit.weight import error
from jmem._src.implicit.weight import is_weight

__all__ = ["shard_map"]


def _axis_size(mesh, entry) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(int(sizes[n]) for n in names)


def _split(w: Weight, spec, mesh) -> tuple[str, Weight | None, P | None]:
    """``(why not, the weight with local metadata, its arrays' spec)``."""
    spec = tuple(spec)
    if all(s is None for s in spec):
        return "", w, P()
    if any(s is not None for s in spec[1:]):
        return "only the leading stacked axis of a weight can be split", None, None
    if w.n_lead < 1 or w.perm[0] != 0:
        return "a weight split on an axis that is not its stacked axis", None, None
    n = _axis_size(mesh, spec[0])
    lead = w.base_shape[: w.n_lead]
    if lead[0] % n:
        return f"its stacked axis {lead[0]} is not a multiple of {n} devices", None, None
    for leaf in jax.tree.leaves(w):
        if not getattr(leaf, "shape", ()) or leaf.shape[0] != lead[0]:
            return "an array of the weight without the stacked axis first", None, None
    local = w.map_lead(lambda a: a, (lead[0] // n, *lead[1:]))
    return "", local, P(spec[0])


def _slots(p) -> tuple[int, P]:
    """The per-device slots over the body's manual axes (``partial_sums.slots``)."""
    return partial_sums.slots(p["mesh"], p["newly_manual_axes"])


def _sinks(leaves: list, leaf_spec: P, p) -> list:
    """Per array of a replicated weight, its ``partial_sums.sink`` (None for an integer
    array) when the body is unchecked (``check_vma=False``, whose transpose would ``psum``
    the float arrays' cotangents inside it); all None otherwise."""
    if p["check_vma"] or any(s is not None for s in tuple(leaf_spec)):
        return [None] * len(leaves)
    n, spec = _slots(p)
    return [partial_sums.sink(w, n, spec) for w in leaves]


def shard_map(interp, eqn, invals):
    """``shard_map`` receiving ``Weight`` operands (module docstring)."""
    p = eqn.params
    mesh = p["mesh"]
    flat, specs, defs = [], [], []
    for v, spec in zip(invals, p["in_specs"]):
        if not is_weight(v):
            flat.append(v)
            specs.append(spec)
            defs.append(None)
            continue
        why, local, leaf_spec = _split(v, spec, mesh)
        if why:
            return interp.fallback(eqn, invals, v, why)
        leaves, treedef = jax.tree.flatten(local)
        sinks = _sinks(leaves, leaf_spec, p)
        mask = [s is not None for s in sinks]
        sinks = [s for s in sinks if s is not None]
        flat.extend([*leaves, *sinks])
        specs.extend([leaf_spec] * len(leaves) + [_slots(p)[1]] * len(sinks))
        defs.append((treedef, len(leaves), mask))

    def body(*args):
        args, vals = list(args), []
        for d in defs:
            if d is None:
                vals.append(args.pop(0))
                continue
            treedef, n, mask = d
            leaves, sinks = args[:n], iter(args[n : n + sum(mask)])
            del args[: n + sum(mask)]
            leaves = [partial_sums.attach(w, next(sinks)) if m else w for w, m in zip(leaves, mask)]
            vals.append(jax.tree.unflatten(treedef, leaves))
        outs = interp.eval(p["jaxpr"], (), vals)
        for o in outs:
            if is_weight(o):
                raise error(o, "shard_map", "a selected weight returned from the body")
        return tuple(outs)

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(specs),
        out_specs=tuple(p["out_specs"]),
        check_vma=p["check_vma"],
        axis_names=set(p["newly_manual_axes"]),
    )
    return list(fn(*flat))
