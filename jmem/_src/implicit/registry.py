"""The open rule registry of the implicit-weight interpreter (in the spirit of
``quax.register``): ``register(primitive, rule)`` adds a rule for equations of that primitive
that receive a ``Weight``; a kind of implicit value (FP8 matmuls, ``jmem._src.fp8_apply``)
brings its own rules and the core never imports it. Source: quax (``quax/_core.py``)."""

from __future__ import annotations

from typing import Callable

#: Primitive name -> its rules, most recently registered first.
_RULES: dict[str, list[Callable]] = {}


def register(primitive, rule: Callable, *, last: bool = False) -> Callable:
    """Registers ``rule(interp, eqn, invals) -> outs`` for equations of ``primitive`` (a
    ``jax.extend.core.Primitive`` or its name) that receive a ``Weight``.

    Rules registered later are tried first; a rule returns ``NotImplemented`` to leave the
    equation to the next one (e.g. an FP8 rule for the one ``custom_vjp_call`` it
    recognizes). ``last=True`` adds a fallback, tried after every other rule. Returns
    ``rule``.

    Raises:
      TypeError: ``primitive`` is neither a primitive nor a str, or ``rule`` not callable.
    """
    name = primitive if isinstance(primitive, str) else getattr(primitive, "name", None)
    if not isinstance(name, str) or not callable(rule):
        raise TypeError(
            f"register(primitive, rule) takes a JAX primitive (or its name) and a callable "
            f"rule(interp, eqn, invals); got {primitive!r}, {rule!r}."
        )
    rules = _RULES.setdefault(name, [])
    if rule not in rules:
        rules.append(rule) if last else rules.insert(0, rule)
    return rule


def rules_for(name: str) -> list[Callable]:
    """The rules registered for the primitive ``name``, most recent first."""
    return _RULES.get(name, [])
