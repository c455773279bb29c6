"""Which weights LoRA adapts, as ``--lora-targets`` (``jmem finetune``, ``jmem estimate``, a
config file) writes it: module names as PEFT's ``target_modules`` (``q_proj,v_proj``; a name
matches a weight whose module path ends with it), ``all`` (every linear projection; PEFT's
``all-linear`` too) or, for anything else, a regex matched in full against '/'-joined weight
paths (``.*(q_proj|v_proj).*``). ``parse`` turns a value into one canonical string, which the
job, its dry run, ``estimate`` and the run directory hold; ``modules`` turns that into the
``modules=`` of ``jmem.lora.init``. No JAX import (config parsing and ``--help`` need none).
"""

from __future__ import annotations

import argparse
import re
from typing import Sequence

from jmem._src.cli import did_you_mean
from jmem._src.model_table import EXPERT_LINEAR_NAMES
from jmem._src.model_table import FUSED_LINEAR_NAMES
from jmem._src.model_table import LINEAR_NAMES
from jmem._src.model_table import ROUTER_NAMES

__all__ = [
    "ALL",
    "EXPERT_SPELLINGS",
    "FORMS",
    "PROJECTION_NAMES",
    "choose",
    "linear_names",
    "module_names",
    "modules",
    "parse",
    "planner_names",
]

#: The canonical value for every linear projection.
ALL = "all"
#: Spellings of ``ALL`` (PEFT writes ``target_modules="all-linear"``).
_ALL_SPELLINGS = ("all", "all-linear", "all_linear")
#: The default's regex spelling, which run.json files may hold: on every reference model it
#: selects the weights that ``all`` selects.
_ALL_AS_REGEX = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*"
#: The module names of ``all``: the reference model's projections, fused ones included, and
#: a mixture of experts' expert projections (never its router).
PROJECTION_NAMES = (
    LINEAR_NAMES
    + tuple(n for n in FUSED_LINEAR_NAMES if n not in LINEAR_NAMES)
    + EXPERT_LINEAR_NAMES
)
#: The expert projections a PEFT/Hugging Face name also picks on a mixture-of-experts model:
#: transformers 4's per-expert ``nn.Linear`` names (Qwen-MoE's ``gate_proj``/``up_proj``/
#: ``down_proj``, Mixtral's ``w1``/``w3``/``w2``; PEFT converts such adapters to the fused
#: experts of transformers 5), transformers 5's fused parameters (``gate_up_proj``,
#: ``down_proj``) and their module, ``experts``.
EXPERT_SPELLINGS = {
    "gate_proj": ("expert_gate",),
    "up_proj": ("expert_up",),
    "down_proj": ("expert_down",),
    "gate_up_proj": ("expert_gate", "expert_up"),
    "w1": ("expert_gate",),
    "w3": ("expert_up",),
    "w2": ("expert_down",),
    "experts": EXPERT_LINEAR_NAMES,
}
#: Names of a router (jmem's and transformers' ``mlp.gate``): LoRA never adapts it.
_ROUTER_SPELLINGS = ROUTER_NAMES + ("gate",)
#: A fused projection's parts, as the planner (which knows only ``LINEAR_NAMES``) counts it.
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    # a mixture of experts' projections, which the planner counts as the MLP's (one LoRA
    # pair per expert: ``ModelShape.lora_elements``)
    "expert_gate": ("gate_proj",),
    "expert_up": ("up_proj",),
    "expert_down": ("down_proj",),
}
#: The accepted forms, for error messages.
FORMS = (
    "pass a comma list of module names (q_proj,v_proj), all, or a regex matched in full "
    "against weight paths (.*(q_proj|v_proj).*)"
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse(text: str) -> str:
    """An argparse type: the canonical form of a ``--lora-targets`` value.

    Args:
      text: ``"q_proj, v_proj"`` (module names), ``"all"``/``"all-linear"``, or a regex.

    Returns:
      ``"all"``; the names joined by ``,`` without spaces or repeats, projections in
      ``PROJECTION_NAMES`` order first, then the others sorted; or the regex as given.

    Raises:
      argparse.ArgumentTypeError: for an empty value or a regex that does not compile.
    """
    text = str(text).strip()
    if text.lower() in _ALL_SPELLINGS or text == _ALL_AS_REGEX:
        return ALL
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items and all(_NAME.fullmatch(t) for t in items):
        known = [n for n in PROJECTION_NAMES if n in items]
        return ",".join(known + sorted(set(items) - set(known)))
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither module names nor a valid regex ({e}); {FORMS}"
        ) from None
    if not text:
        raise argparse.ArgumentTypeError(f"empty value; {FORMS}")
    return text


