"""LoRA adapters in Hugging Face PEFT's format, for ``jmem.models.llama`` params of any
family ``jmem.models.hf`` loads (the same module names and keys; Phi-3's fused ``qkv_proj``
and ``gate_up_proj`` are one module, one adapter each, as PEFT adapts them).

A PEFT LoRA adapter directory holds ``adapter_config.json`` (``peft.LoraConfig``) and
``adapter_model.safetensors`` with, per adapted linear layer,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]``; the update is ``scaling * B @ A`` on the ``[out, in]``
weight, ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``). jmem keeps one
``LoraWeight`` per stacked kernel ``[L, in, out]`` with ``a [L, in, r] = stack(A_i.T)`` and
``b [L, r, out] = stack(B_i.T)``. A mixture of experts' adapters (``expert_gate``/``up``/
``down``, one pair per expert) are PEFT's ``target_parameters`` on transformers 5's fused
``mlp.experts.gate_up_proj``/``down_proj`` (``jmem.models.peft_experts``). Reference: PEFT's
``LoraLayer``, ``ParamWrapper`` and ``save_pretrained`` (huggingface/peft); Hu et al. 2021
(arXiv:2106.09685). See ``docs/lora.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmem._src import lora as _lora
from jmem._src.implicit.weight import flatten_params
from jmem.models import peft_experts as _experts
from jmem.models.llama import FUSED_LINEAR_NAMES
from jmem.models.llama import LINEAR_NAMES
from jmem.models.llama import LlamaConfig
from jmem.models.llama import linear_names
from jmem.models.llama import param_shapes

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "save_adapters", "load_adapters"]

#: File names PEFT's ``save_pretrained`` writes and ``PeftModel.from_pretrained`` reads.
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

# every kernel name of any family (Phi-3's fused qkv_proj / gate_up_proj are one PEFT
# module each, as in PEFT); which ones a model has: llama.linear_names(config)
_NAMES = tuple(dict.fromkeys(LINEAR_NAMES + FUSED_LINEAR_NAMES))
_GROUP = {
    n: "self_attn" if n in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"
    for n in _NAMES
}
_PATH_RE = re.compile(r"^layers/(\w+_proj)/kernel$")
_KEY_RE = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$"
)

# adapter_config.json fields that describe, not change, the adapter.
_INFORMATIONAL = {
    "auto_mapping",
    "base_model_name_or_path",
    "exclude_modules",
    "inference_mode",
    "megatron_core",
    "peft_version",
    "qalora_group_size",
    "revision",
}
# Fields read and checked by ``_check_config``; every other field must be neutral (None,
# False, empty): a set value is a PEFT feature (DoRA, modules_to_save, layers_to_transform,
# lora_bias, ...) that jmem does not implement, and loading refuses it by name.
_HANDLED = {
    "peft_type",
    "task_type",
    "r",
    "lora_alpha",
    "lora_dropout",
    "use_rslora",
    "init_lora_weights",
    "bias",
    "rank_pattern",
    "alpha_pattern",
    "target_modules",
    "target_parameters",
}


def _key(i: int, name: str, which: str) -> str:
    return f"base_model.model.model.layers.{i}.{_GROUP[name]}.{name}.lora_{which}.weight"


def _module_of(path: str) -> str:
    """The Llama module name (``q_proj``, ...) adapted by jmem adapter ``path``."""
    m = _PATH_RE.match(path)
    if m is None or m.group(1) not in _NAMES:
        raise ValueError(
            f"Adapter {path!r} has no PEFT counterpart: save_adapters writes adapters of "
            f"jmem.models.llama's layers/<name>/kernel for name in {_NAMES} (PEFT "
            "target_modules); adapt only those (lora.init(modules=r'layers/.*_proj/kernel'))."
        )
    return m.group(1)


def _uniform(adapters: dict, field: str, get) -> Any:
    """The one value of ``get(w)`` over all adapters, or a ValueError naming ``field``."""
    values = {repr(get(w)): get(w) for w in adapters.values()}
    if len(values) != 1:
        raise ValueError(
            f"Adapters disagree on {field} ({sorted(values)}); PEFT's per-module "
            "rank_pattern/alpha_pattern are not written by jmem: use one setting for all."
        )
    return next(iter(values.values()))


def _adapter_config(
    adapters: dict, modules: list[str], experts: dict, base_model_name_or_path
) -> dict:
    """``adapter_config.json`` of ``adapters`` (``peft.LoraConfig`` fields); ``experts``:
    ``{fused parameter: (rank, scale)}`` of the expert adapters (``target_parameters``, with
    ``rank_pattern``/``alpha_pattern`` where they differ from the others' ``r``/alpha)."""
    dense = {p: w for p, w in adapters.items() if p not in _experts.EXPERT_PATHS}
    rs = _uniform(adapters, "use_rslora", lambda w: bool(w.use_rslora))
    if dense:
        r = _uniform(dense, "r (rank)", lambda w: w.rank)
        alpha = _uniform(dense, "lora_alpha", lambda w: w.lora_alpha)
    else:
        r, scale = next(iter(experts.values()))
        alpha = _alpha_of(scale, r, rs)
    for path, w in dense.items():
        want = alpha / math.sqrt(r) if rs else alpha / r
        if not math.isclose(w.scale, want, rel_tol=1e-6):
            raise ValueError(
                f"Adapter {path!r} has scale {w.scale}, but alpha={alpha}, r={r}, "
                f"use_rslora={rs} give {want}; PEFT recomputes the scale from those fields."
            )
    rank_pattern, alpha_pattern = {}, {}
    for param, (rank, scale) in experts.items():
        a = _alpha_of(scale, rank, rs)
        if rank != r or not math.isclose(a, alpha, rel_tol=1e-9):
            rank_pattern[rf".*\.{param}"] = rank
            alpha_pattern[rf".*\.{param}"] = int(a) if float(a).is_integer() else a
    # PEFT's ParamWrapper refuses lora_dropout != 0 (a training-time setting; the adapter's
    # function does not depend on it), so with expert adapters it is written as 0.
    dropout = _uniform(adapters, "lora_dropout", lambda w: float(w.dropout))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": 0.0 if experts else dropout,
        "use_rslora": rs,
        "init_lora_weights": _uniform(adapters, "init_lora_weights", lambda w: w.init_lora_weights),
        "target_modules": modules,
        "target_parameters": [f"mlp.experts.{p}" for p in experts] or None,
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
    }


