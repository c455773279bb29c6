"""Test session setup: 8 simulated CPU devices for the sharding tests, and one persistent
XLA compilation cache for the whole test run.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before any test
imports jax and touches a device.

The cache: many tests compile the same programs again, above all the job runs in
subprocesses (a run, its kill, its resume, the reference run: the same train step each
time). JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``, inherited by the
subprocesses) turns the repeats into loads: 42% less CPU time on the example tests' job
runs. Each run gets a fresh directory (shared by its xdist workers, removed at the end), so
no test reads an executable compiled by an earlier version of the code; a cached
executable keeps its ``memory_analysis()``. Not used for ``-m gpu_compile`` runs, when
``JAX_COMPILATION_CACHE_DIR`` is already set (that one is used), or with
``JMEM_TEST_XLA_CACHE=0``.
"""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _cache_dir(config) -> str:
    """This test run's cache directory: one per run, the same in its xdist workers."""
    import tempfile  # noqa: PLC0415

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or getattr(config, "_jmem_run", None)
    if run is None:
        run = config._jmem_run = f"{os.getpid()}-{os.urandom(4).hex()}"
    return os.path.join(tempfile.gettempdir(), f"jmem-tests-xla-cache-{run}")


def pytest_configure(config):
    """Turns on JAX's persistent compilation cache for this run (module docstring)."""
    if os.environ.get("JMEM_TEST_XLA_CACHE", "1") == "0":
        return
    if "gpu_compile" in (config.getoption("markexpr") or ""):
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir(config)
        config._jmem_cache_owner = not hasattr(config, "workerinput")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_unconfigure(config):
    """Removes the run's cache directory (the controlling process, at the very end)."""
    if getattr(config, "_jmem_cache_owner", False):
        import shutil  # noqa: PLC0415

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


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
