"""One process of the 2-process fine-tuning test in tests/test_finetune.py (not a test
module itself).

Usage: ``python tests/_finetune_worker.py ARGS...``: ``jmem finetune ARGS`` with 2
simulated CPU devices in this process; the test passes ``--coordinator``,
``--num-processes 2`` and ``--process-id`` so that ``jax.distributed`` joins the two
processes into one 4-device mesh (gloo CPU collectives).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

from jmem import finetune  # noqa: E402

if __name__ == "__main__":
    finetune.main(sys.argv[1:])