def _alpha_of(scale: float, rank: int, rslora: bool) -> float:
    """The ``lora_alpha`` that gives ``scale`` at ``rank`` (an integer within 1e-9 of one)."""
    x = scale * (math.sqrt(rank) if rslora else rank)
    return float(round(x)) if abs(x - round(x)) <= 1e-9 * max(1.0, abs(x)) else x


def save_adapters(
    directory: str,
    adapters: dict[str, _lora.LoraWeight],
    config: LlamaConfig,
    *,
    base_model_name_or_path: str | None = None,
) -> None:
    """Writes jmem LoRA adapters as a PEFT adapter directory.

    ``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory)``
    then computes what ``jmem.lora.apply(llama.forward)(params, adapters, ...)`` computes.

    Args:
      directory: created if missing; receives ``adapter_config.json`` and
        ``adapter_model.safetensors`` (tensors in the adapters' dtype).
      adapters: ``{path: LoraWeight}`` for ``jmem.models.llama`` params (``jmem.lora.init``
        or ``load_adapters``): paths ``layers/<name>/kernel``, ``a [L, in, r]``,
        ``b [L, r, out]``; one rank, alpha, dropout, rsLoRA and init setting for the
        projections. Expert adapters (``layers/expert_{gate,up,down}/kernel``, ``a [L, E,
        in, r]``, ``b [L, E, r, out]``; Qwen3-MoE, Mixtral) are written as PEFT's
        ``target_parameters`` ``mlp.experts.gate_up_proj`` (gate and up fused: a rank
        ``r_g + r_u`` block pair, ``r`` when their ``a`` are equal) and
        ``mlp.experts.down_proj``, with ``rank_pattern``/``alpha_pattern`` where their rank
        or alpha differ from the projections'; ``lora_dropout`` is then written as 0 (PEFT's
        ``ParamWrapper`` refuses any other; dropout acts only in training).
      config: the model's ``LlamaConfig`` (checks ``L`` and the shapes).
      base_model_name_or_path: recorded in ``adapter_config.json`` (PEFT loads this base
        when given only the adapter directory).

    Raises:
      ValueError: an adapter on a weight PEFT has no module for (a bias, a norm, the
        embedding, the router; only the projections' kernels, ``llama.linear_names(config)``,
        and the experts'), shapes that do not fit ``config``, projections' adapters that
        differ in rank/alpha, adapters that differ in dropout/rsLoRA/init, or gate and up
        adapters of different scales.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415

    if not adapters:
        raise ValueError("No adapters to save.")
    shapes = param_shapes(config)["layers"]
    tensors: dict[str, np.ndarray] = {}
    modules = []
    for path, w in adapters.items():
        if path in _experts.EXPERT_PATHS:
            continue
        name = _module_of(path)
        if name not in shapes:
            raise ValueError(
                f"Adapter {path!r}: {config} has no {name} (its kernels: {linear_names(config)})."
            )
        L, fan_in, fan_out = shapes[name]["kernel"]
        _check_factors(path, w, (L, fan_in), fan_out, config)
        a, b = np.asarray(w.a), np.asarray(w.b)
        for i in range(L):
            tensors[_key(i, name, "A")] = np.ascontiguousarray(a[i].T)
            tensors[_key(i, name, "B")] = np.ascontiguousarray(b[i].T)
        modules.append(name)
    experts = _expert_tensors(adapters, shapes, config, tensors)
    cfg = _adapter_config(adapters, sorted(modules), experts, base_model_name_or_path)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def _check_factors(path: str, w, lead: tuple, fan_out: int, config) -> None:
    """Raises unless ``w`` has ``a [*lead, r]`` and ``b [*lead[:-1], r, fan_out]``."""
    r = w.rank
    want_a, want_b = (*lead, r), (*lead[:-1], r, fan_out)
    if tuple(w.a.shape) != want_a or tuple(w.b.shape) != want_b:
        raise ValueError(
            f"Adapter {path!r} has a{tuple(w.a.shape)}, b{tuple(w.b.shape)}; expected "
            f"a{want_a}, b{want_b} for {config}."
        )


def _expert_tensors(adapters: dict, shapes: dict, config, tensors: dict) -> dict:
    """Adds the expert adapters' PEFT tensors to ``tensors`` (``peft_experts``: gate and up
    as one fused ``gate_up_proj`` pair); returns ``{parameter: (rank, scale)}``."""
    pairs = {}
    for path in _experts.EXPERT_PATHS:
        if path not in adapters:
            continue
        name = path.split("/")[1]
        if name not in shapes:
            raise ValueError(f"Adapter {path!r}: {config} has no experts (num_experts=0).")
        L, E, fan_in, fan_out = shapes[name]["kernel"]
        _check_factors(path, adapters[path], (L, E, fan_in), fan_out, config)
    gate, up = (adapters.get(p) for p in _experts.PARAMS["gate_up_proj"])
    if gate is not None or up is not None:
        f = shapes["expert_gate"]["kernel"][-1]
        pairs["gate_up_proj"] = _experts.fused_gate_up(gate, up, f)
    down = adapters.get(_experts.PARAMS["down_proj"][0])
    if down is not None:
        a, b = np.asarray(down.a), np.asarray(down.b)
        pairs["down_proj"] = (np.swapaxes(a, -1, -2), np.swapaxes(b, -1, -2), down.scale)
    infix = _experts.slots(list(pairs))
    for param, (A, B, _) in pairs.items():
        for i in range(A.shape[0]):
            a_w, b_w = _experts.to_peft(A[i], B[i])
            tensors[_experts.key(i, infix[param], "A")] = a_w
            tensors[_experts.key(i, infix[param], "B")] = b_w
    return {param: (A.shape[-2], scale) for param, (A, _, scale) in pairs.items()}


def _neutral(value) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def _check_config(c: dict, config: LlamaConfig) -> tuple[int, float]:
    """Refuses what jmem does not implement, naming the field; returns ``(r, lora_alpha)``."""
    if c.get("peft_type") != "LORA":
        raise ValueError(f"peft_type {c.get('peft_type')!r} is not LORA; jmem loads LoRA only.")
    if c.get("task_type") not in (None, "CAUSAL_LM"):
        raise ValueError(f"task_type {c['task_type']!r}: jmem.models.llama is a CAUSAL_LM.")
    if c.get("bias", "none") != "none":
        raise ValueError(f"bias={c['bias']!r} is not implemented (trained biases); need 'none'.")
    init = c.get("init_lora_weights", True)
    if not (init is True or init is False or init == "gaussian"):
        raise ValueError(
            f"init_lora_weights={init!r} is not implemented: PiSSA/OLoRA/CorDA/LoftQ-style "
            "inits change the base weights; convert the adapter to plain LoRA in PEFT first."
        )
    r, alpha = int(c["r"]), float(c["lora_alpha"])
    for field, base in (("rank_pattern", r), ("alpha_pattern", alpha)):
        odd = {
            k: v
            for k, v in (c.get(field) or {}).items()
            if v != base and not any(k.endswith(p) for p in _experts.PARAMS)
        }
        if odd:
            raise ValueError(
                f"{field}={odd} (per-module values) is not implemented (only for the experts' "
                "gate_up_proj/down_proj)."
            )
    _check_target_parameters(c.get("target_parameters"), config)
    targets = c.get("target_modules")
    if isinstance(targets, list | tuple):
        unknown = sorted(set(targets) - set(linear_names(config)))
        if unknown:
            raise ValueError(
                f"target_modules {unknown} are not linear layers {linear_names(config)} of "
                f"this model's jmem.models.llama config; jmem cannot load adapters on them."
            )
    for field, value in c.items():
        if field not in _HANDLED and field not in _INFORMATIONAL and not _neutral(value):
            raise ValueError(
                f"adapter_config.json sets {field}={value!r}, a PEFT feature jmem does not "
                "implement (jmem loads plain LoRA on linear layers)."
            )
    return r, alpha


def _check_target_parameters(targets, config: LlamaConfig) -> None:
    """Refuses ``target_parameters`` other than the experts' fused ``gate_up_proj`` and
    ``down_proj`` of a mixture-of-experts config (PEFT's all-linear also adapts the router
    ``mlp.gate.weight``, which jmem keeps float and unadapted)."""
    if not targets:
        return
    if not config.num_experts:
        raise ValueError(
            f"target_parameters {sorted(targets)} adapt 3-D parameters; {config} has no "
            "experts (num_experts=0)."
        )
    other = sorted(t for t in targets if t.rpartition(".")[2] not in _experts.PARAMS)
    if other:
        raise ValueError(
            f"target_parameters {other} are not the experts' gate_up_proj/down_proj: jmem "
            "never adapts the router (mlp.gate), which stays float; drop them in PEFT first."
        )


def _read_tensors(directory: str, config: LlamaConfig) -> dict[str, dict[int, dict]]:
    """``{module: {layer: {"A": [r, in], "B": [out, r]}}}`` from the safetensors file."""
    from safetensors.numpy import load_file  # noqa: PLC0415

    path = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{directory!r} has no {WEIGHTS_NAME} (PEFT's adapter_model.bin is not supported)."
        )
    out: dict[str, dict[int, dict]] = {}
    unknown = []
    for key, arr in load_file(path).items():
        e = _experts.KEY_RE.match(key)
        if e is not None and config.num_experts:
            slot = "expert_" + (e.group(2) or "")
            out.setdefault(slot, {}).setdefault(int(e.group(1)), {})[e.group(3)] = arr
            continue
        m = _KEY_RE.match(key)
        names = linear_names(config)
        if m is None or m.group(3) not in names or m.group(2) != _GROUP[m.group(3)]:
            unknown.append(key)
            continue
        i, name, which = int(m.group(1)), m.group(3), m.group(4)
        out.setdefault(name, {}).setdefault(i, {})[which] = arr
    if unknown:
        raise ValueError(
            f"{path} holds tensors jmem cannot map to jmem.models.llama adapters "
            f"(modules_to_save, embeddings, DoRA magnitudes, ...): {unknown[:6]}."
        )
    for name, layers in out.items():
        missing = [i for i in range(config.num_layers) if set(layers.get(i, {})) != {"A", "B"}]
        extra = sorted(set(layers) - set(range(config.num_layers)))
        if missing or extra:
            raise ValueError(
                f"{name} adapters cover layers {sorted(layers)} of {config.num_layers}: "
                "partial coverage (layers_to_transform) is not implemented."
            )
    return out


def load_adapters(directory: str, params, config: LlamaConfig) -> dict[str, _lora.LoraWeight]:
    """Reads a PEFT LoRA adapter directory into jmem's adapter pytree.

    The result is what ``jmem.lora.init(key, params, ...)`` makes for ``jmem.models.llama``
    params (stacked layers, ``a [L, in, r]``, ``b [L, r, out]``), holding PEFT's weights
    in their stored dtype, with ``scale`` = ``lora_alpha / r`` (``/ sqrt(r)`` with
    ``use_rslora``) and ``lora_dropout`` / ``use_rslora`` / ``init_lora_weights`` recorded.
    Expert adapters (``target_parameters`` ``mlp.experts.gate_up_proj``/``down_proj``) become
    ``a [L, E, in, r]``, ``b [L, E, r, out]`` of ``layers/expert_{gate,up,down}/kernel``
    with their parameter's ``rank_pattern``/``alpha_pattern`` scale; the fused
    ``gate_up_proj`` pair is split exactly (``jmem.models.peft_experts.split_gate_up``).

    Args:
      directory: holds ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's
        ``save_pretrained``).
      params: the base params (arrays, ``NF4Array`` or ``ShapeDtypeStruct`` leaves), for
        the adapted leaves' paths and shapes.
      config: the model's ``LlamaConfig``.

    Returns:
      ``{path: LoraWeight}`` ordered as the leaves of ``params``.

    Raises:
      FileNotFoundError: a missing file.
      ValueError: a PEFT feature jmem does not implement (the message names the field:
        ``use_dora``, ``modules_to_save``, ``rank_pattern``/``alpha_pattern`` that differ,
        ``bias``, ``target_modules`` outside the Llama linear layers, ``target_parameters``
        other than the experts' (PEFT's all-linear adapts the router ``mlp.gate``), partial
        layers, non-LoRA ``peft_type``, ...), or shapes that do not match ``params``.
    """
    cpath = os.path.join(directory, CONFIG_NAME)
    if not os.path.exists(cpath):
        raise FileNotFoundError(f"{directory!r} has no {CONFIG_NAME}: not a PEFT adapter.")
    with open(cpath) as f:
        c = json.load(f)
    r, alpha = _check_config(c, config)
    rs = bool(c.get("use_rslora", False))
    scale = alpha / math.sqrt(r) if rs else alpha / r
    tensors = _read_tensors(directory, config)
    leaves = dict(flatten_params(params)[0])
    out = {}
    for path, leaf in leaves.items():
        m = _PATH_RE.match(path)
        if m is None or m.group(1) not in tensors:
            continue
        name = m.group(1)
        layers = tensors.pop(name)
        a = np.stack([layers[i]["A"].T for i in range(config.num_layers)])
        b = np.stack([layers[i]["B"].T for i in range(config.num_layers)])
        L, fan_in, fan_out = tuple(leaf.shape)
        if a.shape != (L, fan_in, r) or b.shape != (L, r, fan_out):
            raise ValueError(
                f"PEFT {name} adapters give a{a.shape}, b{b.shape}; expected "
                f"a{(L, fan_in, r)}, b{(L, r, fan_out)} for {path!r} with r={r}."
            )
        out[path] = _lora.LoraWeight(
            a=jnp.asarray(a),
            b=jnp.asarray(b),
            scale=float(scale),
            dropout=float(c.get("lora_dropout", 0.0) or 0.0),
            alpha=alpha,
            use_rslora=rs,
            init_lora_weights=c.get("init_lora_weights", True),
        )
    out.update(_load_experts(c, tensors, leaves, config, (r, alpha, rs)))
    if tensors:
        raise ValueError(
            f"params have no leaf layers/<name>/kernel for the PEFT adapters of {sorted(tensors)}."
        )
    return {p: out[p] for p in leaves if p in out}


def _pattern(patterns: dict, name: str, default):
    """``patterns``' value for module ``name`` as PEFT's ``get_pattern_key`` matches it
    (``(.*\\.)?(key)$``), else ``default``."""
    for k, v in (patterns or {}).items():
        if re.match(rf"(.*\.)?({k})$", name):
            return v
    return default


def _expert_pairs(c: dict, tensors: dict, config: LlamaConfig):
    """``{parameter: (A [L, E, R, in], B [L, E, out, R])}`` of the expert tensors read
    (removed from ``tensors``), by ``target_parameters`` and PEFT's nesting."""
    targets = [t.rpartition(".")[2] for t in (c.get("target_parameters") or [])]
    params = [p for p in _experts.PARAMS if p in targets]
    found = sorted(k for k in tensors if k.startswith("expert_"))
    if found and not params:
        raise ValueError(
            "the adapter file holds expert tensors (mlp.experts.lora_*) but adapter_config.json "
            "names no target_parameters (mlp.experts.gate_up_proj / down_proj)."
        )
    infix = _experts.slots(params) if params else {}
    pairs = {}
    for param in params:
        layers = tensors.pop("expert_" + infix[param], None)
        if layers is None:
            raise ValueError(f"target_parameters names {param}, but no tensors of it are stored.")
        one = [
            _experts.from_peft(layers[i]["A"], layers[i]["B"], config.num_experts)
            for i in range(config.num_layers)
        ]
        pairs[param] = (np.stack([x[0] for x in one]), np.stack([x[1] for x in one]))
    return pairs