def modules(selection: str) -> str | tuple[str, ...]:
    """``jmem.lora.init``'s ``modules=`` for a canonical ``selection`` (``parse``): a tuple
    of module names, or a regex (``all``: a regex naming ``PROJECTION_NAMES``, so that a
    model without fused projections does not miss ``qkv_proj``)."""
    selection = parse(selection)
    if selection == ALL:
        return r"(.*/)?(" + "|".join(PROJECTION_NAMES) + r")/[^/]+"
    items = selection.split(",")
    if all(_NAME.fullmatch(t) for t in items):
        return tuple(items)
    return selection


def _module(path: str) -> str:
    """The module path of a weight path: all but its last key (``layers/q_proj``)."""
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _named(path: str, name: str) -> bool:
    """Whether ``name`` matches the weight ``path`` as PEFT matches a target module: the
    module path is ``name`` or ends with ``/name``; or ``name`` is a PEFT/Hugging Face
    spelling of the expert projection ``path`` holds (``EXPERT_SPELLINGS``)."""
    module = _module(path)
    return any(
        module == n or module.endswith("/" + n) for n in (name, *EXPERT_SPELLINGS.get(name, ()))
    )


def _refuse_router(name: str, paths: Sequence[str], names: list[str]) -> None:
    """Raises for a router name that matches no adaptable path (the router never is)."""
    if name in _ROUTER_SPELLINGS:
        raise ValueError(
            f"{name!r} names a mixture of experts' router (or no module): LoRA never adapts "
            "the router, which stays float (PEFT's all-linear wraps transformers' mlp.gate; "
            f"jmem does not); the module names are {', '.join(names)}"
        )


def module_names(paths: Sequence[str]) -> list[str]:
    """The distinct module names (last key of each module path) of ``paths``: those of
    ``PROJECTION_NAMES`` in its order, then the others in the order of ``paths``."""
    out = dict.fromkeys(_module(p).rsplit("/", 1)[-1] for p in paths if _module(p))
    return [n for n in PROJECTION_NAMES if n in out] + [n for n in out if n not in PROJECTION_NAMES]


def choose(selected: str | Sequence[str], paths: Sequence[str]) -> list[str]:
    """The ``paths`` that ``selected`` picks: a regex (``re.fullmatch``) or module names.

    Args:
      selected: a regex str, or a sequence of module names (``modules``'s value).
      paths: the candidate weight paths, '/'-joined.

    Returns:
      The chosen paths, in order.

    Raises:
      ValueError: a module name matching no path (with the closest name), or nothing
        chosen; the message lists the module names of ``paths``.
    """
    names = module_names(paths)
    if isinstance(selected, str):
        pattern = re.compile(selected)
        chosen = [p for p in paths if pattern.fullmatch(p)]
        if not chosen:
            part = any(pattern.search(p) for p in paths)
            raise ValueError(
                f"the regex {selected!r} matches no weight path in full"
                + (" (it matches only part of one)" if part else "")
                + " (LoRA adapts weights of rank >= 2: biases and norm scales excluded, as "
                "are MoE routers)"
                + f"; paths are such as {', '.join(paths[:2])}; the module names are "
                f"{', '.join(names)}"
            )
        return chosen
    selected = tuple(selected)
    for name in selected:
        if not any(_named(p, name) for p in paths):
            _refuse_router(name, paths, names)
            raise ValueError(
                f"no module named {name!r}{did_you_mean(name, names)}; the module names are "
                f"{', '.join(names)}"
            )
    if not selected:
        raise ValueError(f"no module names given; the module names are {', '.join(names)}")
    return [p for p in paths if any(_named(p, n) for n in selected)]


def planner_names(selection: str) -> tuple[str, ...]:
    """The ``LINEAR_NAMES`` that ``selection`` (``parse``) picks in the reference model
    (paths ``layers/<name>/kernel``, the expert projections' too, counted as the MLP's:
    ``linear_names``): the planner's ``lora=(rank, names)``.

    Raises:
      ValueError: as ``choose``.
    """
    paths = [f"layers/{n}/kernel" for n in LINEAR_NAMES + EXPERT_LINEAR_NAMES]
    return linear_names(module_names(choose(modules(selection), paths)))


def linear_names(names: Sequence[str]) -> tuple[str, ...]:
    """The ``LINEAR_NAMES`` among module ``names``, a fused projection counted as its parts
    (``qkv_proj``: q, k and v) and an expert projection as the MLP's (``expert_gate``:
    ``gate_proj``), in ``LINEAR_NAMES`` order: what the planner counts."""
    parts = {p for n in names for p in _FUSED_PARTS.get(n, (n,))}
    return tuple(n for n in LINEAR_NAMES if n in parts)
