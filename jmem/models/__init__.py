"""Reference models built on jmem's transforms: ``llama`` (the decoder), ``families`` (the
Hugging Face ``model_type`` table), ``hf`` (loading), ``export``, ``peft_format`` and
``preference``; each loads on first use (``jmem.models.llama`` after ``import jmem``)."""

_SUBMODULES = ("export", "families", "hf", "llama", "peft_format", "preference")


def __getattr__(name: str):
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'jmem.models' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    return importlib.import_module(f"jmem.models.{name}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULES))
