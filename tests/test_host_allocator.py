"""``jmem.retain_host_allocations``: glibc settings that keep freed host memory mapped.

The unit tests replace ``mallopt`` so the test process's allocator is left alone; the
slow test runs the QLoRA step of the fine-tuning job in two fresh processes and counts the
page faults per step with and without the settings (the property that matters: XLA:CPU
maps and faults in a step's temporaries again every step with glibc's defaults).
"""

import json
import os
import subprocess
import sys
import warnings

import pytest

import jmem
from jmem._src import host_allocator as ha

GLIBC = sys.platform == "linux" and __import__("platform").libc_ver()[0] == "glibc"


class _FakeLibc:
    def __init__(self, answer=1):
        self.calls, self.answer = [], answer

    @property
    def mallopt(self):
        fake = self

        class _Fn:
            argtypes = restype = None

            def __call__(self, param, value):
                fake.calls.append((param, value))
                return fake.answer

        return _Fn()


@pytest.fixture
def fake_libc(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(ha.ctypes, "CDLL", lambda _: libc)
    monkeypatch.setattr(ha, "_applied", False)
    monkeypatch.delenv(ha.ENV_VAR, raising=False)
    return libc


@pytest.mark.skipif(not GLIBC, reason="glibc only (the settings are glibc's mallopt)")
def test_sets_one_arena_no_mmap_no_trim_once(fake_libc, monkeypatch):
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    status = jmem.retain_host_allocations()
    assert status == ha.HostAllocatorStatus(True)
    assert fake_libc.calls == [(-8, 1), (-4, 0), (-1, 2**31 - 1)]
    assert ha.retained()
    assert jmem.retain_host_allocations().applied and len(fake_libc.calls) == 3  # once


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_warns_when_jax_already_started(fake_libc):
    import jax  # noqa: PLC0415

    jax.devices()  # the backends exist in this process
    with pytest.warns(RuntimeWarning, match="before the first JAX computation"):
        assert jmem.retain_host_allocations().applied


def test_opt_out_and_other_c_libraries_change_nothing(fake_libc, monkeypatch):
    monkeypatch.setenv(ha.ENV_VAR, "system")
    status = jmem.retain_host_allocations()
    assert not status.applied and "JMEM_HOST_ALLOCATOR=system" in status.reason
    monkeypatch.setattr(ha.sys, "platform", "darwin")
    status = jmem.retain_host_allocations(respect_env=False)
    assert not status.applied and "not glibc" in status.reason
    assert fake_libc.calls == [] and not ha.retained()


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_refused_setting_is_reported(fake_libc, monkeypatch):
    fake_libc.answer = 0
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = jmem.retain_host_allocations()
    assert not status.applied and "refused" in status.reason and not ha.retained()


_STEP = """
import json, resource, sys
import jmem
if sys.argv[1] == "retain":
    assert jmem.retain_host_allocations(respect_env=False).applied
import jax.numpy as jnp
import numpy as np
from jmem import finetune
from jmem.models import llama
cfg = llama.get_config("tiny")
config = finetune.FinetuneConfig(steps=10, lr=1e-3, lora_rank=8, lora_alpha=16.0, remat=sys.argv[2])
step, *_ = finetune.build(config, cfg, compute_dtype=jnp.float32)
state = finetune.init_state(config, cfg, step, jnp.float32, None, None)[0]
tok = np.random.default_rng(0).integers(0, cfg.vocab_size, (16, 129), np.int32)
batch = {"inputs": jnp.asarray(tok[:, :-1]), "targets": jnp.asarray(tok[:, 1:])}
compiled = step.jitted.lower(state, batch).compile()
for _ in range(3):
    state, m = compiled(state, batch); float(m["loss"])
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    state, m = compiled(state, batch); float(m["loss"])
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 4
temp = compiled.memory_analysis().temp_size_in_bytes
print(json.dumps({"faults": faults, "temp_pages": temp / 4096}))
"""


def _faults(mode: str, remat: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    env.pop(ha.ENV_VAR, None)
    out = subprocess.run(
        [sys.executable, "-c", _STEP, mode, remat], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_qlora_step_stops_faulting_its_temporaries_in():
    """With glibc's defaults every step of the job's no-remat QLoRA step (where the job
    applies the settings) page-faults about its whole temp buffer in; with them, under a
    quarter of it (measured: 12%; 0 with ``remat="full"``)."""
    system, retain = _faults("system", "none"), _faults("retain", "none")
    assert system["faults"] > 0.8 * system["temp_pages"], system
    assert retain["faults"] < 0.25 * retain["temp_pages"], retain


@pytest.mark.parametrize(
    "choice,remat,applies",
    [
        ("auto", "none", True),
        ("auto", "full", False),
        ("retain", "full", True),
        ("system", "none", False),
    ],
)
def test_job_applies_it_for_retain_and_for_auto_without_remat(monkeypatch, choice, remat, applies):
    """The job's ``--host-allocator``: ``auto`` retains only with ``--remat none`` (its
    temporaries are largest there); the call happens before JAX starts."""
    from jmem import finetune  # noqa: PLC0415
    from jmem._src.finetune import job  # noqa: PLC0415

    calls = []
    monkeypatch.setattr(ha, "_applied", False)
    monkeypatch.setattr(job.jax_compat, "backends_initialized", lambda: False)
    monkeypatch.setattr(
        ha, "retain_host_allocations", lambda: calls.append(1) or ha.HostAllocatorStatus(True)
    )
    config = finetune.FinetuneConfig(host_allocator=choice, remat=remat)
    assert job._host_allocator(config) is None
    assert bool(calls) == applies
