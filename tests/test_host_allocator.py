"""``jmem.host``: host memory for XLA:CPU's per-step temporaries (huge pages, or glibc
keeping freed memory), the fine-tuning job's launcher, and that the library itself never
changes its caller's process.

The unit tests replace ``mallopt``, ``os.execve`` and the machine's facts so the test
process is left alone; the slow tests run the QLoRA step of the fine-tuning job in fresh
processes and count the page faults per step with glibc's defaults and with huge pages
(the property that matters: XLA:CPU maps and faults in a step's temporaries again every
step, 4 KiB at a time, with glibc's defaults), and run the command line end to end.
"""

import ctypes
import json
import os
import pathlib
import runpy
import subprocess
import sys
import warnings

import pytest

import jmem
from jmem import finetune
from jmem._src import host_allocator as ha
from jmem._src.cli import CliError
from jmem._src.finetune import job
from jmem._src.finetune import launcher
from jmem._src.finetune.config_file import parse_args

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
    status = jmem.host.retain_host_allocations()
    assert status == ha.HostAllocatorStatus(True)
    assert fake_libc.calls == [(-8, 1), (-4, 0), (-1, 2**31 - 1)]
    assert ha.retained()
    assert jmem.host.retain_host_allocations().applied and len(fake_libc.calls) == 3  # once


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_warns_when_jax_already_started(fake_libc):
    import jax  # noqa: PLC0415

    jax.devices()  # the backends exist in this process
    with pytest.warns(RuntimeWarning, match="before the first JAX computation"):
        assert jmem.host.retain_host_allocations().applied


def test_opt_out_and_other_c_libraries_change_nothing(fake_libc, monkeypatch):
    monkeypatch.setenv(ha.ENV_VAR, "system")
    status = jmem.host.retain_host_allocations()
    assert not status.applied and "JMEM_HOST_ALLOCATOR=system" in status.reason
    monkeypatch.setattr(ha.sys, "platform", "darwin")
    status = jmem.host.retain_host_allocations(respect_env=False)
    assert not status.applied and "not glibc" in status.reason
    assert fake_libc.calls == [] and not ha.retained()


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_refused_setting_is_reported(fake_libc, monkeypatch):
    fake_libc.answer = 0
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = jmem.host.retain_host_allocations()
    assert not status.applied and "refused" in status.reason and not ha.retained()


