"""jmem: fit LLM training in less accelerator memory, in pure JAX."""
from jmem.measure import MemoryReport, format_bytes, measure
from jmem.remat import REMAT_POLICIES, remat, resolve_policy

__version__ = "0.1.0"
