"""Shared test helpers: small models, batches and tree checks used by several test files."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jmem.models import llama


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (the benchmarks are not a package)."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_config(**overrides) -> llama.LlamaConfig:
    """A 2-layer, 64-wide Llama with GQA (4 heads, 2 KV heads) and a 64-token vocabulary."""
    kw = dict(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=64,
    )
    return llama.get_config("tiny", **{**kw, **overrides})


def token_batch(config, batch_size: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """``{"inputs", "targets"}`` int32 ``[B, S]`` random tokens for ``config``."""
    tokens = jax.random.randint(
        jax.random.key(seed), (batch_size, seq_len + 1), 0, config.vocab_size, jnp.int32
    )
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def memory_kinds(tree) -> set:
    """The set of ``sharding.memory_kind`` of a tree's array leaves."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)}


def assert_bitwise_equal(a, b) -> None:
    """Asserts two trees have equal structure and bitwise-equal leaves (NaNs included)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def sft_jsonl(path, n=60):
    """A tiny instruction dataset: prompt/completion pairs (sums), one per line."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for a, b in rng.integers(0, 50, size=(n, 2)):
            f.write(json.dumps({"prompt": f"Q: {a}+{b}=?\nA:", "completion": f" {a + b}\n"}))
            f.write("\n")
    return str(path)


def one_line_error(capsys, excinfo, *words) -> str:
    """The error is one line ``error: ...`` on stderr, status 2, naming ``words``."""
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(argvs, timeout: float = 150) -> list[str]:
    """Runs one Python process per argv (``[script, *args]``, the repository on
    PYTHONPATH, without this session's XLA_FLAGS) and returns their outputs; asserts that
    every one exits 0 (the tail of its log otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for argv in argvs
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, log in zip(procs, logs):
        tail = "\n".join(l for l in log.splitlines() if "spmd_partitioner" not in l)[-3000:]
        assert p.returncode == 0, tail
    return logs


def hlo_dot_flops(text: str) -> float:
    """``jmem._src.hlo_flops.dot_flops``: dot FLOPs of compiled HLO text, loops by trip count."""
    from jmem._src.hlo_flops import dot_flops

    return dot_flops(text)


def killed(phase, argv, expect=()):
    """Runs ``tests/_faults_worker.py PHASE ARGV`` (killed with SIGKILL at ``phase``);
    asserts it died so and that its output holds each of ``expect``; returns its pid."""
    worker = os.path.join(os.path.dirname(__file__), "_faults_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, worker, phase, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == -9, stdout[-2000:] + stderr[-2000:]
    assert stdout.rstrip().endswith("killed")
    for words in expect:
        assert words in stdout, (words, stdout[-2000:])
    return proc.pid
