"""The GPU extras pin the CUDA plugin to the tested JAX.

``pip install -e ".[examples,cuda12]"`` is the whole GPU setup (README), and ``gpu-plan``
compiles for NVIDIA targets without a GPU. Both extras pin ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt``, and ``cuda12`` pins ``jaxlib`` as ``jax[cuda12]`` does (the plugin is
built for one jaxlib release, and ``jax[cuda12]`` pins both to the jax version). The pins must
equal the JAX this suite runs on (in CI's newest- and oldest-versions venvs alike) and lie in
the ``jax`` dependency's range.
"""

from __future__ import annotations

import pathlib
import re
import tomllib

import jax
import jaxlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PINNED = ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _pins(requirements: list[str]) -> dict[str, str]:
    """``name -> version`` for the ``name[extras]==version`` requirements of ``PINNED``."""
    out = {}
    for req in requirements:
        m = re.fullmatch(r"\s*([\w.-]+)(\[[\w,-]+\])?\s*==\s*([\w.]+)\s*", req)
        if m and m.group(1) in PINNED:
            out[m.group(1)] = m.group(3)
    return out


def _jax_range() -> tuple[str, str]:
    """The lower and upper bound of the ``jax>=A,<B`` dependency."""
    (req,) = [r for r in _project()["dependencies"] if re.match(r"jax\s*[<>=]", r)]
    lower = re.search(r">=\s*([\w.]+)", req).group(1)
    upper = re.search(r"<\s*([\w.]+)", req).group(1)
    return lower, upper


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


@pytest.mark.parametrize(
    "extra, names",
    [
        ("cuda12", PINNED),
        ("gpu-plan", ("jax-cuda12-plugin", "jax-cuda12-pjrt")),
    ],
)
def test_gpu_extras_pin_the_installed_jax(extra, names):
    pins = _pins(_project()["optional-dependencies"][extra])
    assert set(pins) == set(names), f"{extra}: expected == pins of {names}, got {pins}"
    tested = {jax.__version__, jaxlib.__version__}
    assert len(tested) == 1, f"jax {jax.__version__} and jaxlib {jaxlib.__version__} differ"
    for name, version in pins.items():
        assert version in tested, (
            f"{extra}: {name}=={version}, but the tests run on JAX {jax.__version__}; "
            "pin the extra to the tested JAX"
        )


def test_gpu_pins_lie_in_the_jax_range():
    lower, upper = _jax_range()
    project = _project()["optional-dependencies"]
    versions = {v for e in ("cuda12", "gpu-plan") for v in _pins(project[e]).values()}
    assert len(versions) == 1, f"cuda12 and gpu-plan pin different versions: {versions}"
    (v,) = versions
    assert _version(lower) <= _version(v) < _version(upper), (v, lower, upper)


def test_cuda12_extra_is_the_readme_gpu_install():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip install -e ".[examples,cuda12]"' in readme
    assert "python examples/qlora_7b.py --checkpoint DIR" in readme
