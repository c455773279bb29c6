"""Long-context operations: memory-efficient attention, a chunked cross-entropy and chunked
sequence and per-token log-probabilities."""

from jmem._src.attention import IMPLEMENTATIONS
from jmem._src.attention import attention
from jmem._src.attention import attention_mask
from jmem._src.linear_cross_entropy import linear_cross_entropy
from jmem._src.linear_cross_entropy import token_nll
from jmem._src.sequence_logprobs import SequenceLogprobs
from jmem._src.sequence_logprobs import sequence_logprobs
from jmem._src.sequence_logprobs import token_logprobs

__all__ = (
    "IMPLEMENTATIONS",
    "SequenceLogprobs",
    "attention",
    "attention_mask",
    "linear_cross_entropy",
    "sequence_logprobs",
    "token_logprobs",
    "token_nll",
)
