"""Test session setup: 8 simulated CPU devices for the sharding tests.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before any test
imports jax and touches a device.
"""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_collection_modifyitems(config, items):
    """``exhaustive`` tests (the rest of a grid whose claims other cells already test) are
    skipped unless the ``-m`` expression names them (``pytest -m exhaustive ...``)."""
    import pytest  # noqa: PLC0415

    if "exhaustive" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="the rest of the grid: run with -m exhaustive")
    for item in items:
        if "exhaustive" in item.keywords:
            item.add_marker(skip)
