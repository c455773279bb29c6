"""Export ``jmem.models.llama`` params (optionally NF4, optionally with LoRA merged) as a
Hugging Face checkpoint: ``config.json`` + sharded ``*.safetensors`` +
``model.safetensors.index.json``, written tensor by tensor.

The inverse of ``jmem.models.hf.load_params``: stacked ``[L, in, out]`` kernels become
per-layer ``[out, in]`` ``model.layers.{i}....weight`` tensors and stacked ``[L, out]``
biases ``....bias`` tensors, named as ``jmem.models.families.tensor_names`` says, the
layout of each family's transformers ``*ForCausalLM`` (``hf_config`` picks the family).
See ``docs/lora.md`` (PEFT interop).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmem._src import lora as _lora
from jmem._src import nf4
from jmem._src.implicit.weight import flatten_params
from jmem.models import families as _families
from jmem.models.llama import LlamaConfig

__all__ = [
    "ARCHITECTURES",
    "COPIED_FILES",
    "DEFAULT_MAX_SHARD_BYTES",
    "hf_config",
    "save_params",
]

#: Default shard size, as transformers' ``save_pretrained(max_shard_size="5GB")``.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

#: ``model_type`` -> transformers architecture class, for every family in
#: ``jmem.models.families.FAMILIES``.
ARCHITECTURES = {name: family.architecture for name, family in _families.FAMILIES.items()}


def hf_config(config: LlamaConfig, dtype=jnp.float32) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of a ``LlamaConfig``, for the one family
    (``jmem.models.families.FAMILIES``) whose options it has: ``"llama"``, ``"mistral"``
    (a sliding window), ``"qwen2"`` (q/k/v biases), ``"qwen3"`` (QK-norm per head),
    ``"gemma2"``, ``"gemma3_text"``, ``"phi3"`` (fused projections) or ``"olmo2"``.

    The inverse of ``jmem.models.hf.config_from_dict``: ``hf.config_from_dict(hf_config(c))
    == c`` (checked: a config the family's ``config.json`` cannot express is refused). RoPE
    is written as transformers >= 5 does (``rope_parameters``, with ``rope_theta`` inside;
    per layer type for Gemma 3) and as transformers 4 did (``rope_theta``, ``rope_scaling``).

    Args:
      config: the model's config.
      dtype: the checkpoint's dtype, written as ``dtype`` (transformers >= 5) and
        ``torch_dtype`` (transformers 4).

    Returns:
      A JSON-ready dict readable by ``transformers.AutoConfig`` and ``hf.load_config``.

    Raises:
      ValueError: a config no transformers family computes (biases on another set of
        projections; a window with Llama biases; family options no family has), a value
        the family's ``config.json`` cannot express, or a field (of a ``LlamaConfig``
        subclass) set away from its default that this function does not write.
    """
    unknown = [
        f.name
        for f in dataclasses.fields(config)
        if f.name not in _LLAMA_FIELDS and getattr(config, f.name) != _default(f)
    ]
    if unknown:
        raise ValueError(
            f"hf_config does not write {unknown} of {config}; extend "
            "jmem.models.families for them before exporting."
        )
    return _families.hf_config(config, jnp.dtype(dtype).name)


_LLAMA_FIELDS = {f.name for f in dataclasses.fields(LlamaConfig)}


#: Files ``save_params(source=...)`` copies beside the weights when the source has them:
#: the tokenizer (every format transformers' ``AutoTokenizer`` reads, the chat template) and
#: the generation settings (eos ids, sampling defaults).
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def _source_config(source: str | None) -> dict:
    """The parsed ``config.json`` of ``source`` (``{}`` for None)."""
    if source is None:
        return {}
    path = os.path.join(source, "config.json")
    if not os.path.exists(path):
        raise ValueError(
            f"source={source!r} has no config.json; pass the Hugging Face checkpoint "
            "directory the params were loaded from, or source=None."
        )
    with open(path) as f:
        return json.load(f)


