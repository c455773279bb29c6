"""XLA's own C++ log lines kept off the terminal (``jmem._src.native_logs``): lines written
to file descriptor 2 inside ``hidden()`` are dropped when they are glog/absl lines and
kept, in order, otherwise; ``show(True)`` (``--debug``) lets them through."""

import os
import subprocess
import sys
import textwrap

import pytest

from jmem._src import native_logs
from jmem._src import targets

XLA_LINES = (
    b"W1203 16:49:45.265767   25178 hlo_rematerialization.cc:3231] Can't reduce memory use\n",
    b"I0000 00:00:1796316584.955558   25178 cudart_stub.cc:31] Could not find cuda drivers\n",
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
)
OWN_LINES = (b"error: --seq-len must be positive\n", b"W is a letter: W1203 is not a log line\n")


def test_log_lines_are_recognised_and_others_are_not():
    assert all(native_logs.is_native_log_line(line) for line in XLA_LINES)
    assert not any(native_logs.is_native_log_line(line) for line in OWN_LINES)


@pytest.fixture
def shown_after():
    yield
    native_logs.show(False)


def test_hidden_drops_xla_lines_and_keeps_the_rest_in_order(capfd, shown_after):
    with native_logs.hidden():
        for own, xla in zip(OWN_LINES, XLA_LINES):
            os.write(2, xla)
            os.write(2, own)
        with native_logs.hidden():  # re-entrant: the inner block adds nothing
            os.write(2, XLA_LINES[2])
    err = capfd.readouterr().err.encode()
    assert err == b"".join(OWN_LINES)


def test_show_lets_them_through(capfd, shown_after):
    native_logs.show(True)
    with native_logs.hidden():
        os.write(2, XLA_LINES[0])
    assert capfd.readouterr().err.encode() == XLA_LINES[0]


def test_the_block_s_exception_propagates_with_stderr_restored(capfd, shown_after):
    with pytest.raises(KeyError), native_logs.hidden():
        os.write(2, b"kept\n")
        raise KeyError("x")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "kept\nafter\n"


_OVER_THE_CARD = """
import sys
import jax, jax.numpy as jnp, jmem
from jmem._src import native_logs
native_logs.show({show})
x = jax.ShapeDtypeStruct((25 * 2**30,), jnp.float32)  # 100 GiB in, 400 GiB live: past 80 GiB
f = lambda x: (jnp.sin(x), jnp.cos(x), jnp.exp(x), x.sum())
print("peak", jmem.measure(f, x, target="h100_sxm").peak_bytes // 2**30)
"""


@pytest.mark.gpu_compile
@pytest.mark.skipif(
    targets.unavailable_reason("h100_sxm") is not None, reason="no XLA:GPU compiler here"
)
@pytest.mark.parametrize("show", [False, True])
def test_an_over_the_card_compile_logs_nothing_unless_shown(show):
    code = textwrap.dedent(_OVER_THE_CARD.format(show=show))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "peak 400" in out.stdout
    assert ("hlo_rematerialization" in out.stderr) == show, out.stderr
