"""FSDP / ZeRO placement of a train state over a ``jax.sharding.Mesh``."""

from jmem._src.sharding import (
    DATA_AXIS,
    FSDP_AXIS,
    STRATEGIES,
    array_spec,
    batch_sharding,
    constrain_gradients,
    gradient_shardings,
    make_mesh,
    opt_state_shardings,
    param_shardings,
    shard_batch,
    shard_state,
    state_shardings,
)

__all__ = (
    "DATA_AXIS",
    "FSDP_AXIS",
    "STRATEGIES",
    "array_spec",
    "batch_sharding",
    "constrain_gradients",
    "gradient_shardings",
    "make_mesh",
    "opt_state_shardings",
    "param_shardings",
    "shard_batch",
    "shard_state",
    "state_shardings",
)
