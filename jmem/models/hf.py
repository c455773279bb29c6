"""Load Hugging Face checkpoints (``config.json`` + ``*.safetensors``) of the families in
``jmem.models.families.FAMILIES`` (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3,
OLMo 2, Mixtral, Qwen3-MoE) into ``jmem.models.llama`` params, strictly (a config field jmem
does not implement or a tensor it would not read is an error), tensor by tensor, optionally
quantizing to NF4 as they are read (QLoRA, Dettmers et al. 2023); HF's ``[out, in]`` weights
become stacked ``[in, out]`` kernels (per-expert tensors ``[L, E, in, out]``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmem._src import nf4
from jmem.models.export import save_params
from jmem.models.families import FAMILIES
from jmem.models.families import HANDLED_FIELDS
from jmem.models.families import IGNORED_FIELDS
from jmem.models.families import config_from_dict
from jmem.models.families import tensor_names
from jmem.models.llama import LlamaConfig
from jmem.models.llama import param_shapes
from jmem.models.peft_format import load_adapters
from jmem.models.peft_format import save_adapters

__all__ = [
    "HANDLED_FIELDS",
    "IGNORED_FIELDS",
    "MODEL_TYPES",
    "config_from_dict",
    "load_adapters",
    "load_config",
    "load_params",
    "save_adapters",
    "save_params",
]

#: The ``model_type`` values ``load_config`` reads (``jmem.models.families.FAMILIES``).
MODEL_TYPES = tuple(FAMILIES)

#: config.json fields that must be positive integers where present (and not null).
INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def read_json(path: str) -> Any:
    """The JSON in ``path``; a ValueError naming the file when it is not valid JSON."""
    with open(path) as f:
        try:
            return json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def _check_int_fields(raw: dict, path: str) -> None:
    for name in INT_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{path}: {name} must be a positive integer, got {value!r}; fix config.json"
            )


def load_config(directory: str) -> LlamaConfig:
    """``LlamaConfig`` from a checkpoint's ``config.json``.

    Every field that changes the computation is implemented or refused (``HANDLED_FIELDS``;
    ``IGNORED_FIELDS`` are bookkeeping, each family's ``Family.fields`` its own). Implemented:
    every ``model_type`` of ``MODEL_TYPES``; RoPE default, ``linear`` and ``llama3``
    scaling, spelled ``rope_scaling`` (transformers < 5) or ``rope_parameters`` (>= 5, per
    layer type for Gemma 3, with ``rope_local_base_freq`` before); sliding-window
    attention in every layer, none, or per layer (``layer_types``, Qwen's
    ``max_window_layers``, Gemma's alternation and ``sliding_window_pattern``); Qwen2's
    q/k/v biases, ``attention_bias`` and Llama's ``mlp_bias``; Gemma's
    ``query_pre_attn_scalar``, ``attn_logit_softcapping``, ``final_logit_softcapping`` and
    ``hidden_activation``; ``hidden_act`` in ``jmem.models.llama.ACTIVATIONS``; Mixtral's
    and Qwen3-MoE's experts (``num_local_experts``/``num_experts``, ``num_experts_per_tok``,
    ``moe_intermediate_size``, ``norm_topk_prob``, ``router_aux_loss_coef``). Refused by
    name and value: other RoPE types (Phi-3's ``longrope``/``su``, YaRN, dynamic),
    ``partial_rotary_factor`` != 1, dropout, bidirectional attention, quantized
    checkpoints, the multimodal ``gemma3`` model type, Qwen3-MoE's dense layers
    (``decoder_sparse_step`` != 1, ``mlp_only_layers``), Mixtral's ``router_jitter_noise``.

    Raises:
      FileNotFoundError: no ``config.json`` in ``directory``.
      ValueError: naming config.json: invalid JSON, not an object, an ``INT_FIELDS`` field
        that is not a positive integer (``"2"``, ``0``), or a field value this loader does
        not implement (the message names the field, its value and what is supported).

    Warns:
      UserWarning: non-null fields unknown to this loader (neither handled nor ignored).
    """
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{directory!r} has no config.json: pass a Hugging Face checkpoint "
            "directory (config.json plus *.safetensors)."
        )
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    _check_int_fields(raw, path)
    try:
        return config_from_dict(raw)
    except (TypeError, ZeroDivisionError, KeyError) as e:
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from None


def _weight_files(directory: str) -> dict[str, str]:
    """Maps each tensor name to its safetensors file."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            weight_map = read_json(index)["weight_map"]
        except (KeyError, TypeError):
            raise ValueError(f"{index}: has no weight_map object") from None
        missing = {v for v in weight_map.values() if not os.path.exists(os.path.join(directory, v))}
        if missing:
            raise FileNotFoundError(
                f"Checkpoint shards listed in {index} are missing: {sorted(missing)}."
            )
        out = {k: os.path.join(directory, v) for k, v in weight_map.items()}
        # a tensor stored in a shard but absent from the index is still the checkpoint's:
        # listed, so that an unread one is reported, not silently skipped
        for fn, keys in _shard_keys(directory, sorted(set(weight_map.values()))).items():
            for k in keys:
                out.setdefault(k, fn)
        return out
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors files in {directory!r} (PyTorch .bin checkpoints "
            "are not supported; convert them with safetensors)."
        )
    return {k: fn for fn, keys in _shard_keys(directory, files).items() for k in keys}


def _shard_keys(directory: str, files: list[str]) -> dict[str, list[str]]:
    """``{path: tensor names}`` of each safetensors file (reads the headers only)."""
    from safetensors import safe_open  # noqa: PLC0415

    out = {}
    for fn in files:
        path = os.path.join(directory, fn)
        try:
            with safe_open(path, framework="numpy") as f:
                out[path] = list(f.keys())
        except Exception as e:  # SafetensorError (truncated, not safetensors) is no ValueError
            raise ValueError(f"{path}: not a readable safetensors file ({_one_line(e)})") from e
    return out


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _stack_nf4(parts: list[nf4.NF4Array]) -> nf4.NF4Array:
    first = parts[0]
    leaves = [
        None if getattr(first, k) is None else jnp.stack([getattr(p, k) for p in parts])
        for k in ("packed", "absmax", "absmax_scale", "absmax_offset")
    ]
    return nf4.NF4Array(
        *leaves,
        shape=(len(parts), *first.shape),
        dtype=first.dtype,
        block_size=first.block_size,
        double_quant=first.double_quant,
        batch_ndim=first.batch_ndim + 1,
    )


class _TensorReader:
    """Reads named tensors from a checkpoint's safetensors files, each file opened once."""

    def __init__(self, directory: str, files: dict[str, str]):
        self.directory, self.files, self.handles = directory, files, {}
        self.read: set[str] = set()

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise FileNotFoundError(
                f"Tensor {name!r} is missing from the checkpoint in {self.directory!r}."
            )
        from safetensors import safe_open  # noqa: PLC0415

        path = self.files[name]
        self.read.add(name)
        try:
            arr = self._get(safe_open, path, name)
        except Exception as e:  # SafetensorError (truncated data) is no ValueError
            raise ValueError(
                f"{path}: tensor {name!r} cannot be read ({_one_line(e)}); the file is "
                "damaged or truncated"
            ) from e
        return _check_values(name, path, arr)

    def _get(self, safe_open, path: str, name: str) -> np.ndarray:
        try:
            return self._handle(safe_open, path, "numpy").get_tensor(name)
        except TypeError:  # bfloat16 (most checkpoints): numpy has no such dtype
            # read as a JAX array on the host CPU, then a zero-copy ml_dtypes numpy view
            with jax.default_device(jax.devices("cpu")[0]):
                return np.asarray(self._handle(safe_open, path, "flax").get_tensor(name))

    def _handle(self, safe_open, path: str, framework: str):
        if (path, framework) not in self.handles:
            self.handles[path, framework] = safe_open(path, framework=framework).__enter__()
        return self.handles[path, framework]

    def unread(self) -> list[str]:
        """Tensors never read, except RoPE tables some conversions store (recomputed)."""
        return sorted(
            n for n in self.files if n not in self.read and not n.endswith("rotary_emb.inv_freq")
        )

    def close(self) -> None:
        for h in self.handles.values():
            h.__exit__(None, None, None)


def _check_values(name: str, path: str, arr: np.ndarray) -> np.ndarray:
    """``arr`` if it is floating point with finite values; else a ValueError naming the
    tensor and its file (an int8 weight would be cast and trained, an ``inf`` gives NaN
    losses from the first step)."""
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise ValueError(
            f"{path}: tensor {name!r} is {arr.dtype}, not floating point (a quantized "
            "checkpoint?); pass a checkpoint with float16/bfloat16/float32 weights"
        )
    finite = np.isfinite(arr)
    if not finite.all():
        bad = int(arr.size - np.count_nonzero(finite))
        raise ValueError(
            f"{path}: tensor {name!r} holds {bad} non-finite value(s) (NaN or inf); "
            "the weights are damaged: pass an intact checkpoint"
        )
    return arr


def _check(name: str, arr: np.ndarray, shape, config: LlamaConfig) -> np.ndarray:
    """``arr`` if it has ``shape``; else a ValueError naming the tensor and the config."""
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"Tensor {name!r} has shape {arr.shape}, expected {shape} for {config}.")
    return arr


def _check_tied_head(read: _TensorReader, config: LlamaConfig, embedding) -> None:
    """A tied checkpoint that stores ``lm_head.weight`` too: it must be the embedding."""
    if config.tie_embeddings and "lm_head.weight" in read.files:
        if not np.array_equal(read("lm_head.weight"), embedding):
            raise ValueError(
                "config.json has tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight; set tie_word_embeddings to false to load both."
            )


def _read_leaf(read: _TensorReader, config: LlamaConfig, name: str, transpose: bool, shape):
    """One tensor, ``[out, in]`` weights transposed to ``[in, out]``, shape-checked."""
    arr = read(name)
    return _check(name, arr.T if transpose else arr, shape, config)


def _report_unread(read: _TensorReader, allow_unused: bool, config: LlamaConfig) -> None:
    """ValueError listing the checkpoint's tensors the model never read."""
    unread = read.unread()
    if unread and not allow_unused:
        shown = ", ".join(unread[:12]) + (
            f" and {len(unread) - 12} more" if len(unread) > 12 else ""
        )
        raise ValueError(
            f"{len(unread)} tensors of the checkpoint in {read.directory!r} are not used by "
            f"{config}: {shown}. The model would compute something else than the "
            "checkpoint (e.g. biases of a config that does not declare them). Fix "
            "config.json, or pass allow_unused=True if they are truly not part of the model."
        )


def _read_layer(read, config, template: str, i: int, transpose: bool, shape) -> np.ndarray:
    """Layer ``i``'s weight: one tensor, or with ``{e}`` in ``template`` the layer's
    experts' tensors stacked ``[E, ...]`` (each one named in the errors)."""
    if "{e}" not in template:
        return _read_leaf(read, config, template.format(i=i), transpose, shape)
    return np.stack(
        [
            _read_leaf(read, config, template.format(i=i, e=e), transpose, shape[1:])
            for e in range(shape[0])
        ]
    )


def _load_stack(read, config, template, transpose, shape, dtype, nf4_options):
    """A layer weight stacked over layers: dense ``dtype``, or (``nf4_options`` given)
    NF4-quantized one layer matrix (or stack of expert matrices) at a time."""
    rows = (
        _read_layer(read, config, template, i, transpose, shape[1:])
        for i in range(config.num_layers)
    )
    if nf4_options is not None:
        return _stack_nf4([nf4.quantize(jnp.asarray(w, dtype), **nf4_options) for w in rows])
    stacked = np.empty(shape, dtype=dtype)
    for i, w in enumerate(rows):
        stacked[i] = w.astype(dtype)
    return jnp.asarray(stacked)


def _flat_shapes(config: LlamaConfig) -> dict[str, tuple]:
    """``{"layers/q_proj/kernel": shape, ...}`` of ``param_shapes(config)``."""
    out = {}
    for group, leaves in param_shapes(config).items():
        for name, leaf in leaves.items():
            if isinstance(leaf, dict):
                out.update({f"{group}/{name}/{k}": v for k, v in leaf.items()})
            else:
                out[f"{group}/{name}"] = leaf
    return out


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The params pytree of ``{"a/b/c": leaf}``."""
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, last = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


def _load_leaves(read, config, dtype, nf4_options) -> dict[str, Any]:
    """Every params leaf of ``config`` read from the checkpoint; layer kernels quantized
    when ``nf4_options`` is given (embedding, head, norms and biases stay ``dtype``)."""
    shapes = _flat_shapes(config)
    names = tensor_names(config)
    out = {}
    for path, shape in shapes.items():
        template, transpose = names[path]
        if path.startswith("layers/"):
            linear = path.endswith("/kernel") and path != "layers/router/kernel"
            quantized = nf4_options if linear else None  # the router stays in float
            out[path] = _load_stack(read, config, template, transpose, shape, dtype, quantized)
        else:
            out[path] = jnp.asarray(_read_leaf(read, config, template, transpose, shape), dtype)
    _check_tied_head(read, config, out["embed/embedding"])
    return out


def load_params(
    directory: str,
    config: LlamaConfig | None = None,
    *,
    dtype=jnp.bfloat16,
    quantize: str | None = None,
    block_size: int = 64,
    double_quant: bool = True,
    allow_unused: bool = False,
) -> tuple[dict[str, Any], LlamaConfig]:
    """Reads a checkpoint of any ``MODEL_TYPES`` family into the ``jmem.models.llama``
    params layout (leaves and tensor names from ``jmem.models.families.tensor_names``).

    With ``quantize="nf4"`` the host never holds the whole model in ``dtype``: the peak is
    the NF4 model plus the embedding/head and one layer's matrix.

    Args:
      directory: holds ``config.json`` and ``*.safetensors`` (single file or sharded with
        ``model.safetensors.index.json``).
      config: overrides the config read from ``config.json``.
      dtype: dtype of the unquantized leaves (embedding, norms, head, or every leaf).
      quantize: None, or ``"nf4"`` to quantize every layer's linear weight as it is read
        (``jmem.nf4``; embedding, head, norms and biases stay in ``dtype``), as in QLoRA.
      block_size, double_quant: NF4 options.
      allow_unused: load even if some tensors of the checkpoint are not part of the
        model (by default that is an error: they would be silently dropped).

    Returns:
      ``(params, config)``.

    Raises:
      FileNotFoundError: missing config, weight files or tensors.
      ValueError: a config field jmem does not implement (see ``load_config``), a tensor
        whose shape does not match the config, that is not floating point (an int8
        ``q_proj``), holds a NaN or inf, or cannot be read (a truncated file), each naming
        the tensor and its file; tensors left unread (unless ``allow_unused``), or an
        unknown ``quantize``.
    """
    if quantize not in (None, "nf4"):
        raise ValueError(f"quantize must be None or 'nf4'; got {quantize!r}.")
    config = config or load_config(directory)
    read = _TensorReader(directory, _weight_files(directory))
    nf4_options = None
    if quantize == "nf4":
        nf4_options = {"block_size": block_size, "double_quant": double_quant}
    try:
        params = _nest(_load_leaves(read, config, jnp.dtype(dtype), nf4_options))
        _report_unread(read, allow_unused, config)
    finally:
        read.close()
    return params, config
