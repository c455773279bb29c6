"""FSDP / ZeRO placement of a train state over a ``jax.sharding.Mesh``."""

from jmem._src.sharding import CONTEXT_AXIS
from jmem._src.sharding import DATA_AXIS
from jmem._src.sharding import EXPERT_AXIS
from jmem._src.sharding import FSDP_AXIS
from jmem._src.sharding import STRATEGIES
from jmem._src.sharding import array_spec
from jmem._src.sharding import batch_axes
from jmem._src.sharding import batch_sharding
from jmem._src.sharding import constrain_gradients
from jmem._src.sharding import gradient_shardings
from jmem._src.sharding import make_mesh
from jmem._src.sharding import opt_state_shardings
from jmem._src.sharding import param_shardings
from jmem._src.sharding import shard_batch
from jmem._src.sharding import shard_state
from jmem._src.sharding import state_shardings

__all__ = (
    "CONTEXT_AXIS",
    "DATA_AXIS",
    "EXPERT_AXIS",
    "FSDP_AXIS",
    "STRATEGIES",
    "array_spec",
    "batch_axes",
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