def _copy_files(directory: str, source: str | None, tokenizer: str | None) -> list[str]:
    """Copies ``COPIED_FILES``: the generation config from ``source``, the tokenizer's from
    ``tokenizer`` (default: ``source``). Returns the names copied."""
    tokenizer = source if tokenizer is None else tokenizer
    copied = []
    for name in COPIED_FILES:
        origin = source if name == "generation_config.json" else tokenizer
        if origin is None or not os.path.isfile(os.path.join(origin, name)):
            continue
        dest = os.path.join(directory, name)
        if os.path.abspath(os.path.join(origin, name)) != os.path.abspath(dest):
            shutil.copyfile(os.path.join(origin, name), dest)
        copied.append(name)
    return copied


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor of the HF checkpoint: leaf ``path`` of params, layer ``layer`` of a
    stack (or None), transposed from jmem's ``[in, out]`` when ``transpose``."""

    name: str
    path: str
    layer: int | None
    transpose: bool
    shape: tuple
    dtype: Any
    expert: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


def _plan(leaves: dict, config: LlamaConfig, dtype) -> list[_Tensor]:
    """The checkpoint's tensors (embedding, layer by layer, final norm, head), from shapes
    only (nothing is computed)."""
    names = _families.tensor_names(config)
    extra = sorted(set(leaves) - set(names))
    missing = sorted(set(names) - set(leaves))
    if extra or missing:
        raise ValueError(
            f"params do not have the jmem.models.llama layout of {config}: unexpected "
            f"leaves {extra}, missing {missing}; save_params writes only that layout."
        )

    def tensor(path, layer, expert=None):
        name, transpose = names[path]
        leaf = leaves[path]
        shape = tuple(leaf.shape) if layer is None else tuple(leaf.shape[1:])
        shape = shape if expert is None else shape[1:]
        dt = jnp.dtype(dtype if dtype is not None else leaf.dtype)
        name = name if layer is None else name.format(i=layer, e=expert)
        shape = shape[::-1] if transpose else shape
        return _Tensor(name, path, layer, transpose, shape, dt, expert)

    stacked = [p for p in names if p.startswith("layers/")]
    plan = [tensor("embed/embedding", None)]
    for i in range(config.num_layers):
        for path in stacked:
            if "{e}" in names[path][0]:  # one tensor per expert of the [L, E, ...] stack
                plan.extend(tensor(path, i, e) for e in range(config.num_experts))
            else:
                plan.append(tensor(path, i))
    plan.append(tensor("final_norm/scale", None))
    if not config.tie_embeddings:
        plan.append(tensor("lm_head/kernel", None))
    return plan


def _layer(x, i: int):
    """Layer ``i`` of a stacked array or ``NF4Array`` (an NF4Array of one matrix)."""
    if isinstance(x, nf4.NF4Array):
        sliced = jax.tree.map(lambda f: f[i], x)
        return dataclasses.replace(sliced, shape=x.shape[1:], batch_ndim=x.batch_ndim - 1)
    return x[i]


def _materialize(t: _Tensor, leaves: dict, adapters: dict) -> np.ndarray:
    """Tensor ``t`` as a host array: dequantized (one matrix) and merged with its adapter."""
    w = leaves[t.path]
    ad = adapters.get(t.path)
    for i in (t.layer, t.expert):  # the layer's matrix, then the expert's
        if i is None:
            continue
        w = _layer(w, i)
        if ad is not None:
            ad = _lora.LoraWeight(a=ad.a[i], b=ad.b[i], scale=ad.scale)
    dense = nf4.dequantize(w, w.dtype) if isinstance(w, nf4.NF4Array) else jnp.asarray(w)
    if ad is not None:  # as jmem.lora.merge: in float32, back to the weight's dtype
        dense = (dense.astype(jnp.float32) + ad.delta(jnp.float32)).astype(dense.dtype)
    arr = np.asarray(jax.device_get(dense.astype(t.dtype)))
    return np.ascontiguousarray(arr.T if t.transpose else arr)


