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
from jmem._src.finetune.build import build
from jmem._src.finetune.loop import init_state
from jmem.models import llama
cfg = llama.get_config("tiny")
config = finetune.FinetuneConfig.from_flat(steps=10, lr=1e-3, lora_rank=8, lora_alpha=16.0, remat=remat)
step, *_ = build(config, cfg, compute_dtype=jnp.float32)
state = init_state(config, cfg, step, jnp.float32, None, None)[0]
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
@pytest.mark.skipif(
    ha.huge_pages_unavailable() is not None or ha._thp_mode() != "madvise",
    reason="needs glibc 2.35+ and transparent huge pages in madvise mode (in always mode "
    "glibc's defaults get huge pages too)",
)
def test_qlora_step_faults_its_temporaries_in_huge_pages():
    """With glibc's defaults every step of the job's no-remat QLoRA step page-faults about
    its whole temp buffer in, 4 KiB at a time; with huge pages (the job's default on CPU),
    in under 3% as many faults (measured: 0.7%), and the process holds huge pages."""
    system, huge = _faults("system", "none"), _faults("huge-pages", "none")
    assert system["faults"] > 0.8 * system["temp_pages"], system
    assert huge["faults"] < 0.03 * huge["temp_pages"], huge
    assert huge["anon_huge_kib"] >= 2048, huge


