"""The job's command line (``jmem finetune``, ``examples/qlora_7b.py``): flags and
``--config-file`` parsed without JAX (``--help`` and usage errors answer at once), then the
job (``job.run_command``), which starts JAX."""

from __future__ import annotations

from jmem._src.finetune.config_file import parse_args

#: The job's one-paragraph description (``--help``).
DESCRIPTION = (
    "QLoRA fine-tuning with every jmem memory lever on: NF4 base, LoRA adapters, remat, "
    "bf16 compute, 8-bit AdamW, gradient accumulation, optional optimizer offload."
)


def main(argv=None, prog: str = "jmem finetune") -> dict | None:
    """The command line: flags (and ``--config-file``) -> ``run``. A bad input exits with
    status 2 and one line ``error: ...`` naming the flag or file (``--debug``: the
    traceback instead). Returns the summary (``summary.json``). ``argv`` None reads
    ``sys.argv[1:]``. Huge pages on CPU come from the entry points, which call
    ``jmem._src.finetune.launcher.relaunch_with_huge_pages`` before this."""
    config = parse_args(argv, prog=prog, description=DESCRIPTION)
    from jmem._src.finetune import job  # noqa: PLC0415 (JAX starts here, with the work)

    return job.run_command(config)
