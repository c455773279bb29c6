"""Load Hugging Face Llama, Mistral and Qwen2 checkpoints (``config.json`` +
``*.safetensors``) into ``jmem.models.llama`` params, strictly (a config field jmem does not
implement or a tensor it would not read is an error), tensor by tensor, optionally quantizing to NF4 as they are read
(QLoRA, Dettmers et al. 2023); HF's ``[out, in]`` weights become stacked ``[in, out]`` kernels.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmem._src import nf4
from jmem.models.export import save_params
from jmem.models.llama import ACTIVATIONS
from jmem.models.llama import LINEAR_NAMES
from jmem.models.llama import LlamaConfig
from jmem.models.llama import RopeScaling
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

#: config.json fields that do not change the computation (token ids, init, bookkeeping).
IGNORED_FIELDS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "initializer_range",
        "max_position_embeddings",
        "pad_token_id",
        "pretraining_tp",  # a tensor-parallel split of the same matmul
        "tokenizer_class",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)

#: config.json fields read (implemented, or refused for values jmem does not implement).
HANDLED_FIELDS = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "attention_bias",
        "mlp_bias",
        "attention_dropout",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "quantization_config",
    }
)

MODEL_TYPES = ("llama", "mistral", "qwen2")

_ROPE_KEYS = {
    None: {"rope_type", "type", "rope_theta"},
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
}


def _refuse(field: str, value, supported: str):
    raise ValueError(
        f"config.json: {field}={value!r} is not implemented by jmem.models.llama "
        f"(supported: {supported}); loading it would compute a different model."
    )


def _rope(c: dict) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_scaling`` (transformers < 5) or
    ``rope_parameters`` (>= 5, which also holds ``rope_theta``)."""
    # both may be present (a file edited by hand or by an older tool): rope_scaling wins
    field = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    winner = c.get(field) or {}
    kind = winner.get("rope_type", winner.get("type"))
    rope = {**(c.get("rope_parameters") or {}), **(c.get("rope_scaling") or {})}
    rope.pop("type", None)
    rope["rope_type"] = kind  # the winning spelling's type, not the other's
    supported = "rope_type default, linear, llama3"
    if kind not in _ROPE_KEYS:
        _refuse(f"{field}.rope_type", kind, supported)
    required = _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta"}
    missing = sorted(k for k in required if rope.get(k) is None)
    if missing:
        raise ValueError(
            f"config.json: {field} with rope_type={kind!r} lacks {missing}; RoPE "
            f"{kind} scaling needs {sorted(required)}."
        )
    extra = {k: v for k, v in rope.items() if k not in _ROPE_KEYS[kind] and v is not None}
    partial = extra.pop("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        _refuse("partial_rotary_factor", partial, "1.0 (rotary over the whole head)")
    if extra:
        _refuse(field, extra, f"{supported} with keys {sorted(_ROPE_KEYS[kind] - {'type'})}")
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind in (None, "default"):
        return theta, None
    factor = float(rope["factor"])
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    return theta, RopeScaling(
        "llama3",
        factor,
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )


def _sliding_window(c: dict, model_type: str) -> int | None:
    """The window of every layer, None for full attention; mixed layers are refused."""
    window = c.get("sliding_window")
    layers = c["num_hidden_layers"]
    if model_type == "llama" or window is None:
        types = ["full_attention"] * layers
    elif "layer_types" in c:
        types = list(c["layer_types"])
    elif model_type == "qwen2":
        start = c.get("max_window_layers", layers) if c.get("use_sliding_window") else layers
        types = ["full_attention" if i < start else "sliding_attention" for i in range(layers)]
    else:
        types = ["sliding_attention"] * layers
    if model_type == "qwen2" and not c.get("use_sliding_window", False):
        types = ["full_attention"] * layers
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        _refuse("layer_types", unknown, "full_attention, sliding_attention")
    if len(set(types)) > 1:
        _refuse(
            "layer_types",
            types,
            "one attention type in every layer (the layers are one lax.scan): all "
            "full_attention or all sliding_attention",
        )
    return int(window) if types and types[0] == "sliding_attention" else None


def _biases(c: dict, model_type: str) -> tuple[str, ...]:
    """The projections with a bias: Qwen2's q/k/v; Llama's ``attention_bias``/``mlp_bias``."""
    if model_type == "qwen2":
        return ("q_proj", "k_proj", "v_proj")
    out = ()
    if c.get("attention_bias", False):
        out += ("q_proj", "k_proj", "v_proj", "o_proj")
    if c.get("mlp_bias", False):
        out += ("gate_proj", "up_proj", "down_proj")
    return out


def _check_fields(c: dict, model_type: str) -> None:
    """Refuses fields whose values jmem does not implement; warns about unknown fields."""
    if c.get("quantization_config"):
        method = c["quantization_config"].get("quant_method", "?")
        _refuse(
            "quantization_config.quant_method",
            method,
            "unquantized checkpoints; use load_params(quantize='nf4') to quantize on load",
        )
    if c.get("hidden_act", "silu") not in ACTIVATIONS:
        _refuse("hidden_act", c.get("hidden_act"), ", ".join(sorted(ACTIVATIONS)))
    if c.get("attention_dropout", 0.0):
        _refuse("attention_dropout", c["attention_dropout"], "0.0 (jmem applies no dropout)")
    if model_type == "qwen2" and (c.get("attention_bias") or c.get("mlp_bias")):
        _refuse("attention_bias/mlp_bias", True, "absent for qwen2 (q/k/v biases are built in)")
    unknown = sorted(k for k in set(c) - IGNORED_FIELDS - HANDLED_FIELDS if c[k] is not None)
    if unknown:
        warnings.warn(
            f"config.json fields {unknown} are unknown to jmem.models.hf and ignored; if "
            "they change the model, its logits will differ from transformers'.",
            stacklevel=3,
        )


def config_from_dict(c: dict) -> LlamaConfig:
    """``LlamaConfig`` from a parsed Hugging Face ``config.json`` (``model_type`` llama,
    mistral or qwen2). See ``load_config``."""
    model_type = c.get("model_type", "llama")
    if model_type not in MODEL_TYPES:
        _refuse("model_type", model_type, ", ".join(MODEL_TYPES))
    _check_fields(c, model_type)
    rope_theta, rope_scaling = _rope(c)
    heads = c["num_attention_heads"]
    return LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rope_theta=rope_theta,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq_len=int(c.get("max_position_embeddings", 4096)),
        rope_scaling=rope_scaling,
        sliding_window=_sliding_window(c, model_type),
        biases=_biases(c, model_type),
        hidden_act=c.get("hidden_act", "silu"),
    )


