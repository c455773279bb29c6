"""``jmem.host_huge_pages`` and ``jmem.retain_host_allocations``: host memory for XLA:CPU's
per-step temporaries.

The unit tests replace ``mallopt``, ``os.execve`` and the machine's facts so the test
process is left alone; the slow test runs the QLoRA step of the fine-tuning job in fresh
processes and counts the page faults per step with glibc's defaults and with huge pages
(the property that matters: XLA:CPU maps and faults in a step's temporaries again every
step, 4 KiB at a time, with glibc's defaults).
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
mode, remat = sys.argv[1], sys.argv[2]
if mode == "huge-pages":  # restarts this process with the tunable, once
    assert jmem.host_huge_pages(respect_env=False).applied
import jax.numpy as jnp
import numpy as np
from jmem import finetune
from jmem.models import llama
cfg = llama.get_config("tiny")
config = finetune.FinetuneConfig(steps=10, lr=1e-3, lora_rank=8, lora_alpha=16.0, remat=remat)
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
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages:")]
print(json.dumps({"faults": faults, "temp_pages": temp / 4096,
                  "anon_huge_kib": int(huge[0].split()[1]) if huge else 0}))
"""


def _faults(mode: str, remat: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    for name in (ha.ENV_VAR, "GLIBC_TUNABLES", ha._RESTARTED):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", _STEP, mode, remat], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(ha.huge_pages_unavailable() is not None, reason="no glibc huge pages here")
def test_qlora_step_faults_its_temporaries_in_huge_pages():
    """With glibc's defaults every step of the job's no-remat QLoRA step page-faults about
    its whole temp buffer in, 4 KiB at a time; with huge pages (the job's default on CPU),
    in under 3% as many faults (measured: 0.7%), and the process holds huge pages."""
    system, huge = _faults("system", "none"), _faults("huge-pages", "none")
    assert system["faults"] > 0.8 * system["temp_pages"], system
    assert huge["faults"] < 0.03 * huge["temp_pages"], huge
    assert huge["anon_huge_kib"] >= 2048, huge


def _no_huge_pages(monkeypatch, reason="transparent huge pages are off"):
    monkeypatch.setattr(ha, "huge_pages_unavailable", lambda: reason)


def _huge_pages_possible(monkeypatch, start_tunables=""):
    monkeypatch.setattr(ha, "huge_pages_unavailable", lambda: None)
    monkeypatch.setattr(ha, "_start_environ", lambda: {"GLIBC_TUNABLES": start_tunables})
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    monkeypatch.delenv(ha.ENV_VAR, raising=False)
    monkeypatch.delenv(ha._RESTARTED, raising=False)


class _Exec(Exception):
    pass


@pytest.fixture
def fake_execve(monkeypatch):
    calls = []

    def execve(path, argv, env):
        calls.append((path, argv, env))
        raise _Exec

    monkeypatch.setattr(ha.os, "execve", execve)
    return calls


def test_huge_pages_restart_the_process_once_with_the_tunable(monkeypatch, fake_execve):
    """Not in effect yet: the same command line is executed again with the tunable added
    to the environment's other tunables and a marker that stops a second restart."""
    _huge_pages_possible(monkeypatch)
    monkeypatch.setattr(ha.sys, "orig_argv", ["python3", "-m", "jmem", "finetune", "--steps", "3"])
    monkeypatch.setattr(ha.sys, "argv", ["/x/jmem/__main__.py", "finetune", "--steps", "3"])
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    with pytest.raises(_Exec):
        jmem.host_huge_pages()
    ((path, argv, env),) = fake_execve
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "jmem", "finetune", "--steps", "3"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert env[ha._RESTARTED] == "1"
    monkeypatch.setenv(ha._RESTARTED, "1")  # the restarted process, where it had no effect
    status = jmem.host_huge_pages()
    assert not status.applied and "no effect after a restart" in status.reason
    assert len(fake_execve) == 1


def test_huge_pages_in_effect_or_impossible_do_not_restart(monkeypatch, fake_execve):
    _huge_pages_possible(monkeypatch, start_tunables="glibc.malloc.hugetlb=1")
    assert jmem.host_huge_pages() == ha.HostAllocatorStatus(True)
    _huge_pages_possible(monkeypatch)
    status = jmem.host_huge_pages(restart=False)
    assert not status.applied and "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in status.reason
    monkeypatch.setattr(ha, "_backends_initialized", lambda: True)
    assert "JAX already started" in jmem.host_huge_pages().reason
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    monkeypatch.setattr(ha.sys, "argv", [""])  # python with no script: interactive
    assert "interactive" in jmem.host_huge_pages().reason
    monkeypatch.setenv(ha.ENV_VAR, "system")
    assert jmem.host_huge_pages().reason == "JMEM_HOST_ALLOCATOR=system"
    _no_huge_pages(monkeypatch)
    assert jmem.host_huge_pages(respect_env=False).reason == "transparent huge pages are off"
    assert fake_execve == []


def test_huge_pages_environ_adds_the_tunable_once():
    env = ha.huge_pages_environ({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert ha.huge_pages_environ(env) == env
    assert ha._has_tunable("glibc.malloc.hugetlb=2:glibc.malloc.tcache_count=0")
    assert not ha._has_tunable("glibc.malloc.hugetlb=0")


def test_huge_pages_need_glibc_2_35_and_transparent_huge_pages(monkeypatch, tmp_path):
    thp = tmp_path / "enabled"
    monkeypatch.setattr(ha, "_THP_ENABLED", str(thp))
    monkeypatch.setattr(ha, "_glibc_version", lambda: (2, 31))
    assert "2.35" in ha.huge_pages_unavailable()
    monkeypatch.setattr(ha, "_glibc_version", lambda: None)
    assert "not glibc" in ha.huge_pages_unavailable()
    monkeypatch.setattr(ha, "_glibc_version", lambda: (2, 36))
    assert "no transparent huge pages" in ha.huge_pages_unavailable()
    thp.write_text("always madvise [never]\n")
    assert "[never]" in ha.huge_pages_unavailable()
    thp.write_text("always [madvise] never\n")
    assert ha.huge_pages_unavailable() is None


@pytest.mark.parametrize(
    "choice,remat,machine,expected",
    [
        ("auto", "full", "huge", "huge-pages"),
        ("auto", "none", "huge", "huge-pages"),
        ("auto", "none", "no-huge", "retain"),
        ("auto", "full", "no-huge", None),
        ("auto", "none", "gpu", None),
        ("retain", "full", "huge", "retain"),
        ("huge-pages", "full", "huge", "huge-pages"),
        ("system", "none", "huge", None),
    ],
)
def test_job_host_allocator_choice(monkeypatch, choice, remat, machine, expected):
    """The job's ``--host-allocator``: ``auto`` is huge pages where glibc and the kernel
    have them (retain with ``--remat none`` where not; nothing with a GPU/TPU plugin); the
    command line may restart, a Python caller's run may not."""
    from jmem import finetune  # noqa: PLC0415
    from jmem._src.finetune import job  # noqa: PLC0415

    calls = []
    monkeypatch.setattr(ha, "_applied", False)
    monkeypatch.delenv(ha.ENV_VAR, raising=False)
    monkeypatch.setattr(job.jax_compat, "backends_initialized", lambda: False)
    monkeypatch.setattr(
        job, "_accelerator_plugin", lambda: "jax-cuda12-plugin" if machine == "gpu" else None
    )
    monkeypatch.setattr(
        ha, "huge_pages_unavailable", lambda: None if machine != "no-huge" else "off"
    )
    monkeypatch.setattr(
        ha,
        "retain_host_allocations",
        lambda: calls.append(("retain",)) or ha.HostAllocatorStatus(True),
    )
    monkeypatch.setattr(
        ha,
        "host_huge_pages",
        lambda **kw: calls.append(("huge-pages", kw["restart"])) or ha.HostAllocatorStatus(True),
    )
    config = finetune.FinetuneConfig(host_allocator=choice, remat=remat)
    note = job._host_allocator(config, restart=True)
    assert [c[0] for c in calls] == ([expected] if expected else [])
    if expected == "huge-pages":
        assert calls[0][1] is True and "huge pages" in note


def test_accelerator_plugin_follows_jax_platforms(monkeypatch):
    from jmem._src.finetune import job  # noqa: PLC0415

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert job._accelerator_plugin() is None
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert job._accelerator_plugin() == "cuda,cpu"
