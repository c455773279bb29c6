"""The QLoRA fine-tuning job as a library: ``run(FinetuneConfig(...))`` returns the summary;
``main(argv)`` is its command line (``python -m jmem finetune``, ``jmem finetune``). The
config nests frozen groups (``ModelConfig``, ``DataConfig``, ``LeversConfig``,
``TrainingConfig``, ``RunConfig``, ``OutputConfig``, ``DevicesConfig``);
``FinetuneConfig.from_flat(steps=20, ...)`` takes the flags' names. See
``docs/finetune.md``; the pieces (step builder, loop, run-directory rules) live in
``jmem._src.finetune``."""

from jmem._src.finetune.command import main
from jmem._src.finetune.config import DataConfig
from jmem._src.finetune.config import DevicesConfig
from jmem._src.finetune.config import FinetuneConfig
from jmem._src.finetune.config import LeversConfig
from jmem._src.finetune.config import ModelConfig
from jmem._src.finetune.config import OutputConfig
from jmem._src.finetune.config import RunConfig
from jmem._src.finetune.config import TrainingConfig
from jmem._src.finetune.config_file import parse_args
from jmem._src.finetune.job import run
from jmem._src.finetune.launcher import relaunch_with_huge_pages

__all__ = (
    "DataConfig",
    "DevicesConfig",
    "FinetuneConfig",
    "LeversConfig",
    "ModelConfig",
    "OutputConfig",
    "RunConfig",
    "TrainingConfig",
    "main",
    "parse_args",
    "relaunch_with_huge_pages",
    "run",
)