def load_config(directory: str) -> LlamaConfig:
    """``LlamaConfig`` from a checkpoint's ``config.json``.

    Every field that changes the computation is implemented or refused (``HANDLED_FIELDS``;
    ``IGNORED_FIELDS`` are bookkeeping). Implemented: ``model_type`` llama, mistral, qwen2;
    RoPE default, ``linear`` and ``llama3`` scaling, spelled ``rope_scaling``
    (transformers < 5) or ``rope_parameters`` (>= 5); sliding-window attention when every
    layer uses it (Mistral) or none does; Qwen2's q/k/v biases, Llama's ``attention_bias``
    and ``mlp_bias``; ``hidden_act`` in ``jmem.models.llama.ACTIVATIONS``.

    Raises:
      FileNotFoundError: no ``config.json`` in ``directory``.
      ValueError: a field value this loader does not implement; the message names the
        field, its value and what is supported.

    Warns:
      UserWarning: non-null fields unknown to this loader (neither handled nor ignored).
    """
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{directory!r} has no config.json: pass a Hugging Face checkpoint "
            "directory (config.json plus *.safetensors)."
        )
    with open(path) as f:
        return config_from_dict(json.load(f))


def _weight_files(directory: str) -> dict[str, str]:
    """Maps each tensor name to its safetensors file."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
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
        with safe_open(path, framework="numpy") as f:
            out[path] = list(f.keys())
    return out


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


def _check(name: str, arr: np.ndarray, shape, config: LlamaConfig) -> np.ndarray:
    """``arr`` if it has ``shape``; else a ValueError naming the tensor and the config."""
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"Tensor {name!r} has shape {arr.shape}, expected {shape} for {config}.")
    return arr


def _load_unquantized(read: _TensorReader, config: LlamaConfig, shapes, dtype) -> dict[str, Any]:
    """Embedding, final norm, (untied) head and the per-layer norms, in ``dtype``."""
    key = "model.embed_tokens.weight"
    embedding = _check(key, read(key), shapes["embed"]["embedding"], config)
    params: dict[str, Any] = {
        "embed": {"embedding": jnp.asarray(embedding, dtype)},
        "final_norm": {"scale": jnp.asarray(read("model.norm.weight"), dtype)},
        "layers": {},
    }
    if config.tie_embeddings and "lm_head.weight" in read.files:
        # some tied checkpoints store the head too: it must be the embedding
        if not np.array_equal(read("lm_head.weight"), embedding):
            raise ValueError(
                "config.json has tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight; set tie_word_embeddings to false to load both."
            )
    if not config.tie_embeddings:
        head = _check(
            "lm_head.weight", read("lm_head.weight").T, shapes["lm_head"]["kernel"], config
        )
        params["lm_head"] = {"kernel": jnp.asarray(head, dtype)}
    for ours, theirs in (
        ("attn_norm", "input_layernorm"),
        ("mlp_norm", "post_attention_layernorm"),
    ):
        rows = [read(f"model.layers.{i}.{theirs}.weight") for i in range(config.num_layers)]
        params["layers"][ours] = {"scale": jnp.asarray(np.stack(rows), dtype)}
    return params


def _group(name: str) -> str:
    return "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def _layer_kernels(read: _TensorReader, config: LlamaConfig, name: str, shape):
    """Yields layer ``i``'s ``name`` weight as a jmem ``[in, out]`` kernel, checked."""
    for i in range(config.num_layers):
        key = f"model.layers.{i}.{_group(name)}.{name}.weight"
        yield _check(key, read(key).T, shape[1:], config)


