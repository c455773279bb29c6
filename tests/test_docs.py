"""Every fenced Python block of README.md and docs/*.md runs, so a renamed function breaks a
test instead of a reader.

Blocks of one file run top to bottom in one namespace (a later block may use names from an
earlier one), in a temporary working directory, on CPU. The namespace starts with the names
docs/README.md lists ("Names in code blocks", ``PRELUDE`` below): ``jax``, ``jnp``,
``optax``, ``jmem``, ``llama``, ``cfg`` (the tiny config), ``key``, ``params``, ``batch``,
``loss_fn``. A block preceded by the line
``<!-- docs-test: skip (reason) -->`` (blank lines allowed between) is not run; each such
block is reported as a pytest skip with its reason (``pytest -rs``). Running the blocks
compiles real programs (a few seconds to a minute per page on a loaded CPU), so those tests
are ``slow`` (CI runs them); the checks of the markers and of ``jmem.`` names in prose are
fast. Shell blocks (``bash``,
``sh``, ``console``) are not run; the CLI tests cover them. New Markdown files under docs/
and new blocks are picked up without touching this test.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(skip)\b\s*(.*?)\s*-->\s*$")
_PYTHON = ("python", "py", "python3")


#: What every file's blocks start with (listed in docs/README.md, "Names in code blocks").
PRELUDE = """
import functools
import jax, jax.numpy as jnp, optax, jmem
from jmem.models import llama

cfg = llama.get_config("tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2)
key = jax.random.key(0)
params = llama.init(key, cfg)
tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, cfg.vocab_size)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
loss_fn = lambda p, batch: llama.loss_fn(p, batch, cfg)
"""


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced Python block: where it is, its code, and its marker (if any)."""

    path: pathlib.Path
    line: int  # 1-based line of the first code line
    code: str
    marker: str | None  # "skip" or None
    reason: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line - 1}"


