"""The QLoRA fine-tuning job as a library: ``run(FinetuneConfig(...))`` returns the summary;
``main(argv)`` is its command line (``python -m jmem finetune``, ``jmem finetune``). The
config nests frozen groups (``ModelConfig``, ``DataConfig``, ``ExecutionConfig``,
``TrainingConfig``, ``RunConfig``, ``OutputConfig``, ``DevicesConfig``);
``FinetuneConfig.from_flat(steps=20, ...)`` takes the flags' names. See
``docs/finetune.md``; the pieces (step builder, loop, run-directory rules) live in
``jmem._src.finetune``."""

from jmem._src.deprecated_names import module_getattr
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
__getattr__ = module_getattr(
    "jmem.finetune",
    {
        "LeversConfig": (
            "jmem._src.finetune.config",
            "ExecutionConfig",
            "jmem.finetune.ExecutionConfig",
        ),
        "parse_args": ("jmem._src.finetune.config_file", "parse_args", "jmem.finetune.main(argv)"),
        "relaunch_with_huge_pages": (
            "jmem._src.finetune.launcher",
            "relaunch_with_huge_pages",
            "jmem.finetune.main(argv, restart_with_huge_pages=True)",
        ),
    },
)