_STEP = """
import json, resource, sys
import jmem
mode, remat = sys.argv[1], sys.argv[2]
if mode == "huge-pages":  # restarts this process with the tunable, once
    assert jmem.host.restart_with_huge_pages(respect_env=False).applied
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
    monkeypatch.setattr(ha, "_start_tunables", lambda: start_tunables)
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
        jmem.host.restart_with_huge_pages()
    ((path, argv, env),) = fake_execve
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "jmem", "finetune", "--steps", "3"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert env[ha._RESTARTED] == str(os.getpid())
    monkeypatch.setenv(ha._RESTARTED, str(os.getpid() + 1))  # a child of a restarted one
    assert not ha.restarted()
    monkeypatch.setenv(ha._RESTARTED, str(os.getpid()))  # restarted, to no effect
    with pytest.warns(RuntimeWarning, match="no effect after a restart"):
        status = jmem.host.restart_with_huge_pages()
    assert not status.applied and "no effect after a restart" in status.reason
    assert len(fake_execve) == 1


def test_huge_pages_in_effect_or_impossible_do_not_restart(monkeypatch, fake_execve):
    restart = jmem.host.restart_with_huge_pages
    _huge_pages_possible(monkeypatch, start_tunables="glibc.malloc.hugetlb=1")
    assert restart() == ha.HostAllocatorStatus(True)
    _huge_pages_possible(monkeypatch, mode="always")  # the kernel needs no tunable
    assert restart() == ha.HostAllocatorStatus(True)
    _huge_pages_possible(monkeypatch, start_tunables="glibc.malloc.hugetlb=0")  # the user's
    assert "hugetlb=0: left as set" in restart().reason
    _huge_pages_possible(monkeypatch)
    status = restart(restart=False)
    assert not status.applied and "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in status.reason
    monkeypatch.setattr(ha, "_backends_initialized", lambda: True)
    with pytest.warns(RuntimeWarning, match="changed nothing: JAX already started"):
        assert "JAX already started" in restart().reason
    assert "JAX already started" in restart(restart=False).reason  # the cause
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    monkeypatch.setattr(ha, "_restart_hazard", lambda: "3 other threads are running")
    with pytest.warns(RuntimeWarning, match="3 other threads"):
        assert "unsafe here (3 other threads are running)" in restart().reason
    monkeypatch.setattr(ha.sys, "argv", ["-"])  # python - < script.py
    assert "standard input" in restart(announce=False).reason
    monkeypatch.setattr(ha.sys, "argv", [""])  # python with no script: interactive
    assert "interactive" in restart(announce=False).reason
    monkeypatch.setenv(ha.ENV_VAR, "System")
    assert restart().reason == "JMEM_HOST_ALLOCATOR=system"
    monkeypatch.setattr(ha, "huge_pages_unavailable", lambda: "transparent huge pages are off")
    assert restart(respect_env=False).reason == "transparent huge pages are off"
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
    status = jmem.host.restart_with_huge_pages(announce=False)
    assert not status.applied and "restart failed" in status.reason


def test_tunables_are_read_as_glibc_applies_them():
    """The last ``glibc.malloc.hugetlb`` wins; a value the user set is kept."""
    env = jmem.host.huge_pages_environ({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert jmem.host.huge_pages_environ(env) == env
    user = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert jmem.host.huge_pages_environ(user) == user
    assert ha._hugetlb_value("glibc.malloc.hugetlb=1:glibc.malloc.hugetlb=0") == "0"
    assert ha._hugetlb_value("glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=2") == "2"
    assert ha._hugetlb_value("glibc.malloc.arena_max=2") is None


def test_the_environ_block_glibc_rewrote_is_read_back(monkeypatch, tmp_path):
    """glibc 2.36 writes a NUL over each ``:`` of ``GLIBC_TUNABLES`` after a tunable it
    knows, in the process's own environment block: ``a=2:glibc.malloc.hugetlb=1`` then
    reads back as two entries, and huge pages are in effect all the same."""
    blob = b"PATH=/bin\0GLIBC_TUNABLES=glibc.malloc.arena_max=2\0glibc.malloc.hugetlb=1\0HOME=/\0"
    tunables = ha._environ_tunables(blob)
    assert tunables == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    two = (
        b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1\0X=1\0GLIBC_TUNABLES=x.y=1:glibc.malloc.hugetlb=0\0"
    )
    assert ha._hugetlb_value(ha._environ_tunables(two)) == "0"  # applied in order: last wins
    assert ha._environ_tunables(b"PATH=/bin\0glibc.malloc.hugetlb=1\0") == ""  # not a tunable
    environ = tmp_path / "environ"
    environ.write_bytes(blob)
    monkeypatch.setattr(ha, "_ENVIRON", str(environ))
    monkeypatch.setattr(ha, "huge_pages_unavailable", lambda: None)
    monkeypatch.setattr(ha, "_thp_mode", lambda: "madvise")
    assert jmem.host.huge_pages_active()
    environ.write_bytes(blob.replace(b"hugetlb=1", b"hugetlb=0"))
    assert not jmem.host.huge_pages_active()


@pytest.mark.skipif(
    ha.huge_pages_unavailable() is not None or ha._thp_mode() != "madvise",
    reason="needs glibc 2.35+ and transparent huge pages in madvise mode",
)
def test_a_fresh_process_with_two_tunables_reports_huge_pages():
    """The real environment block of a process started with two tunables (the module is
    loaded on its own: it needs no JAX)."""
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('ha', sys.argv[1])\n"
        "ha = sys.modules['ha'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(ha)\n"
        "print(ha.huge_pages_active())\n"
    )
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    out = subprocess.run(
        [sys.executable, "-c", code, ha.__file__], capture_output=True, text=True, env=env
    )
    assert out.stdout.strip() == "True", out.stderr[-2000:]


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


def test_a_bad_opt_out_value_is_refused_naming_the_values(fake_libc, monkeypatch, capsys):
    """``JMEM_HOST_ALLOCATOR`` is ``auto`` or ``system`` (any case, or unset); anything else
    is a one-line error, from the library and from the job's command line alike."""
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    for value, out in (("", False), ("auto", False), (" System ", True)):
        monkeypatch.setenv(ha.ENV_VAR, value)
        assert jmem.host.env_opts_out() is out
    monkeypatch.setenv(ha.ENV_VAR, "garbage")
    with pytest.raises(ValueError, match=r"JMEM_HOST_ALLOCATOR='garbage' is not one of auto, sys"):
        jmem.host.env_opts_out()
    with pytest.raises(ValueError, match="JMEM_HOST_ALLOCATOR"):
        jmem.host.retain_host_allocations()
    with pytest.raises(ValueError, match="JMEM_HOST_ALLOCATOR"):
        jmem.host.restart_with_huge_pages()
    assert fake_libc.calls == []
    with pytest.raises(CliError, match="JMEM_HOST_ALLOCATOR"):
        launcher.allocator_note("auto", "full", dry_run=False)
    monkeypatch.setattr(job, "initialize_distributed", lambda config: None)
    with pytest.raises(SystemExit) as e:
        finetune.main(["--config", "tiny", "--steps", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: JMEM_HOST_ALLOCATOR='garbage' is not one of auto, system")


def test_the_old_top_level_names_warn_and_still_work(fake_libc, monkeypatch, fake_execve):
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    assert "host_huge_pages" not in jmem.__all__ and "retain_host_allocations" not in jmem.__all__
    with pytest.warns(DeprecationWarning, match=r"use jmem.host.retain_host_allocations\(\)"):
        assert jmem.retain_host_allocations().applied
    assert len(fake_libc.calls) == 3
    _huge_pages_possible(monkeypatch)
    monkeypatch.setattr(ha.sys, "argv", ["train.py"])
    with pytest.warns(DeprecationWarning, match=r"use jmem.host.restart_with_huge_pages\(\)"):
        with pytest.raises(_Exec):
            jmem.host_huge_pages(announce=False)
    with pytest.warns(DeprecationWarning):
        assert not jmem.host_huge_pages(restart=False).applied
    assert len(fake_execve) == 1


# ------------------------------------------------------------- the job's launcher and note


def _launcher_machine(monkeypatch, plugin=None, **kw):
    """A CPU machine where huge pages work and are not in effect yet (``plugin``: an
    installed JAX GPU plugin), and this process may be restarted (faked)."""
    _huge_pages_possible(monkeypatch, **kw)
    monkeypatch.setattr(launcher, "accelerator_plugin", lambda: plugin)
    monkeypatch.setattr(launcher, "_refused", None)
    monkeypatch.setattr(ha, "_applied", False)
    monkeypatch.setattr(ha.sys, "orig_argv", ["python", "-m", "jmem", "finetune"])
    monkeypatch.setattr(ha.sys, "argv", ["/x/jmem/__main__.py", "finetune"])


def _restart(argv):
    """The entry point's decision: the flags parsed once, then the launcher (help and a
    bad input exit while parsing: the job's own report, no restart)."""
    try:
        config = parse_args(list(argv))
    except SystemExit as e:
        return f"exit {e.code}"
    return launcher.restart_with_huge_pages(config)


@pytest.mark.parametrize(
    "argv,plugin,env,restarts",
    [
        ([], None, "", True),
        (["--host-allocator", "huge-pages"], "jax-cuda12-plugin", "system", True),
        (["--host-allocator=huge-pages", "--remat", "none"], None, "", True),
        (["--host-alloc=huge-pages"], None, "", False),  # abbreviations are refused
        (["--dry-run"], None, "", False),
        (["--host-allocator", "retain"], None, "", False),
        (["--host-allocator", "system"], None, "", False),
        ([], "jax-cuda12-plugin", "", False),
        ([], None, "system", False),
        ([], None, "garbage", False),  # the job reports it
        (["--lora-rank=-1"], None, "", False),  # a bad input: the job reports it
        (["--help"], None, "", False),
    ],
)
def test_the_launcher_restarts_only_when_huge_pages_are_asked_for(
    monkeypatch, fake_execve, argv, plugin, env, restarts
):
    """``auto`` (no GPU/TPU plugin, no opt-out) and ``huge-pages`` restart the process
    once; a dry run, another allocator, help or a bad input do not."""
    _launcher_machine(monkeypatch, plugin)
    monkeypatch.setenv(ha.ENV_VAR, env)
    if restarts:
        with pytest.raises(_Exec):
            _restart(argv)
        assert fake_execve[0][1] == [sys.executable, "-m", "jmem", "finetune"]
        assert "glibc.malloc.hugetlb=1" in fake_execve[0][2]["GLIBC_TUNABLES"]
    else:
        assert _restart(argv)
        assert fake_execve == []


def test_the_launcher_reads_the_config_file_and_respects_what_is_set(
    monkeypatch, fake_execve, tmp_path
):
    config = tmp_path / "job.toml"
    config.write_text('host_allocator = "system"\n')
    _launcher_machine(monkeypatch)
    assert "system" in _restart(["--config-file", str(config)])
    _launcher_machine(monkeypatch, start_tunables="glibc.malloc.hugetlb=1")  # in effect
    assert _restart([]) is None
    _launcher_machine(monkeypatch, start_tunables="glibc.malloc.hugetlb=0")  # the user's
    assert "hugetlb=0" in _restart([])
    assert fake_execve == []
    _launcher_machine(monkeypatch)
    monkeypatch.setattr(ha, "_restart_hazard", lambda: "2 other threads are running")
    assert "2 other threads" in _restart(["--remat", "none"])
    note = launcher.allocator_note("auto", "none", dry_run=False)  # the reason is kept
    assert note.startswith("host allocator: no huge pages (a restart is unsafe here (2 other")


def test_the_old_launcher_name_parses_quietly_and_warns(monkeypatch, fake_execve, capsys):
    """``relaunch_with_huge_pages(argv)`` (deprecated) parses ``argv`` itself, quietly, and
    makes the same decision as ``restart_with_huge_pages``."""
    _launcher_machine(monkeypatch)
    with pytest.warns(DeprecationWarning, match="restart_with_huge_pages=True"):
        assert "bad input" in finetune.relaunch_with_huge_pages(["--lora-rank", "-1"])
    with pytest.warns(DeprecationWarning), pytest.raises(_Exec):
        launcher.relaunch_with_huge_pages([])
    assert capsys.readouterr().err == "" and len(fake_execve) == 1


def test_only_the_entry_points_restart(monkeypatch, fake_execve):
    """``finetune.main(argv)``, ``finetune.main()`` and ``python -m jmem``'s
    ``main(argv)`` never restart the process; ``main()`` of ``python -m jmem`` (the
    console script) and ``examples/qlora_7b.py`` run as a script do, before the job."""
    import jmem.__main__ as cli_main  # noqa: PLC0415

    _launcher_machine(monkeypatch)
    monkeypatch.setattr(job, "initialize_distributed", lambda config: None)
    monkeypatch.setattr(job, "_run", lambda config, note: "ran")
    monkeypatch.setattr(sys, "argv", ["qlora_7b.py", "--steps", "1"])
    assert finetune.main(["--steps", "1"]) == "ran" and finetune.main() == "ran"
    assert cli_main.main(["finetune", "--steps", "1"]) == 0
    assert fake_execve == []
    monkeypatch.setattr(sys, "argv", ["jmem", "finetune", "--steps", "1"])
    with pytest.raises(_Exec):
        cli_main.main()
    example = pathlib.Path(__file__).parents[1] / "examples" / "qlora_7b.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--steps", "1"])
    with pytest.raises(_Exec):
        runpy.run_path(str(example), run_name="__main__")
    assert len(fake_execve) == 2