def _marker_before(lines: list[str], i: int) -> tuple[str | None, str, int | None]:
    """The docs-test marker on the last non-blank line before line ``i`` (0-based)."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    m = _MARKER.match(lines[j]) if j >= 0 else None
    if not m:
        return None, "", None
    return m.group(1), m.group(2).strip("() ") or "no reason given", j


def blocks(path: pathlib.Path) -> tuple[list[Block], list[str]]:
    """The Python blocks of ``path``, and problems found (unclosed fence, stray marker)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, problems, used, i = [], [], set(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        indent = len(lines[i]) - len(lines[i].lstrip())
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        if i == len(lines):
            problems.append(f"{path.name}:{start + 1}: unclosed ``` fence")
            break
        marker, reason, at = _marker_before(lines, start)
        if lang in _PYTHON:
            body = "\n".join(
                x[indent:] if x[:indent].isspace() else x for x in lines[start + 1 : i]
            )
            out.append(Block(path, start + 2, body, marker, reason))
            used.add(at)
        i += 1
    for j, text in enumerate(lines):
        if _MARKER.match(text) and j not in used:
            problems.append(f"{path.name}:{j + 1}: docs-test marker not before a python block")
    return out, problems


def _all_blocks() -> list[Block]:
    return [b for f in FILES for b in blocks(f)[0]]


def _run_params():
    out = []
    for f in FILES:
        bs = blocks(f)[0]
        if any(b.marker != "skip" for b in bs):
            out.append(pytest.param(f, id=str(f.relative_to(ROOT))))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", _run_params())
def test_python_blocks_run(path, tmp_path, monkeypatch):
    """Each file's unmarked Python blocks run in order without raising."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(path)])
    namespace = {"__name__": "__docs__"}
    exec(compile(PRELUDE, "<docs prelude>", "exec"), namespace)
    for b in blocks(path)[0]:
        if b.marker == "skip":
            continue
        code = compile("\n" * (b.line - 1) + b.code, str(b.path), "exec")
        try:
            exec(code, namespace)
        except Exception as e:  # report the block, keep the traceback
            raise AssertionError(
                f"the python block at {b.name} raised {type(e).__name__}: {e}\n"
                "Fix the block (or the code it calls), or mark it with "
                "'<!-- docs-test: skip (reason) -->' on the line before the fence."
            ) from e


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=b.name) for b in _all_blocks() if b.marker == "skip"],
)
def test_skipped_blocks_are_reported(block):
    """A block marked ``skip`` is reported as skipped, with its reason (``pytest -rs``)."""
    pytest.skip(f"{block.name}: {block.reason}")


def test_markers_and_fences_are_well_formed():
    """Every fence is closed and every docs-test marker sits right before a python block."""
    problems = [p for f in FILES for p in blocks(f)[1]]
    assert not problems, problems


_JMEM_NAME = re.compile(r"`(jmem(?:\.\w+)+)")


@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(ROOT)) for f in FILES])
def test_jmem_names_in_prose_exist(path):
    """Every ``jmem.a.b`` named in inline code resolves to a module or attribute."""
    import importlib

    missing = []
    for dotted in sorted(set(_JMEM_NAME.findall(path.read_text(encoding="utf-8")))):
        parts = dotted.split(".")
        obj = importlib.import_module("jmem")
        for k, part in enumerate(parts[1:], start=2):
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            try:
                obj = importlib.import_module(".".join(parts[:k]))
            except ImportError:
                missing.append(dotted)
                break
    assert not missing, f"{path.name} names {missing}, which do not exist."


_DECAYING_CALL = re.compile(r"\b(optax\.adamw|(?:jmem\.)?adamw_[48]bit)\(")


def _call_args(code: str, start: int) -> str:
    """The text between the parenthesis at ``start`` and its match."""
    depth = 0
    for i in range(start, len(code)):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return code[start + 1 : i]
    return code[start + 1 :]


def decay_without_mask(code: str) -> list[str]:
    """Calls of an AdamW (weight decay on by default) without ``mask=`` in ``code``."""
    out = []
    for m in _DECAYING_CALL.finditer(code):
        args = _call_args(code, m.end() - 1)
        if "mask=" not in args and not re.search(r"weight_decay=0(\.0*)?\b", args):
            out.append(f"{m.group(1)}({args})")
    return out


@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(ROOT)) for f in FILES])
def test_weight_decay_examples_show_the_mask(path):
    """An example that decays (optax.adamw, jmem.adamw_8bit/4bit) passes
    mask=jmem.decay_mask, so a copied example does not decay norm scales and biases."""
    bad = [f"{b.name}: {c}" for b in blocks(path)[0] for c in decay_without_mask(b.code)]
    assert not bad, f"add mask=jmem.decay_mask (or weight_decay=0.0) to {bad}"


def test_decay_check_reads_calls():
    assert decay_without_mask("t = optax.adamw(1e-4)\n") == ["optax.adamw(1e-4)"]
    assert decay_without_mask("jmem.adamw_8bit(f(1), mask=jmem.decay_mask)") == []
    assert decay_without_mask("adamw_4bit(1e-3, weight_decay=0.0)") == []


def _shell_commands(path: pathlib.Path) -> list[str]:
    """Commands of the ``bash``/``sh`` blocks of ``path``, split on ``&&``."""
    lines, out, lang = path.read_text(encoding="utf-8").splitlines(), [], None
    for text in lines:
        m = _FENCE.match(text)
        if m:
            lang = None if lang is not None else m.group(2).lower() or "-"
            continue
        if lang in ("bash", "sh", "shell"):
            out.extend(c.strip() for c in text.split("&&") if c.strip())
    return out


def test_readme_install_commands_name_real_extras_scripts_and_modules():
    """The README's shell commands (install, run the job, run the tests) name extras in
    pyproject.toml, scripts that exist and modules that import: they are not run here
    (they create a venv and download), so their names are checked."""
    import importlib.util
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(extras.get("optional-dependencies", {}))
    problems, commands = [], _shell_commands(ROOT / "README.md")
    assert any("pip install" in c for c in commands), commands
    for c in commands:
        for extra in re.findall(r'pip install -e "\.\[([\w,-]+)\]"', c):
            problems += [f"{c}: no extra {e!r}" for e in extra.split(",") if e not in extras]
        m = re.match(r"python3? (?!-)(\S+\.py)", c)
        if m and not (ROOT / m.group(1)).is_file():
            problems.append(f"{c}: no file {m.group(1)}")
        m = re.match(r"python3? -m ([\w.]+)", c)
        if m and m.group(1) not in ("venv", "pip", "pytest"):
            if importlib.util.find_spec(m.group(1)) is None:
                problems.append(f"{c}: no module {m.group(1)}")
    assert not problems, problems


def test_extractor_sees_markers_and_failures(tmp_path):
    """The extractor finds python blocks, skips marked ones, and a raising block fails."""
    doc = tmp_path / "x.md"
    doc.write_text(
        "text\n```python\nx = 1\n```\n<!-- docs-test: skip (needs a GPU) -->\n\n"
        "```python\nraise RuntimeError\n```\n```bash\nexit 1\n```\n"
        "```python\nassert x == 1\nraise ValueError('boom')\n```\n",
        encoding="utf-8",
    )
    bs, problems = blocks(doc)
    assert not problems
    assert [(b.line, b.marker, b.reason) for b in bs] == [
        (3, None, ""),
        (8, "skip", "needs a GPU"),
        (14, None, ""),
    ]
    ns: dict = {}
    exec(bs[0].code, ns)
    with pytest.raises(ValueError, match="boom"):
        exec(bs[2].code, ns)
