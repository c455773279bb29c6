"""The ``config.json`` writer, the inverse of ``read.py``: ``LlamaConfig`` -> the Hugging
Face config of the first family that computes it (``hf_config``, behind
``jmem.models.export``), checked by reading it back, and the source fields an export
carries over unchanged (``carried_fields``). Sources: transformers'
``configuration_<family>.py``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from jmem.models.families.read import config_from_dict
from jmem.models.families.table import FAMILIES
from jmem.models.families.table import HANDLED_FIELDS
from jmem.models.families.table import IGNORED_FIELDS
from jmem.models.families.table import family_of
from jmem.models.llama import LlamaConfig
from jmem.models.llama import RopeScaling

__all__ = ["carried_fields", "hf_config", "write_windows"]


def write_windows(config: LlamaConfig, model_type: str) -> dict:
    """``config.json``'s window fields of ``config`` for ``model_type`` (inverse of
    ``layer_windows``)."""
    c = config
    types = list(c.layer_types or [])
    if not types:
        kind = "full_attention" if c.sliding_window is None else "sliding_attention"
        types = [kind] * c.num_layers
    return FAMILIES[model_type].windows.write(c, types)


#: IGNORED_FIELDS an export writes from what it computes (its family, its tensors' dtype),
#: never from the source checkpoint.
_WRITTEN_FIELDS = frozenset(
    {"_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version"}
)


def carried_fields(source: dict, model_type: str) -> dict:
    """The fields of a source ``config.json`` an export of it writes back unchanged: what
    jmem reads but does not compute with (``IGNORED_FIELDS``: token ids, ``use_cache``,
    ``max_position_embeddings``, ...) and, when the export has the source's ``model_type``,
    fields unknown to jmem. Fields that set the computation (``HANDLED_FIELDS``, the
    family's own) are written from the ``LlamaConfig`` instead, as are the architecture and
    the dtype (those of the written tensors).

    Args:
      source: the parsed ``config.json`` of the checkpoint the model was loaded from.
      model_type: the export's family (``family_of``).

    Returns:
      ``{field: value}`` to merge over the written config.
    """
    same = source.get("model_type", "llama") == model_type
    computed = HANDLED_FIELDS | set(FAMILIES[model_type].fields) | _WRITTEN_FIELDS
    return {k: v for k, v in source.items() if k not in computed and (k in IGNORED_FIELDS or same)}


def _rope_parameters(theta: float, rs: RopeScaling | None) -> dict:
    """One RoPE parameter dict as transformers >= 5 writes it (``rope_theta`` inside)."""
    if rs is None:
        scaling = {"rope_type": "default"}
    elif rs.rope_type == "linear":
        scaling = {"rope_type": "linear", "factor": rs.factor}
    else:
        scaling = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    return {**scaling, "rope_theta": theta}


def _rope_fields(config: LlamaConfig, per_layer: bool) -> dict[str, Any]:
    """RoPE as transformers >= 5 writes it (``rope_parameters``), with ``rope_theta`` /
    ``rope_scaling`` (and Gemma 3's ``rope_local_base_freq``) for transformers 4."""
    c = config
    params = _rope_parameters(c.rope_theta, c.rope_scaling)
    scaling = None if c.rope_scaling is None else dict(params)
    if scaling is not None:
        scaling.pop("rope_theta")
    out = {"rope_theta": c.rope_theta, "rope_scaling": scaling, "rope_parameters": params}
    if per_layer:
        local = c.rope_theta if c.local_rope_theta is None else c.local_rope_theta
        out["rope_local_base_freq"] = local
        out["rope_parameters"] = {
            "full_attention": params,
            "sliding_attention": _rope_parameters(local, None),
        }
    return out


def _check_round_trip(config: LlamaConfig, written: dict) -> None:
    """ValueError naming the fields of ``config`` that ``written`` would not reproduce
    (every field: a ``LlamaConfig`` holds the model's identity only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = config_from_dict(written)
    lost = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(LlamaConfig)
        if getattr(back, f.name) != getattr(config, f.name)
    }
    if lost:
        raise ValueError(
            f"The {written['model_type']} config.json cannot express {lost} of {config}: "
            "transformers' family would compute a different model; export a config its "
            "family implements."
        )


def hf_config(config: LlamaConfig, dtype_name: str = "float32") -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict of ``config`` (see ``jmem.models.export``)."""
    c = config
    model_type = family_of(c)
    family = FAMILIES[model_type]
    out = {
        "architectures": [family.architecture],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.rms_norm_eps,
        **_rope_fields(c, family.per_layer_rope),
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
        **write_windows(c, model_type),
        **family.write(c),
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    _check_round_trip(c, out)
    return out