def _shards(plan: list[_Tensor], max_shard_bytes: int) -> list[list[_Tensor]]:
    """Consecutive tensors grouped into shards of at most ``max_shard_bytes`` (a larger
    tensor gets a shard of its own)."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in plan:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def save_params(
    directory: str,
    params,
    config: LlamaConfig,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    adapters: dict[str, _lora.LoraWeight] | None = None,
    dtype=None,
    source: str | None = None,
    tokenizer: str | None = None,
) -> None:
    """Writes ``params`` as a Hugging Face checkpoint of its family (``hf_config`` picks
    it: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, OLMo 2), LoRA merged in, tensor by tensor.

    ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` then computes what
    ``jmem.lora.apply(llama.forward)(params, adapters, ...)`` computes (up to the rounding
    of the merged weight to its dtype). The inverse of ``jmem.models.hf.load_params``.

    Memory: each tensor is made on its own (an ``NF4Array`` stack is dequantized one layer
    matrix at a time, its adapter merged into that matrix) and copied to the host; the host
    holds at most one shard (``max_shard_bytes``) before it is written. No dequantized or
    merged copy of the whole model exists at any point (``jmem.lora.merge`` followed by
    ``save_params`` would build every merged stack first: pass ``adapters=`` instead).

    Args:
      directory: created if missing; receives ``config.json`` (``hf_config``),
        ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``.
      params: ``jmem.models.llama`` params (arrays or ``NF4Array`` leaves, e.g. from
        ``jmem.qlora.quantize_params`` or ``hf.load_params(quantize="nf4")``).
      config: the model's ``LlamaConfig``.
      max_shard_bytes: largest shard in bytes (a larger single tensor gets its own shard).
      adapters: optional ``{path: LoraWeight}`` merged into their weights as they are written
        (``W + scale * a @ b`` in float32, then the weight's dtype, as ``jmem.lora.merge``).
      dtype: dtype of every written tensor; ``None`` keeps each leaf's (an ``NF4Array``'s
        original) dtype. ``config.json``'s ``dtype`` is the embedding's.
      source: the Hugging Face checkpoint directory the params were loaded from, or None.
        Its ``config.json`` fields that jmem reads but does not compute with (token ids,
        ``max_position_embeddings``, ``use_cache``, fields unknown to jmem; see
        ``jmem.models.families.carried_fields``) are written back unchanged, and its
        ``generation_config.json`` is copied, so that ``generate`` on the export stops at the
        source's eos (as PEFT's ``merge_and_unload`` + ``save_pretrained``).
      tokenizer: a directory whose tokenizer files (``COPIED_FILES``) are copied beside the
        weights; default ``source``. Without either, the export has no token ids and no
        tokenizer (transformers then takes its family's defaults).

    Raises:
      ValueError: params not in the ``jmem.models.llama`` layout of ``config`` (e.g. bias
        leaves ``config.biases`` does not declare, or missing ones), an adapter naming no
        leaf, a config ``hf_config`` cannot write (see there), a ``source`` with no
        ``config.json``, or ``max_shard_bytes < 1``.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive; got {max_shard_bytes}.")
    leaves = dict(flatten_params(params)[0])
    adapters = dict(adapters or {})
    stray = sorted(set(adapters) - set(leaves))
    if stray:
        raise ValueError(f"Adapters {stray} name no leaf of params.")
    plan = _plan(leaves, config, dtype)
    hf = hf_config(config, plan[0].dtype)
    hf.update(_families.carried_fields(_source_config(source), hf["model_type"]))
    shards = _shards(plan, max_shard_bytes)
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {t.name: _materialize(t, leaves, adapters) for t in shard}
        save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
        del tensors
        weight_map.update({t.name: fname for t in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in plan)}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    _copy_files(directory, source, tokenizer)
