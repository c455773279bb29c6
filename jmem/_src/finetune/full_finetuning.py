"""The rules of full fine-tuning in the job (``--lora-rank 0``): the options that contradict
it, checked with the other combinations of ``config.check_combinations`` (no JAX)."""

from __future__ import annotations

from jmem._src import cli

#: Options that shape LoRA adapters, refused with ``lora_rank`` 0 (no adapters).
LORA_OPTIONS = ("lora_alpha", "lora_dropout", "lora_targets")


def check_full_finetuning(get, name, default) -> None:
    """``lora_rank`` 0 (full fine-tuning: no adapters, no NF4 base) with an adapter option
    given, DPO (whose reference is the base with the adapters off) or ``offload`` params
    without the optimizer state in host memory is a contradiction. ``get(option)``: its
    value; ``name(option)``: how the message spells it; ``default(option)``: its default.

    Raises:
      CliError: one line naming the options.
    """
    if get("lora_rank") != 0:
        return
    full = f"{name('lora_rank')} 0 (full fine-tuning, no adapters)"
    for option_name in LORA_OPTIONS:
        if get(option_name) != default(option_name):
            raise cli.CliError(
                f"{name(option_name)} shapes LoRA adapters; {full} has none: drop it"
            )
    offload, on_disk = get("offload"), get("offload_dir") is not None
    if "params" in offload.split(",") and (offload != "optimizer,params" or on_disk):
        raise cli.CliError(  # train_step updates host params with host masters and state only
            f"{name('offload')} params under {full} needs the optimizer state and masters in "
            f"host memory too (not on the device, nor on disk with {name('offload_dir')}): "
            f"pass {name('offload')} optimizer,params without {name('offload_dir')}"
        )
    if get("objective") == "dpo":
        raise cli.CliError(
            f"{name('objective')} dpo takes its reference from the frozen base with the adapters "
            f"off; {full} holds no frozen copy: pass {name('objective')} orpo or simpo "
            "(reference-free), or a --lora-rank >= 1"
        )