def _huge_pages_possible(monkeypatch, start_tunables="", mode="madvise"):
    """A machine where huge pages work, in a process that started with ``start_tunables``
    and that a restart would not harm (this one is pytest's: the hazard check is faked)."""
    monkeypatch.setattr(ha, "huge_pages_unavailable", lambda: None)
    monkeypatch.setattr(ha, "_thp_mode", lambda: mode)
    monkeypatch.setattr(ha, "_start_environ", lambda: {"GLIBC_TUNABLES": start_tunables})
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    monkeypatch.setattr(ha, "_restart_hazard", lambda: None)
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
    to the environment's other tunables and a marker (this process id) that stops a
    second restart and that child processes (other ids) do not take as theirs."""
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
    assert env[ha._RESTARTED] == str(os.getpid())
    monkeypatch.setenv(ha._RESTARTED, str(os.getpid() + 1))  # a child of a restarted one
    assert not ha.restarted()
    monkeypatch.setenv(ha._RESTARTED, str(os.getpid()))  # restarted, to no effect
    with pytest.warns(RuntimeWarning, match="no effect after a restart"):
        status = jmem.host_huge_pages()
    assert not status.applied and "no effect after a restart" in status.reason
    assert len(fake_execve) == 1


def test_huge_pages_in_effect_or_impossible_do_not_restart(monkeypatch, fake_execve):
    _huge_pages_possible(monkeypatch, start_tunables="glibc.malloc.hugetlb=1")
    assert jmem.host_huge_pages() == ha.HostAllocatorStatus(True)
    _huge_pages_possible(monkeypatch, mode="always")  # the kernel needs no tunable
    assert jmem.host_huge_pages() == ha.HostAllocatorStatus(True)
    _huge_pages_possible(monkeypatch, start_tunables="glibc.malloc.hugetlb=0")  # the user's
    assert "hugetlb=0: left as set" in jmem.host_huge_pages().reason
    _huge_pages_possible(monkeypatch)
    status = jmem.host_huge_pages(restart=False)
    assert not status.applied and "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in status.reason
    monkeypatch.setattr(ha, "_backends_initialized", lambda: True)
    with pytest.warns(RuntimeWarning, match="changed nothing: JAX already started"):
        assert "JAX already started" in jmem.host_huge_pages().reason
    assert "JAX already started" in jmem.host_huge_pages(restart=False).reason  # the cause
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    monkeypatch.setattr(ha, "_restart_hazard", lambda: "3 other threads are running")
    with pytest.warns(RuntimeWarning, match="3 other threads"):
        assert "unsafe here (3 other threads are running)" in jmem.host_huge_pages().reason
    monkeypatch.setattr(ha.sys, "argv", ["-"])  # python - < script.py
    assert "standard input" in jmem.host_huge_pages(announce=False).reason
    monkeypatch.setattr(ha.sys, "argv", [""])  # python with no script: interactive
    assert "interactive" in jmem.host_huge_pages(announce=False).reason
    monkeypatch.setenv(ha.ENV_VAR, "System")
    assert jmem.host_huge_pages().reason == "JMEM_HOST_ALLOCATOR=system"
    monkeypatch.setattr(ha, "huge_pages_unavailable", lambda: "transparent huge pages are off")
    assert jmem.host_huge_pages(respect_env=False).reason == "transparent huge pages are off"
    assert fake_execve == []


def test_pytest_itself_is_never_restarted():
    """The real hazard check, in this (pytest's) process."""
    assert ha._restart_hazard() == "pytest is running this process"


def test_a_failed_restart_is_reported_not_raised(monkeypatch):
    _huge_pages_possible(monkeypatch)
    monkeypatch.setattr(ha.sys, "argv", ["train.py"])

    def execve(*_):
        raise OSError(7, "Argument list too long")

    monkeypatch.setattr(ha.os, "execve", execve)
    status = jmem.host_huge_pages(announce=False)
    assert not status.applied and "restart failed" in status.reason


def test_tunables_are_read_as_glibc_applies_them():
    """The last ``glibc.malloc.hugetlb`` wins; a value the user set is kept."""
    env = ha.huge_pages_environ({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert ha.huge_pages_environ(env) == env
    user = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert ha.huge_pages_environ(user) == user
    assert ha._hugetlb_value("glibc.malloc.hugetlb=1:glibc.malloc.hugetlb=0") == "0"
    assert ha._hugetlb_value("glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=2") == "2"
    assert ha._hugetlb_value("glibc.malloc.arena_max=2") is None


def test_huge_pages_need_glibc_2_35_and_transparent_huge_pages(monkeypatch, tmp_path):
    thp = tmp_path / "enabled"
    monkeypatch.setattr(ha, "_THP_ENABLED", str(thp))
    monkeypatch.setattr(ha.os, "confstr", lambda _: "glibc 2.31", raising=False)
    assert "2.35" in ha.huge_pages_unavailable()
    monkeypatch.setattr(ha.os, "confstr", lambda _: "musl 1.2", raising=False)
    assert "not glibc" in ha.huge_pages_unavailable()
    monkeypatch.setattr(ha.os, "confstr", lambda _: "glibc 2.39.9000", raising=False)
    assert "no transparent huge pages" in ha.huge_pages_unavailable()
    thp.write_text("always madvise [never]\n")
    assert "[never]" in ha.huge_pages_unavailable()
    thp.write_text("always [madvise] never\n")
    assert ha.huge_pages_unavailable() is None and ha._thp_mode() == "madvise"
    thp.write_text("[always] madvise never\n")
    assert ha._thp_mode() == "always"


def _fake_allocators(monkeypatch, huge_pages_apply: bool):
    calls = []
    monkeypatch.setattr(ha, "_applied", False)
    monkeypatch.delenv(ha.ENV_VAR, raising=False)
    monkeypatch.setattr(
        ha,
        "retain_host_allocations",
        lambda **kw: calls.append(("retain",)) or ha.HostAllocatorStatus(True),
    )

    def huge(**kw):
        assert kw["respect_env"] is False  # the job decides the opt-out itself
        calls.append(("huge-pages", kw["restart"]))
        return ha.HostAllocatorStatus(huge_pages_apply, "" if huge_pages_apply else "refused")

    monkeypatch.setattr(ha, "host_huge_pages", huge)
    return calls


@pytest.mark.parametrize(
    "choice,remat,machine,expected",
    [
        ("auto", "full", "huge", ["huge-pages"]),
        ("auto", "none", "huge", ["huge-pages"]),
        ("auto", "none", "refused", ["huge-pages", "retain"]),  # e.g. finetune.run()
        ("auto", "full", "refused", ["huge-pages"]),
        ("auto", "none", "gpu", []),
        ("retain", "full", "huge", ["retain"]),
        ("huge-pages", "none", "refused", ["huge-pages"]),
        ("system", "none", "huge", []),
    ],
)
def test_job_host_allocator_choice(monkeypatch, choice, remat, machine, expected):
    """The job's ``--host-allocator``: ``auto`` is huge pages without a GPU/TPU plugin,
    retaining as the fallback with ``--remat none`` when huge pages are refused."""
    from jmem import finetune  # noqa: PLC0415
    from jmem._src.finetune import job  # noqa: PLC0415

    calls = _fake_allocators(monkeypatch, huge_pages_apply=machine == "huge")
    monkeypatch.setattr(ha, "huge_pages_active", lambda: False)  # none inherited
    monkeypatch.setattr(job.jax_compat, "backends_initialized", lambda: False)
    plugin = "jax-cuda12-plugin" if machine == "gpu" else None
    monkeypatch.setattr(job, "_accelerator_plugin", lambda: plugin)
    config = finetune.FinetuneConfig.from_flat(host_allocator=choice, remat=remat)
    note = job._host_allocator(config, restart=True)
    assert [c[0] for c in calls] == expected
    assert all(c[1] is True for c in calls if c[0] == "huge-pages")
    if machine == "gpu":
        assert note.startswith(job.PLUGIN_NOTE) and "jax-cuda12-plugin" in note
    if expected == ["huge-pages", "retain"]:
        assert "no huge pages (refused); freed memory retained" == note.split(": ", 1)[1]
    if machine == "huge" and expected == ["huge-pages"]:
        assert "2 MiB huge pages" in note and "--host-allocator system to skip" in note
    if choice == "system":
        assert note == "host allocator: glibc's defaults (--host-allocator system)"
        monkeypatch.setattr(ha, "huge_pages_active", lambda: True)  # GLIBC_TUNABLES inherited
        assert "huge pages all the same" in job._host_allocator(config, restart=True)
    if config.run.host_allocator != "system":
        dry = finetune.FinetuneConfig.from_flat(host_allocator=choice, remat=remat, dry_run=True)
        n = len(calls)
        assert job._host_allocator(dry, restart=True) is None and len(calls) == n


def test_only_the_jobs_own_command_line_restarts(monkeypatch, fake_execve):
    """``finetune.main(argv)``, ``python -m jmem``'s ``main(argv)`` and ``finetune.run``
    never restart the process; ``main()`` with the process's command line does."""
    import jmem.__main__ as cli_main  # noqa: PLC0415
    from jmem import finetune  # noqa: PLC0415
    from jmem._src.finetune import job  # noqa: PLC0415

    _huge_pages_possible(monkeypatch)
    monkeypatch.setattr(job, "_accelerator_plugin", lambda: None)
    monkeypatch.setattr(job, "initialize_distributed", lambda config: None)
    monkeypatch.setattr(job, "_run", lambda config, note: "ran")
    assert finetune.main(["--steps", "1"]) == "ran"
    assert cli_main.main(["finetune", "--steps", "1"]) == 0
    assert fake_execve == []
    monkeypatch.setattr(ha.sys, "argv", ["qlora_7b.py", "--steps", "1"])
    monkeypatch.setattr(ha.sys, "orig_argv", ["python", "qlora_7b.py", "--steps", "1"])
    with pytest.raises(_Exec):
        finetune.main()
    assert fake_execve[0][1][1:] == ["qlora_7b.py", "--steps", "1"]


def test_accelerator_plugin_follows_jax_platforms(monkeypatch):
    import importlib.metadata  # noqa: PLC0415

    from jmem._src.finetune import job  # noqa: PLC0415

    class _Dist:
        def __init__(self, name):
            self.name = name

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert job._accelerator_plugin() is None
    monkeypatch.setenv("JAX_PLATFORMS", "cpu,cuda")
    assert job._accelerator_plugin() is None
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert job._accelerator_plugin() == "cuda,cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "")
    dists = [_Dist("numpy"), _Dist("jax_cuda12_plugin")]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: dists)
    assert job._accelerator_plugin() == "jax-cuda12-plugin"
    dists[1] = _Dist("jax")
    assert job._accelerator_plugin() is None


def test_the_opt_out_turns_auto_off_but_not_an_explicit_choice(monkeypatch):
    """``JMEM_HOST_ALLOCATOR=system`` leaves glibc's defaults for ``auto`` (saying so); a
    flag that names an allocator still gets it."""
    from jmem import finetune  # noqa: PLC0415
    from jmem._src.finetune import job  # noqa: PLC0415

    calls = _fake_allocators(monkeypatch, huge_pages_apply=True)
    monkeypatch.setenv(ha.ENV_VAR, "system")
    monkeypatch.setattr(ha, "huge_pages_active", lambda: False)
    note = job._host_allocator(
        finetune.FinetuneConfig.from_flat(host_allocator="auto"), restart=True
    )
    assert note == "host allocator: glibc's defaults (JMEM_HOST_ALLOCATOR=system)"
    assert calls == []
    note = job._host_allocator(
        finetune.FinetuneConfig.from_flat(host_allocator="huge-pages"), restart=True
    )
    assert calls == [("huge-pages", True)] and "huge pages" in note


def test_a_refused_restart_keeps_its_reason_in_the_fallback_note(monkeypatch):
    """From Python after JAX started (no restart, no retaining): the note says both why and
    what to call first."""
    from jmem import finetune  # noqa: PLC0415
    from jmem._src.finetune import job  # noqa: PLC0415

    _huge_pages_possible(monkeypatch)
    monkeypatch.setattr(ha, "_applied", False)
    monkeypatch.setattr(job, "_accelerator_plugin", lambda: None)
    monkeypatch.setattr(ha, "_backends_initialized", lambda: True)
    monkeypatch.setattr(job.jax_compat, "backends_initialized", lambda: True)
    note = job._host_allocator(finetune.FinetuneConfig.from_flat(remat="none"))
    assert note.startswith("host allocator: no huge pages (JAX already started")
    assert "freed memory not retained either" in note and "jmem.host_huge_pages()" in note