def test_the_note_says_what_is_in_effect(monkeypatch, fake_libc):
    """One line per run; ``run()`` only reports, the command line applies ``retain``."""
    note = launcher.allocator_note
    _launcher_machine(monkeypatch, start_tunables="glibc.malloc.hugetlb=1")
    assert note("auto", "full", False) == (
        "host allocator: 2 MiB huge pages (GLIBC_TUNABLES set when Python started)"
    )
    assert note("system", "full", False).startswith("host allocator: huge pages all the same")
    assert note("auto", "full", True) is None  # a dry run runs no step
    monkeypatch.setenv(ha._RESTARTED, str(os.getpid()))
    assert "set by restarting the process" in note("huge-pages", "none", False)
    _launcher_machine(monkeypatch)
    hint = "run the job from the command line (jmem finetune), or start Python with GLIBC"
    assert hint in note("auto", "full", False) and "1.45x" not in note("auto", "full", False)
    assert "measured 1.45x faster steps without remat" in note("huge-pages", "none", False)
    assert (
        note("system", "none", False)
        == "host allocator: glibc's defaults (--host-allocator system)"
    )
    monkeypatch.setenv(ha.ENV_VAR, "system")
    assert note("auto", "none", False).endswith("(JMEM_HOST_ALLOCATOR=system)")
    assert "no huge pages" in note("huge-pages", "none", False)  # an explicit choice
    monkeypatch.delenv(ha.ENV_VAR)
    assert "finetune.run() leaves the process's malloc alone" in note("retain", "none", False)
    assert fake_libc.calls == [] and not ha.retained()
    _launcher_machine(monkeypatch, plugin="jax-cuda12-plugin")
    assert note("auto", "none", False).startswith(launcher.PLUGIN_NOTE + "jax-cuda12-plugin")
    monkeypatch.setattr(ha, "huge_pages_unavailable", lambda: "glibc 2.31 has no tunable")
    assert (
        note("huge-pages", "none", False)
        == "host allocator: no huge pages (glibc 2.31 has no tunable)"
    )