def _load_experts(c: dict, tensors: dict, leaves: dict, config: LlamaConfig, base) -> dict:
    """The expert adapters (``peft_experts``: the fused ``gate_up_proj`` pair split into
    ``expert_gate`` and ``expert_up``), each with the scale of its parameter's
    ``rank_pattern``/``alpha_pattern``."""
    r, alpha, rs = base
    out = {}
    for param, (A, B) in _expert_pairs(c, tensors, config).items():
        name = f"model.layers.0.mlp.experts.{param}"
        R = int(_pattern(c.get("rank_pattern"), name, r))
        a_p = float(_pattern(c.get("alpha_pattern"), name, alpha))
        if A.shape[-2] != R:
            raise ValueError(
                f"the {param} adapters have rank {A.shape[-2]}, adapter_config.json says {R}."
            )
        scale = a_p / math.sqrt(R) if rs else a_p / R
        if param == "gate_up_proj":
            factors = dict(zip(_experts.PARAMS[param], _experts.split_gate_up(A, B)))
        else:
            factors = {_experts.PARAMS[param][0]: (np.swapaxes(A, -1, -2), np.swapaxes(B, -1, -2))}
        for path, pair in factors.items():
            if pair is None:
                continue
            a, b = pair
            leaf = leaves.get(path)
            want = None if leaf is None else tuple(leaf.shape)
            if want is None or a.shape[:-1] != want[:-1] or b.shape[-1] != want[-1]:
                raise ValueError(
                    f"PEFT {param} adapters give a{a.shape}, b{b.shape}; params have "
                    f"{path!r} {want}."
                )
            out[path] = _lora.LoraWeight(
                a=jnp.asarray(np.ascontiguousarray(a)),
                b=jnp.asarray(np.ascontiguousarray(b)),
                scale=float(scale),
                dropout=float(c.get("lora_dropout", 0.0) or 0.0),
                use_rslora=rs,
                init_lora_weights=c.get("init_lora_weights", True),
            )
    return out
