"""``--lora-targets`` takes one form in ``jmem finetune`` and ``jmem estimate``
(``jmem._src.lora_modules``): module names as PEFT's ``target_modules``, ``all`` or a
full-match regex; both commands select the same weights for the same value; a value that
selects nothing is one line naming the modules; ``lora.init(modules=)`` takes the names too,
and the ``targets=`` spellings of the selection still work, with a ``DeprecationWarning``."""

import argparse
import json
import re
import subprocess
import sys
import warnings

import helpers
import jax
import jax.numpy as jnp
import pytest

from jmem import finetune
from jmem import lora
from jmem import nf4
from jmem import qlora
from jmem.__main__ import main as jmem_main
from jmem._src import lora_modules
from jmem._src.cli import CliError
from jmem._src.finetune.build import quantized_base
from jmem._src.finetune.dry_run import _abstract_adapters
from jmem._src.finetune.rundir import _check_same_run
from jmem._src.finetune.rundir import flags
from jmem._src.finetune.setup import check_lora_targets
from jmem._src.finetune.setup import resolve_defaults
from jmem.models import llama

#: Values of ``--lora-targets`` and the projections each selects in the reference model.
SELECTIONS = {
    "q_proj,v_proj": ("q_proj", "v_proj"),
    "v_proj, q_proj": ("q_proj", "v_proj"),
    "all": llama.LINEAR_NAMES,
    "all-linear": llama.LINEAR_NAMES,
    ".*(q_proj|v_proj).*": ("q_proj", "v_proj"),
    r"layers/(gate|up|down)_proj/kernel": ("gate_proj", "up_proj", "down_proj"),
}


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("q_proj,v_proj", "q_proj,v_proj"),
        (" v_proj , q_proj,q_proj ", "q_proj,v_proj"),
        ("lm_head,q_proj", "q_proj,lm_head"),
        ("ALL", "all"),
        ("all-linear", "all"),
        (r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*", "all"),
        (".*(q_proj|v_proj).*", ".*(q_proj|v_proj).*"),
        ("q_proj|v_proj", "q_proj|v_proj"),
    ],
)
def test_parse_gives_one_canonical_value(text, canonical):
    assert lora_modules.parse(text) == canonical
    assert lora_modules.parse(canonical) == canonical


def test_parse_refuses_a_bad_regex_with_the_forms():
    with pytest.raises(argparse.ArgumentTypeError, match=r"comma list of module names.*all"):
        lora_modules.parse("(q_proj")


