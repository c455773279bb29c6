"""One process of the 2-process test in tests/test_sharding.py (not a test module itself).

Usage: ``python tests/_multihost_worker.py PORT PROCESS_ID OUT_JSON``. Each process gets 2
simulated CPU devices; ``jax.distributed`` joins them into one 4-device mesh (fsdp=4) with
the gloo CPU collectives. Both processes run the same sharded ``jmem.train_step`` (ZeRO-3,
Adam) on the same global batch, then compare against a single-device step computed
locally, and write what they saw to OUT_JSON.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

port, pid, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=pid,
    initialization_timeout=60,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jmem import sharding  # noqa: E402
from jmem import train_step  # noqa: E402


def mlp(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


rng = np.random.default_rng(0)  # identical host values on both processes
params = {
    "w1": (0.1 * rng.standard_normal((64, 128))).astype(np.float32),
    "b1": np.zeros((128,), np.float32),
    "w2": (0.1 * rng.standard_normal((128, 64))).astype(np.float32),
}
batches = [
    {
        "x": rng.standard_normal((8, 64)).astype(np.float32),
        "y": rng.standard_normal((8, 64)).astype(np.float32),
    }
    for _ in range(2)
]

mesh = sharding.make_mesh(data=1, fsdp=jax.device_count())
step = train_step(mlp, optax.adam(1e-2), mesh=mesh, strategy="zero3")
state = step.init(params)
losses = []
for b in batches:
    state, m = step(state, sharding.shard_batch(b, mesh))
    losses.append(float(m["loss"]))  # replicated: readable on every process
got = multihost_utils.process_allgather(state.params, tiled=True)

# Reference: the unsharded step on this process's first local device.
dev = jax.local_devices()[0]
ref = train_step(mlp, optax.adam(1e-2))
rstate = ref.init(jax.device_put(params, dev))
ref_losses = []
for b in batches:
    rstate, m = ref(rstate, jax.device_put(b, dev))
    ref_losses.append(float(m["loss"]))
diff = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(r))))
    for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(rstate.params))
)

with open(out_path, "w") as f:
    json.dump(
        {
            "process_id": jax.process_index(),
            "process_count": jax.process_count(),
            "global_devices": jax.device_count(),
            "local_devices": jax.local_device_count(),
            "losses": losses,
            "ref_losses": ref_losses,
            "max_param_diff": diff,
            "w1_spec": str(state.params["w1"].sharding.spec),
        },
        f,
    )
jax.distributed.shutdown()
