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
        flat.extend(leaves)
        specs.extend([leaf_spec] * len(leaves))
        defs.append((treedef, len(leaves)))

    def body(*args):
        args, vals = list(args), []
        for d in defs:
            if d is None:
                vals.append(args.pop(0))
            else:
                vals.append(jax.tree.unflatten(d[0], args[: d[1]]))
                del args[: d[1]]
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
