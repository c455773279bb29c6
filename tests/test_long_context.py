"""Long-context pieces of the reference model: the remat ``offload`` policy sends each
layer's input to host memory."""

import contextlib
import io

import jax
import jax.numpy as jnp

import jmem
from jmem.models import llama


def _saved_residuals(policy: str) -> str:
    cfg = llama.get_config("tiny", num_layers=2)
    params = llama.init(jax.random.key(0), cfg)
    batch = {k: jnp.zeros((1, 64), jnp.int32) for k in ("inputs", "targets")}
    f = jmem.remat(lambda p, b: llama.loss_fn(p, b, cfg), policy)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, params, batch)
    return out.getvalue()


def test_offload_policy_moves_layer_inputs_to_host():
    """Under ``full`` the stacked layer inputs ``[L, B, S, H]`` stay on the device; under
    ``offload`` they are saved in ``pinned_host`` (shown as ``f32<host>``)."""
    stacked = "[2,1,64,256]"
    full, offload = _saved_residuals("full"), _saved_residuals("offload")
    assert f"f32{stacked}" in full and f"f32<host>{stacked}" not in full
    assert f"f32<host>{stacked}" in offload and f"f32{stacked}" not in offload
