"""The QLoRA fine-tuning job as a library: ``run(FinetuneConfig(...))`` returns the summary;
the pieces (``build``, ``train``, ``dry_run``, ``Evaluator``, ``Sampler``, the run-directory
rules) can be called on their own. ``python -m jmem finetune`` (or ``jmem finetune``) is its
command line; see ``docs/finetune.md``."""

from jmem._src.cli import CliError
from jmem._src.finetune.build import build
from jmem._src.finetune.build import quantized_base
from jmem._src.finetune.config import FinetuneConfig
from jmem._src.finetune.config import parse_args
from jmem._src.finetune.config import read_config_file
from jmem._src.finetune.config import validate
from jmem._src.finetune.datasets import load_datasets
from jmem._src.finetune.dry_run import dry_run
from jmem._src.finetune.job import main
from jmem._src.finetune.job import run
from jmem._src.finetune.launcher import relaunch_with_huge_pages
from jmem._src.finetune.loop import Evaluator
from jmem._src.finetune.loop import init_state
from jmem._src.finetune.loop import train
from jmem._src.finetune.outputs import Sampler
from jmem._src.finetune.outputs import save_adapters
from jmem._src.finetune.report import finish
from jmem._src.finetune.rundir import prepare_out
from jmem._src.finetune.setup import check_outputs
from jmem._src.finetune.setup import make_tokenizer
from jmem._src.finetune.setup import model_config
from jmem._src.finetune.setup import resolve_defaults

__all__ = (
    "CliError",
    "Evaluator",
    "FinetuneConfig",
    "Sampler",
    "build",
    "check_outputs",
    "dry_run",
    "finish",
    "init_state",
    "load_datasets",
    "main",
    "make_tokenizer",
    "model_config",
    "parse_args",
    "prepare_out",
    "quantized_base",
    "read_config_file",
    "relaunch_with_huge_pages",
    "resolve_defaults",
    "run",
    "save_adapters",
    "train",
    "validate",
)
