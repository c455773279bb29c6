"""The rollout's micro-batch program compiled from abstract shapes (nothing allocated):
``llama.rollout``'s per-micro-batch program (the prefill of ``generation_batch`` prompts
into a KV cache of prompt + completion tokens, then the decoding loop, one token per step
over the whole cache) on the NF4 base and the adapters, for a compile target; its memory
is XLA's buffer assignment (``jmem.measure``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jmem import qlora
from jmem._src.measure import MemoryReport
from jmem._src.measure import measure
from jmem.models.llama import generation


def rollout_report(
    frozen,
    adapters,
    cfg,
    *,
    generation_batch: int,
    max_prompt_len: int,
    max_completion_len: int,
    sampling: tuple[float, float, int] = (1.0, 1.0, 0),
    eos: tuple[int, ...] = (0,),
    target=None,
) -> MemoryReport:
    """The compiled memory of one rollout micro-batch (``llama.rollout``'s program).

    Args:
      frozen: the NF4 base (arrays or ``jax.ShapeDtypeStruct``s).
      adapters: the LoRA adapters for ``jmem.qlora.apply`` (arrays or shapes), or None.
      cfg: the model's ``LlamaConfig``.
      generation_batch: rows decoded together (the KV cache's batch).
      max_prompt_len, max_completion_len: prompt and completion tokens per row.
      sampling: ``(temperature, top_p, top_k)``.
      eos: end-of-sequence ids (the loop's stop; its trip count is unknown to the compiler).
      target: a ``jmem.targets`` name (None: the running backend).

    Returns:
      a ``MemoryReport`` (bytes; XLA's buffer assignment).

    Raises:
      RuntimeError: as ``jmem.measure`` (no memory analysis, no CUDA plugin for a GPU
        target).
    """
    rows, P = generation_batch, max_prompt_len
    prompt = jax.ShapeDtypeStruct((rows, P), jnp.int32)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows))
    program = functools.partial(
        generation._rollout_chunk,  # noqa: SLF001 (the micro-batch program rollout runs)
        config=cfg,
        max_new_tokens=int(max_completion_len),
        sampling=tuple(sampling),
        eos=tuple(eos),
        pad_id=int(eos[0]) if eos else 0,
        apply=qlora.apply if adapters is not None else None,
    )
    return measure(jax.jit(program), frozen, adapters, prompt, prompt, keys, target=target)
