"""The public surface: explicit __all__, docstrings, no function shadowing a module, layering."""

import ast
import importlib
import importlib.util
import inspect
import pathlib
import subprocess
import sys

import pytest

import jmem

ROOT = pathlib.Path(jmem.__file__).parent
NAMESPACES = ["jmem", "jmem.lora", "jmem.qlora", "jmem.nf4", "jmem.fp8", "jmem.sharding"]
NAMESPACES += ["jmem.planner", "jmem.tree", "jmem.data", "jmem.ops", "jmem.losses", "jmem.host"]
NAMESPACES += ["jmem.finetune"]
NAMESPACES += ["jmem.targets"]
NAMESPACES += ["jmem.rewards"]


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_public_name_exists_and_has_a_docstring(namespace):
    module = importlib.import_module(namespace)
    assert isinstance(module.__all__, tuple | list) and module.__all__
    assert len(set(module.__all__)) == len(module.__all__), "duplicate names in __all__"
    for name in module.__all__:
        obj = getattr(module, name)
        table = isinstance(obj, dict) and namespace == "jmem"  # tables elsewhere: #: comments
        if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj) or table:
            doc = inspect.getdoc(obj)
            assert doc and doc != inspect.getdoc(dict), f"{namespace}.{name} has no docstring"


def test_top_level_has_a_curated_size():
    assert 35 <= len(jmem.__all__) <= 52, len(jmem.__all__)


@pytest.mark.parametrize("name", ["remat", "measure", "offload", "train_step"])
def test_no_function_shadows_a_module(name):
    assert callable(getattr(jmem, name))
    assert importlib.util.find_spec(f"jmem.{name}") is None


def test_the_job_exports_what_users_call():
    """``jmem.finetune``: the config, its groups, ``run`` and ``main``; the pieces
    (``resolve_defaults``, ``prepare_out``, ``build``, the parser, the launcher...) stay in
    ``jmem._src``. The names exported before still resolve, with a DeprecationWarning."""
    from jmem import finetune

    groups = ["DataConfig", "DevicesConfig", "ExecutionConfig", "ModelConfig", "OutputConfig"]
    groups += ["RunConfig", "TrainingConfig"]
    assert sorted(finetune.__all__) == sorted(["FinetuneConfig", *groups, "main", "run"])
    for name in ["resolve_defaults", "check_outputs", "prepare_out", "CliError", "build"]:
        assert not hasattr(finetune, name), name
    for name in ["LeversConfig", "parse_args", "relaunch_with_huge_pages"]:
        with pytest.warns(DeprecationWarning, match=f"jmem.finetune.{name} is deprecated"):
            assert callable(getattr(finetune, name))
    with pytest.warns(DeprecationWarning):
        assert finetune.LeversConfig is finetune.ExecutionConfig


def test_the_host_namespace_hides_its_internals():
    """``jmem.host`` exports its functions, not the allocator's tables or state probes;
    those still resolve for one release, with a DeprecationWarning."""
    from jmem import host

    for name in ["ENV_VALUES", "HUGE_PAGES_TUNABLE", "restarted", "retained"]:
        assert name not in host.__all__ and name not in vars(host), name
        with pytest.warns(DeprecationWarning, match=f"jmem.host.{name} is internal"):
            assert getattr(host, name) is not None
    with pytest.raises(AttributeError):
        host.nonexistent  # noqa: B018


def test_top_level_names_load_on_first_use():
    """``jmem`` imports its names lazily (so that ``jmem --help`` needs no JAX): every name
    of ``__all__`` resolves, and ``dir`` lists them."""
    for name in jmem.__all__:
        assert getattr(jmem, name) is not None
    assert set(jmem.__all__) <= set(dir(jmem))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        jmem.nonexistent  # noqa: B018


@pytest.mark.slow
def test_namespaces_load_on_first_use_in_a_fresh_interpreter():
    """``import jmem`` alone reaches the job and the models (nothing imported them first),
    and imports neither JAX nor the job until a name is used."""
    code = (
        "import sys, jmem; assert 'jax' not in sys.modules, 'jax'; "
        "assert 'jmem.finetune' not in sys.modules, 'the job'; "
        "jmem.finetune.FinetuneConfig; jmem.models.llama.hidden_states; jmem.data"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_the_job_and_the_models_are_listed_and_lazy():
    import jmem.models

    assert {"finetune", "models"} <= set(dir(jmem)) and "finetune" not in jmem.__all__
    assert {"llama", "families", "hf", "preference"} <= set(dir(jmem.models))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        jmem.models.nonexistent  # noqa: B018


def test_internal_names_are_not_exported():
    for name in ["implicit", "interpret", "resolve_policy", "format_bytes", "loss_scale_from_name"]:
        assert not hasattr(jmem, name), name


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("namespace", [n for n in NAMESPACES if n != "jmem"])
def test_namespaces_only_reexport(namespace):
    path = ROOT / f"{namespace.split('.')[1]}.py"
    body = ast.parse(path.read_text()).body
    for node in body:
        ok = isinstance(node, ast.ImportFrom | ast.Import | ast.Assign)
        ok = ok or (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")
        ok = ok or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        assert ok, f"{path.name}: {ast.dump(node)[:80]} is not a re-export"


def test_leaves_do_not_import_upward():
    """Leaves never import the composition layer, the models, data or the public namespaces
    (the fine-tuning job, ``_src/finetune/``, sits on top of them all)."""
    upward = ("jmem._src.train", "jmem.models", "jmem._src.data", "jmem._src.checkpointing")
    public = {f"jmem.{n}" for n in ("lora", "qlora", "nf4", "fp8", "sharding", "planner")}
    src = ROOT / "_src"
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).as_posix()
        if rel.startswith(("train/", "data/", "finetune/")) or rel == "checkpointing.py":
            continue
        for mod in _imports(path):
            assert not mod.startswith(upward), f"{rel} imports {mod}"
            assert mod not in public and mod != "jmem", f"{rel} imports {mod}"


def test_renamed_names_say_their_new_name():
    with pytest.raises(AttributeError, match="renamed to jmem.qlora.quantize_params"):
        jmem.qlora.quantize  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        jmem.qlora.nonexistent  # noqa: B018


def test_nf4_quantize_of_a_tree_points_to_quantize_params():
    import jax.numpy as jnp

    with pytest.raises(TypeError, match="qlora.quantize_params"):
        jmem.nf4.quantize({"w": jnp.ones((4, 64))})
