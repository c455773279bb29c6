"""jmem.measure: compiled memory without allocating, from arrays or abstract shapes."""

import jax
import jax.numpy as jnp

import jmem


def test_abstract_and_concrete_arguments_agree():
    f = lambda a, b: jnp.tanh(a @ b).sum(0)
    a, b = jnp.ones((64, 128)), jnp.ones((128, 32))
    r1 = jmem.measure(f, a, b)
    r2 = jmem.measure(
        f, jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype)
    )
    assert r1 == r2
    assert r1.argument_bytes == (64 * 128 + 128 * 32) * 4
    assert r1.output_bytes == 32 * 4
    assert r1.peak_bytes >= r1.argument_bytes


def test_donation_shows_as_alias_and_big_abstract_model_allocates_nothing():
    n = 2**28  # 1 GiB of float32, never allocated
    step = jax.jit(lambda p: p * 0.5, donate_argnums=0)
    r = jmem.measure(step, jax.ShapeDtypeStruct((n,), jnp.float32))
    assert r.argument_bytes == 4 * n and r.alias_bytes == 4 * n
    assert "GiB" in str(r)


def test_format_bytes():
    assert jmem._src.measure.format_bytes(1536) == "1.50 KiB"
    assert jmem._src.measure.format_bytes(12) == "12 B"


def test_report_from_a_compiled_executable_is_public():
    """``MemoryReport.from_compiled`` reads the executable that runs (no second compile) and
    gives what ``jmem.measure`` gives; ``MemoryReport.format_bytes`` is the report's units."""
    x = jax.ShapeDtypeStruct((1024,), jnp.float32)
    compiled = jax.jit(lambda a: a * 2).lower(x).compile()
    assert jmem.MemoryReport.from_compiled(compiled) == jmem.measure(lambda a: a * 2, x)
    assert jmem.MemoryReport.format_bytes(1536) == "1.50 KiB"
    assert jmem.MemoryReport.format_bytes(3 * 2**30) == "3.00 GiB"