def test_the_command_line_applies_retain_before_jax_starts(monkeypatch, fake_libc):
    _launcher_machine(monkeypatch)
    monkeypatch.setattr(ha, "_backends_initialized", lambda: True)
    note = launcher.apply_allocator("retain", "none", False)
    assert "not retained (JAX already started" in note and fake_libc.calls == []
    monkeypatch.setattr(ha, "_backends_initialized", lambda: False)
    assert launcher.apply_allocator("retain", "none", True) is None and fake_libc.calls == []
    assert launcher.apply_allocator("auto", "none", False).startswith("host allocator: no huge")
    assert fake_libc.calls == []  # auto never falls back to mallopt
    note = launcher.apply_allocator("retain", "none", False)
    assert note == "host allocator: freed memory retained" and len(fake_libc.calls) == 3


def test_accelerator_plugin_follows_jax_platforms(monkeypatch):
    import importlib.metadata  # noqa: PLC0415

    class _Dist:
        def __init__(self, name):
            self.name = name

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert launcher.accelerator_plugin() is None
    monkeypatch.setenv("JAX_PLATFORMS", "cpu,cuda")
    assert launcher.accelerator_plugin() is None
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert launcher.accelerator_plugin() == "cuda,cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "")
    dists = [_Dist("numpy"), _Dist("jax_cuda12_plugin")]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: dists)
    assert launcher.accelerator_plugin() == "jax-cuda12-plugin"
    dists[1] = _Dist("jax")
    assert launcher.accelerator_plugin() is None


