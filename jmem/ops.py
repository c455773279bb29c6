"""Long-context operations: memory-efficient attention and a chunked cross-entropy."""

from jmem._src.attention import IMPLEMENTATIONS
from jmem._src.attention import attention
from jmem._src.attention import attention_mask
from jmem._src.linear_cross_entropy import linear_cross_entropy
from jmem._src.linear_cross_entropy import token_nll

__all__ = (
    "IMPLEMENTATIONS",
    "attention",
    "attention_mask",
    "linear_cross_entropy",
    "token_nll",
)
