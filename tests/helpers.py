"""Shared test helpers: small models, batches and tree checks used by several test files."""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jmem.models import llama


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


_HLO_COMP = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_HLO_INST = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+?)(?:\{[^}]*\})? ([\w-]+)\((.*)$")


def _hlo_dims(shape: str) -> list[int]:
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _hlo_computations(text: str) -> tuple[dict, str]:
    """``({computation: [(name, shape, op, rest)]}, entry name)`` of compiled HLO text."""
    comps, entry, cur = {}, None, None
    for line in text.splitlines():
        m = _HLO_COMP.match(line)
        if m:
            cur = comps.setdefault(m.group(1), [])
            entry = m.group(1) if line.startswith("ENTRY") else entry
            continue
        m = _HLO_INST.match(line)
        if m and cur is not None:
            cur.append(m.groups())
    return comps, entry


def hlo_dot_flops(text: str) -> float:
    """The FLOPs of every ``dot`` of a compiled module's HLO text (``compiled.as_text()``),
    ``2 * prod(out) * prod(contracted)``, counting a ``while`` body ``known_trip_count``
    times (``cost_analysis()`` counts it once) and fused/called computations once per
    call. Per device for an SPMD-partitioned module."""
    comps, entry = _hlo_computations(text)
    memo: dict = {}

    def flops(comp: str) -> float:
        if comp in memo:
            return memo[comp]
        shapes = {name: shape for name, shape, _, _ in comps.get(comp, [])}
        total = 0.0
        for _, shape, op, rest in comps.get(comp, []):
            if op == "dot":
                lhs = shapes[re.match(r"%(\S+?),", rest).group(1)]
                dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
                k = np.prod([_hlo_dims(lhs)[int(d)] for d in dims.split(",") if d])
                total += 2.0 * np.prod(_hlo_dims(shape)) * k
            elif op == "while":
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
                assert n, "a while loop without a known trip count"
                total += int(n.group(1)) * flops(re.search(r"body=%([\w.-]+)", rest).group(1))
            else:
                for callee in re.findall(r"(?:calls|to_apply)=%([\w.-]+)", rest):
                    total += flops(callee)
        memo[comp] = total
        return total

    return flops(entry)
