"""Load Hugging Face Llama checkpoints (``config.json`` + ``*.safetensors``) into
``jmem.models.llama`` params, tensor by tensor, optionally quantizing to NF4 as they are read
(QLoRA, Dettmers et al. 2023); HF's ``[out, in]`` weights become stacked ``[in, out]`` kernels.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from jmem._src import nf4
from jmem.models.export import save_params
from jmem.models.llama import LINEAR_NAMES
from jmem.models.llama import LlamaConfig
from jmem.models.llama import param_shapes
from jmem.models.peft_format import load_adapters
from jmem.models.peft_format import save_adapters

__all__ = ["load_adapters", "load_config", "load_params", "save_adapters", "save_params"]

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.weight$")
_NORM_RE = re.compile(r"^model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight$")


def load_config(directory: str) -> LlamaConfig:
    """``LlamaConfig`` from a checkpoint's ``config.json``.

    Raises:
      FileNotFoundError: no ``config.json`` in ``directory``.
      ValueError: a model type or RoPE scaling this loader does not implement.
    """
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{directory!r} has no config.json: pass a Hugging Face checkpoint "
            "directory (config.json plus *.safetensors)."
        )
    with open(path) as f:
        c = json.load(f)
    if c.get("model_type", "llama") not in ("llama", "mistral"):
        raise ValueError(f"model_type {c.get('model_type')!r} is not a Llama-family decoder.")
    # transformers < 5 writes rope_theta/rope_scaling; >= 5 writes rope_parameters.
    rope = dict(c.get("rope_parameters") or {})
    scaling = c.get("rope_scaling") or rope
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(
            f"rope_scaling {scaling} is not implemented by jmem.models.llama; "
            "use a checkpoint with default RoPE."
        )
    rope_theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    heads = c["num_attention_heads"]
    return LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq_len=int(c.get("max_position_embeddings", 4096)),
    )


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
        return {k: os.path.join(directory, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors files in {directory!r} (PyTorch .bin checkpoints "
            "are not supported; convert them with safetensors)."
        )
    from safetensors import safe_open  # noqa: PLC0415

    out = {}
    for fn in files:
        with safe_open(os.path.join(directory, fn), framework="numpy") as f:
            out.update({k: os.path.join(directory, fn) for k in f.keys()})
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

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise FileNotFoundError(
                f"Tensor {name!r} is missing from the checkpoint in {self.directory!r}."
            )
        from safetensors import safe_open  # noqa: PLC0415

        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = safe_open(path, framework="numpy").__enter__()
        return self.handles[path].get_tensor(name)

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


def _layer_kernels(read: _TensorReader, config: LlamaConfig, name: str, shape):
    """Yields layer ``i``'s ``name`` weight as a jmem ``[in, out]`` kernel, checked."""
    group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    for i in range(config.num_layers):
        key = f"model.layers.{i}.{group}.{name}.weight"
        yield _check(key, read(key).T, shape[1:], config)


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

    Returns:
      ``(params, config)``.

    Raises:
      FileNotFoundError: missing config, weight files or tensors.
      ValueError: a tensor whose shape does not match the config, or an unknown ``quantize``.
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
    finally:
        read.close()
    return params, config