def _load_bias(read: _TensorReader, config: LlamaConfig, name: str, shape, dtype):
    """Projection ``name``'s bias stacked over layers, ``[L, out]`` in ``dtype``."""
    rows = []
    for i in range(config.num_layers):
        key = f"model.layers.{i}.{_group(name)}.{name}.bias"
        rows.append(_check(key, read(key), shape[1:], config))
    return jnp.asarray(np.stack(rows), dtype)


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


def _load_linear(read, config, shape, name, dtype, quantize, block_size, double_quant):
    """One linear weight stacked over layers: dense ``dtype``, or NF4 quantized per layer."""
    kernels = _layer_kernels(read, config, name, shape)
    if quantize == "nf4":
        parts = [
            nf4.quantize(jnp.asarray(w, dtype), block_size=block_size, double_quant=double_quant)
            for w in kernels
        ]
        return _stack_nf4(parts)
    stacked = np.empty(shape, dtype=dtype)
    for i, w in enumerate(kernels):
        stacked[i] = w.astype(dtype)
    return jnp.asarray(stacked)


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
    """Reads a checkpoint into the ``jmem.models.llama`` params layout.

    With ``quantize="nf4"`` the host never holds the whole model in ``dtype``: the peak is
    the NF4 model plus the embedding/head and one layer's matrix.

    Args:
      directory: holds ``config.json`` and ``*.safetensors`` (single file or sharded with
        ``model.safetensors.index.json``).
      config: overrides the config read from ``config.json``.
      dtype: dtype of the unquantized leaves (embedding, norms, head, or every leaf).
      quantize: None, or ``"nf4"`` to quantize every layer's linear weight as it is read
        (``jmem.nf4``; embedding and head stay in ``dtype``), as in QLoRA.
      block_size, double_quant: NF4 options.
      allow_unused: load even if some tensors of the checkpoint are not part of the
        model (by default that is an error: they would be silently dropped).

    Returns:
      ``(params, config)``.

    Raises:
      FileNotFoundError: missing config, weight files or tensors.
      ValueError: a config field jmem does not implement (see ``load_config``), a tensor
        whose shape does not match the config, tensors left unread (unless
        ``allow_unused``), or an unknown ``quantize``.
    """
    if quantize not in (None, "nf4"):
        raise ValueError(f"quantize must be None or 'nf4'; got {quantize!r}.")
    config = config or load_config(directory)
    shapes = param_shapes(config)
    read = _TensorReader(directory, _weight_files(directory))
    np_dtype = jnp.dtype(dtype)
    try:
        params = _load_unquantized(read, config, shapes, np_dtype)
        for name in LINEAR_NAMES:
            shape = shapes["layers"][name]["kernel"]
            kernel = _load_linear(
                read, config, shape, name, np_dtype, quantize, block_size, double_quant
            )
            params["layers"][name] = {"kernel": kernel}
            if "bias" in shapes["layers"][name]:
                params["layers"][name]["bias"] = _load_bias(
                    read, config, name, shapes["layers"][name]["bias"], np_dtype
                )
        _report_unread(read, allow_unused, config)
    finally:
        read.close()
    return params, config