# ------------------------------------------------- run() changes nothing in its process


@pytest.fixture
def process_spy(monkeypatch):
    """Records every ``mallopt`` looked up through ctypes, every ``exec*`` call (which it
    refuses) and every environment change (pytest's own ``PYTEST_CURRENT_TEST`` aside);
    checks after the test that there were none and that the environment is as before."""
    calls = []
    real_cdll, real_putenv, real_unsetenv = ctypes.CDLL, os.putenv, os.unsetenv

    class _SpyCDLL:
        def __init__(self, *args, **kwargs):
            self._lib = real_cdll(*args, **kwargs)

        def __getattr__(self, name):
            if name == "mallopt":
                calls.append("mallopt")
            return getattr(self._lib, name)

    def refuse(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"os.{name} called")

        return fn

    def env_spy(name, real):
        def fn(key, *value):
            if os.fsdecode(key) != "PYTEST_CURRENT_TEST":
                calls.append(f"{name} {os.fsdecode(key)}")
            return real(key, *value)

        return fn

    monkeypatch.setattr(ctypes, "CDLL", _SpyCDLL)
    for name in ("execv", "execve", "execvp", "execvpe"):
        monkeypatch.setattr(os, name, refuse(name))
    monkeypatch.setattr(os, "putenv", env_spy("putenv", real_putenv))
    monkeypatch.setattr(os, "unsetenv", env_spy("unsetenv", real_unsetenv))
    monkeypatch.setattr(ha, "_applied", False)
    monkeypatch.setattr(launcher, "_refused", None)
    environ = lambda: {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # noqa: E731
    before = environ()
    yield calls
    assert calls == [] and environ() == before and not ha.retained()


def test_the_spy_sees_what_it_guards_against(process_spy):
    ctypes.CDLL(None).mallopt  # looked up, not called
    os.environ["JMEM_TEST_SPY"] = "1"
    del os.environ["JMEM_TEST_SPY"]
    assert process_spy == ["mallopt", "putenv JMEM_TEST_SPY", "unsetenv JMEM_TEST_SPY"]
    with pytest.raises(AssertionError, match="os.execv called"):
        os.execv(sys.executable, [sys.executable])
    process_spy.clear()


def _tiny(tmp_path, choice, **kw):
    return finetune.FinetuneConfig.from_flat(
        config="tiny", steps=1, batch_size=4, seq_len=32, lora_rank=4, remat="none",
        host_allocator=choice, out=str(tmp_path / choice), no_progress=True, **kw,
    )  # fmt: skip


def _one_note(capsys) -> str:
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("host allocator")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("choice", ["auto", "huge-pages", "retain", "system"])
def test_run_changes_nothing_in_its_callers_process(
    process_spy, monkeypatch, tmp_path, capsys, choice
):
    """``finetune.run`` without remat (everything but the training loop, which is stubbed
    here; the slow test below trains) leaves malloc, the process and its environment
    alone, whatever ``host_allocator`` asks; its one note says how to get the speed."""
    monkeypatch.setattr(job, "train", lambda *args: {"trained": True})
    monkeypatch.setattr(job, "publish", lambda *args: None)  # the stub stages no results
    monkeypatch.setattr(ha, "huge_pages_active", lambda: False)
    monkeypatch.setattr(ha, "huge_pages_unavailable", lambda: None)
    monkeypatch.setattr(ha, "_start_tunables", lambda: "")
    monkeypatch.setattr(launcher, "accelerator_plugin", lambda: None)
    assert finetune.run(_tiny(tmp_path, choice)) == {"trained": True}
    note = _one_note(capsys)
    if choice in ("auto", "huge-pages"):
        assert "start Python with GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in note
        assert "run the job from the command line" in note and "1.45x" in note
    elif choice == "retain":
        assert "call jmem.host.retain_host_allocations() first" in note
    else:
        assert note == "host allocator: glibc's defaults (--host-allocator system)"


@pytest.mark.slow
def test_a_real_run_changes_nothing_in_its_callers_process(process_spy, tmp_path, capsys):
    """The same with one real training step, asking for ``retain`` (which only the
    command line applies): ``summary.json`` records that nothing was retained."""
    summary = finetune.run(_tiny(tmp_path, "retain"))
    assert len(summary["losses"]) == 1
    assert summary["host_allocator"]["requested"] == "retain"
    assert summary["host_allocator"]["retained"] is False
    assert "host allocator: " in _one_note(capsys)


_CLI = [sys.executable, "-m", "jmem", "finetune", "--config", "tiny", "--steps", "1"]
_CLI += ["--batch-size", "4", "--seq-len", "32", "--lora-rank", "4", "--no-progress"]


@pytest.mark.slow
@pytest.mark.skipif(
    ha.huge_pages_unavailable() is not None or ha._thp_mode() != "madvise",
    reason="needs glibc 2.35+ and transparent huge pages in madvise mode",
)
def test_the_command_line_keeps_its_cpu_speed(tmp_path):
    """``python -m jmem finetune`` restarts itself once with the tunable (the note and
    ``summary.json`` say so); ``--host-allocator retain`` retains instead."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for name in (ha.ENV_VAR, "GLIBC_TUNABLES", ha._RESTARTED):
        env.pop(name, None)
    for choice, note, record in (
        ("auto", "2 MiB huge pages (set by restarting the process", (True, False)),
        ("retain", "host allocator: freed memory retained", (False, True)),
    ):
        out = tmp_path / choice
        argv = [*_CLI, "--remat", "none", "--host-allocator", choice, "--out", str(out)]
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert note in r.stdout, r.stdout
        summary = json.loads((out / "summary.json").read_text())["host_allocator"]
        assert (summary["huge_pages"], summary["retained"]) == record, summary
