"""Model families as config mappings: each transformers ``model_type`` jmem loads is a set of
``LlamaConfig`` family options plus the ``config.json`` fields that set the rest.

One table, ``FAMILIES`` (``table.py``, with ``tensor_names``: every params leaf's Hugging
Face tensor name), read by ``jmem.models.hf`` through ``read.py`` (``config.json`` ->
``LlamaConfig``) and by ``jmem.models.export`` through ``write.py`` (the inverse). A new
Llama-like family is one ``Family`` entry of the table (see ``docs/families.md``).
"""

from jmem.models.families.read import config_from_dict
from jmem.models.families.read import layer_windows
from jmem.models.families.table import ALTERNATING
from jmem.models.families.table import EVERY_LAYER
from jmem.models.families.table import FAMILIES
from jmem.models.families.table import FAMILY_OPTIONS
from jmem.models.families.table import HANDLED_FIELDS
from jmem.models.families.table import IGNORED_FIELDS
from jmem.models.families.table import NO_WINDOWS
from jmem.models.families.table import NOT_LOADED
from jmem.models.families.table import PATTERN
from jmem.models.families.table import QWEN_WINDOWS
from jmem.models.families.table import USE_SLIDING_WINDOW
from jmem.models.families.table import Family
from jmem.models.families.table import Windows
from jmem.models.families.table import family_of
from jmem.models.families.table import refuse
from jmem.models.families.table import tensor_names
from jmem.models.families.write import carried_fields
from jmem.models.families.write import hf_config
from jmem.models.families.write import write_windows

__all__ = [
    "ALTERNATING",
    "EVERY_LAYER",
    "FAMILIES",
    "FAMILY_OPTIONS",
    "HANDLED_FIELDS",
    "IGNORED_FIELDS",
    "NOT_LOADED",
    "NO_WINDOWS",
    "PATTERN",
    "QWEN_WINDOWS",
    "USE_SLIDING_WINDOW",
    "Family",
    "Windows",
    "carried_fields",
    "config_from_dict",
    "family_of",
    "hf_config",
    "layer_windows",
    "refuse",
    "tensor_names",
    "write_windows",
]