def test_the_parser_imports_no_jax():
    code = (
        "import sys, jmem._src.lora_modules, jmem._src.finetune.config; print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _job_config(value: str):
    """The tiny job's config with ``--lora-targets value``, its defaults resolved as the
    job resolves them."""
    config = finetune.FinetuneConfig.from_flat(config="tiny", lora_targets=value)
    return resolve_defaults(config, llama.get_config("tiny"), on_gpu=False)[0]


def _job_modules(value: str) -> tuple[str, ...]:
    """The module names the job adapts for ``--lora-targets value`` (the dry run's adapters:
    the same ``lora.init`` call as the training loop's), on the tiny model."""
    config, cfg = _job_config(value), llama.get_config("tiny")
    frozen = quantized_base(config, cfg, jnp.float32, abstract=True)
    return tuple(lora_modules.module_names(list(_abstract_adapters(config, frozen))))


def _estimate_modules(value: str, capsys) -> tuple[str, ...]:
    """The module names ``jmem estimate --lora-targets value`` counts (its printed note)."""
    assert jmem_main(["estimate", "--model", "tiny", "--lora-targets", value]) == 0
    m = re.search(r"LoRA r=8 on ([\w, ]+):", capsys.readouterr().out)
    return tuple(m[1].split(", "))


@pytest.mark.parametrize("value", sorted(SELECTIONS))
def test_finetune_and_estimate_select_the_same_weights(value, capsys):
    assert _job_modules(value) == SELECTIONS[value]
    assert _estimate_modules(value, capsys) == SELECTIONS[value]


@pytest.mark.parametrize("value", ["q_prj", "q_proj,v_prj"])
def test_a_typo_is_one_line_with_the_names_in_both_commands(value, capsys):
    typo = value.split(",")[-1]
    config = _job_config(value)
    with pytest.raises(CliError) as e:
        check_lora_targets(config, llama.get_config("tiny"))
    message = str(e.value)
    assert "\n" not in message
    for word in (f"no module named {typo!r}", "did you mean", "q_proj, k_proj", "comma list"):
        assert word in message, (word, message)
    with pytest.raises(SystemExit) as e:
        jmem_main(["estimate", "--model", "tiny", "--lora-targets", value])
    helpers.one_line_error(
        capsys, e, "--lora-targets", f"{typo!r}", "did you mean", "q_proj, k_proj"
    )


def test_a_regex_matching_part_of_a_path_says_so():
    config = _job_config("q_proj|v_proj")
    with pytest.raises(CliError, match=r"in full \(it matches only part of one\).*comma list"):
        check_lora_targets(config, llama.get_config("tiny"))


@pytest.mark.parametrize("stored", [lora_modules._ALL_AS_REGEX, "all"])
def test_a_run_written_with_the_default_regex_resumes(tmp_path, stored):
    """run.json may hold the default as its regex spelling: the default resumes it, another
    selection does not."""
    config = finetune.FinetuneConfig.from_flat(config="tiny", out=str(tmp_path))
    record = tmp_path / "run.json"
    record.write_text(json.dumps({**flags(config), "lora_targets": stored}))
    _check_same_run(config, str(record))
    other = config.replace(lora_targets="q_proj,v_proj")
    with pytest.raises(CliError, match=r"--lora-targets q_proj,v_proj \(was "):
        _check_same_run(other, str(record))


def _init(params, **kwargs):
    """``lora.init``'s adapters as shapes (no compile)."""
    return jax.eval_shape(lambda: lora.init(jax.random.key(0), params, **kwargs))


def _zeros(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _params():
    return {
        "layers": {
            "q_proj": {"kernel": _zeros(2, 8, 8), "bias": _zeros(2, 8)},
            "v_proj": {"kernel": _zeros(2, 8, 4)},
            "gate_up_proj": {"kernel": _zeros(2, 8, 4)},
        },
        "lm_head": {"kernel": _zeros(8, 16)},
    }


def test_lora_init_takes_module_names_as_peft():
    """A name matches a weight whose module path ends with it (not a substring of another
    name, not a bias); a name matching nothing is an error with the closest name."""
    ad = _init(_params(), rank=2, modules=["q_proj", "lm_head"])
    assert sorted(ad) == ["layers/q_proj/kernel", "lm_head/kernel"]
    ad = _init(_params(), rank=2, modules=("layers/v_proj",))
    assert sorted(ad) == ["layers/v_proj/kernel"]
    with pytest.raises(ValueError, match=r"no module named 'up_proj'"):  # not gate_up_proj
        _init(_params(), modules=["up_proj"])
    with pytest.raises(ValueError, match=r"no module named 'v_prj' \(did you mean 'v_proj'\?\)"):
        _init(_params(), modules=["q_proj", "v_prj"])


def test_targets_keyword_and_names_are_deprecated_aliases():
    p = _params()
    with pytest.warns(DeprecationWarning, match=r"modules="):
        old = _init(p, rank=2, targets=r".*q_proj/kernel")
    assert list(old) == ["layers/q_proj/kernel"]
    with pytest.raises(TypeError, match="modules= only"):
        _init(p, modules="x", targets="y")
    with pytest.warns(DeprecationWarning, match=r"modules="):
        q = jax.eval_shape(lambda: qlora.quantize_params(p, targets=r"lm_head/kernel"))
    assert isinstance(q["lm_head"]["kernel"], nf4.NF4Array)
    with pytest.warns(DeprecationWarning, match="DEFAULT_MODULES"):
        assert lora.DEFAULT_TARGETS == lora.DEFAULT_MODULES
    with pytest.warns(DeprecationWarning, match="default_modules"):
        assert qlora.default_targets is qlora.default_modules
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _init(p, rank=2, modules=r".*q_proj/kernel")


@pytest.mark.slow
def test_the_dry_run_adapts_the_modules_estimate_counts(tmp_path, capsys):
    """``jmem finetune --dry-run --lora-targets q_proj,v_proj`` prints the modules that
    ``jmem estimate`` counts for the same value."""
    argv = ["--config", "tiny", "--dry-run", "--seq-len", "32", "--batch-size", "1"]
    finetune.main([*argv, "--lora-targets", "q_proj,v_proj", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert "LoRA r=8 on ['q_proj', 'v_proj']:" in out, out
    assert _estimate_modules("q_proj,v_proj", capsys) == ("q_proj", "v_proj")
