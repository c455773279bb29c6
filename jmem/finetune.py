"""The QLoRA fine-tuning job as a library: ``run(FinetuneConfig(...))`` returns the summary;
``main(argv)`` is its command line (``python -m jmem finetune``, ``jmem finetune``). The
config nests frozen groups (``ModelConfig``, ``DataConfig``, ``ExecutionConfig``,
``TrainingConfig``, ``RunConfig``, ``OutputConfig``, ``DevicesConfig``);
``FinetuneConfig.from_flat(steps=20, ...)`` takes the flags' names. See
``docs/finetune.md``; the pieces (step builder, loop, run-directory rules) live in
``jmem._src.finetune``."""

import importlib as _importlib
import warnings as _warnings

from jmem._src.finetune.command import main
from jmem._src.finetune.config import DataConfig
from jmem._src.finetune.config import DevicesConfig
from jmem._src.finetune.config import ExecutionConfig
from jmem._src.finetune.config import FinetuneConfig
from jmem._src.finetune.config import ModelConfig
from jmem._src.finetune.config import OutputConfig
from jmem._src.finetune.config import RunConfig
from jmem._src.finetune.config import TrainingConfig
from jmem._src.finetune.job import run

__all__ = (
    "DataConfig",
    "DevicesConfig",
    "ExecutionConfig",
    "FinetuneConfig",
    "ModelConfig",
    "OutputConfig",
    "RunConfig",
    "TrainingConfig",
    "main",
    "run",
)

#: Names deprecated here -> (module, name, what to use instead).
_DEPRECATED = {
    "LeversConfig": ("jmem._src.finetune.config", "ExecutionConfig", "ExecutionConfig"),
    "parse_args": ("jmem._src.finetune.config_file", "parse_args", "main(argv)"),
    "relaunch_with_huge_pages": (
        "jmem._src.finetune.launcher",
        "relaunch_with_huge_pages",
        "main(argv, restart_with_huge_pages=True)",
    ),
}


def __getattr__(name: str):
    if name not in _DEPRECATED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr, instead = _DEPRECATED[name]
    _warnings.warn(
        f"jmem.finetune.{name} is deprecated; use jmem.finetune.{instead}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_importlib.import_module(module), attr)
