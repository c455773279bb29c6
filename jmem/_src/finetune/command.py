"""The job's command line (``jmem finetune``, ``examples/qlora_7b.py``): flags and
``--config-file`` parsed once into a ``FinetuneConfig``, without JAX (``--help`` and usage
errors answer at once); that config goes to the entry point's huge-page restart
(``launcher.restart_with_huge_pages``) and to the job (``job.run_command``), which starts
JAX."""

from __future__ import annotations

import contextlib
import io
import sys

from jmem._src import native_logs
from jmem._src.finetune import launcher
from jmem._src.finetune.config_file import parse_args

#: The job's one-paragraph description (``--help``).
DESCRIPTION = (
    "QLoRA fine-tuning with every jmem memory lever on: NF4 base, LoRA adapters, remat, "
    "bf16 compute, 8-bit AdamW, gradient accumulation, optional optimizer offload."
)


def main(
    argv=None, prog: str = "jmem finetune", *, restart_with_huge_pages: bool = False
) -> dict | None:
    """The command line: flags (and ``--config-file``) -> ``run``. A bad input exits with
    status 2 and one line ``error: ...`` naming the flag or file (``--debug``: the
    traceback instead). Returns the summary (``summary.json``). ``argv`` None reads
    ``sys.argv[1:]``.

    ``restart_with_huge_pages``: a program's entry point only (``jmem``,
    ``examples/qlora_7b.py``): restart the process once with glibc's huge-page tunable
    where the flags ask for it (``launcher.restart_with_huge_pages``, ``os.execve``)."""
    if not restart_with_huge_pages:
        config = parse_args(argv, prog=prog, description=DESCRIPTION)
    else:
        config, notes = _parsed_quietly(argv, prog)
        launcher.restart_with_huge_pages(config)  # may os.execve: the new process prints
        sys.stdout.write(notes)
        sys.stdout.flush()
    native_logs.show(config.run.debug)
    with native_logs.hidden():  # the plugins' start-up log lines (cudart_stub, ...)
        from jmem._src.finetune import job  # noqa: PLC0415 (JAX starts here, with the work)

    return job.run_command(config)


def _parsed_quietly(argv, prog: str):
    """``(config, notes)``: ``parse_args`` with its notes (deprecated keys, flat config
    files) held back, so that a process that restarts prints them once; ``--help`` and a
    bad input print them at once (the process exits, it does not restart)."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            config = parse_args(argv, prog=prog, description=DESCRIPTION)
    except BaseException:
        sys.stdout.write(held.getvalue())
        raise
    return config, held.getvalue()
