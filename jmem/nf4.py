"""4-bit NormalFloat (NF4) weights with double quantization (Dettmers et al. 2023)."""

from jmem._src.nf4 import NF4_TABLE
from jmem._src.nf4 import NF4Array
from jmem._src.nf4 import bytes_per_param
from jmem._src.nf4 import dequantize
from jmem._src.nf4 import dequantize_absmax
from jmem._src.nf4 import quantize

__all__ = (
    "NF4_TABLE",
    "NF4Array",
    "bytes_per_param",
    "dequantize",
    "dequantize_absmax",
    "quantize",
)
