"""The named presets (``CONFIGS``, ``get_config``): ``LlamaConfig``s built from the one
table of model knowledge, ``jmem._src.model_table.PRESETS`` (shapes from each model's
``config.json`` on the Hugging Face Hub), which the planner reads too.
"""

from __future__ import annotations

import dataclasses

from jmem._src import model_table
from jmem.models.llama.config import LlamaConfig
from jmem.models.llama.config import RopeScaling


def _preset(name: str) -> LlamaConfig:
    """The ``LlamaConfig`` of ``model_table.PRESETS[name]`` (its family's options included)."""
    fields = model_table.preset_fields(name)
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return LlamaConfig(**fields)


#: Preset name -> ``LlamaConfig``: ``tiny`` (a few million parameters, trains on a CPU in
#: minutes), TinyLlama-1.1B shapes (``llama_1b``), Llama 2/3/3.1/3.2, Mistral 7B, Qwen2.5,
#: Gemma 2/3, Qwen3, Phi-3 mini and OLMo 2 (``jmem._src.model_table.PRESETS``).
CONFIGS: dict[str, LlamaConfig] = {name: _preset(name) for name in model_table.PRESETS}

#: Former ``LlamaConfig`` fields that are now ``jmem.Levers`` fields (old name -> new).
EXECUTION_FIELDS = {
    "attention": "attention",
    "loss_chunk": "loss_chunk",
    "mlp_chunk": "token_chunk",
    "scan_unroll": "scan_unroll",
}


def get_config(name: str | LlamaConfig, **overrides) -> LlamaConfig:
    """Returns a named config from ``CONFIGS`` (``tiny``, ``llama2_7b``, ``llama3_2_1b``,
    ``mistral_7b``, ``qwen2_5_7b``, ...), with ``overrides`` replaced.

    Raises:
      ValueError: for an unknown name (the message lists the known ones), or an execution
        setting among ``overrides`` (``attention``, ``loss_chunk``, ``mlp_chunk``,
        ``scan_unroll``: they are ``jmem.Levers``, not the model's identity).
    """
    moved = sorted(set(overrides) & set(EXECUTION_FIELDS))
    if moved:
        raise ValueError(
            f"{moved} are execution settings, not the model's identity: pass "
            f"levers=jmem.Levers({', '.join(EXECUTION_FIELDS[m] + '=...' for m in moved)}) "
            "to forward/loss_fn (or jmem.train_step) instead."
        )
    if isinstance(name, LlamaConfig):
        cfg = name
    else:
        try:
            cfg = CONFIGS[name]
        except KeyError:
            raise ValueError(
                f"Unknown model config {name!r}; choose one of {sorted(CONFIGS)}."
            ) from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
