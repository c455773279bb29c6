"""The job's config in the forms users wrote: a flat config file (``data: FILE``, ``steps:
40``; deprecated, still read, every value checked as its flag), a nested one, the flat
keywords of ``FinetuneConfig(...)``; the command line parses its flags once, derives the
defaults once and initializes ``jax.distributed`` once; one conversion to ``Levers``."""

import sys

import helpers
import pytest

from jmem import finetune
from jmem.__main__ import main as jmem_main
from jmem._src.finetune import command
from jmem._src.finetune import config as fc
from jmem._src.finetune import job
from jmem._src.finetune import setup
from jmem._src.finetune.config_file import parse_args

FLAT_NOTE = "flat keys are deprecated"


@pytest.fixture
def chat(tmp_path):
    return helpers.sft_jsonl(tmp_path / "chat.jsonl")


def _flat_file(tmp_path, chat, extra=""):
    path = tmp_path / "old.yaml"
    path.write_text(f"config: tiny\ndata: {chat}\nsteps: 40\nlora_rank: 8\n{extra}")
    return str(path)


def test_a_flat_file_naming_its_data_loads_with_one_note(tmp_path, chat, capsys):
    c = parse_args(["--config-file", _flat_file(tmp_path, chat, "eval-split: 0.1\n")])
    assert (c.model.config, c.data.data, c.training.steps) == ("tiny", chat, 40)
    assert (c.training.lora_rank, c.data.eval_split) == (8, 0.1)
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if FLAT_NOTE in line]
    assert len(notes) == 1 and out.count("deprecated") == 1, out
    assert "data -> data.data" in notes[0] and "steps -> training.steps" in notes[0]
    assert "eval-split -> data.eval_split" in notes[0]


def test_a_nested_file_loads_without_a_note_and_levers_with_one(tmp_path, chat, capsys):
    path = tmp_path / "new.yaml"
    path.write_text(
        f"model: {{config: tiny}}\ndata: {{data: {chat}, seq_len: 32}}\n"
        "execution: {remat: none, grad_accum: 2}\ntraining: {steps: 3}\n"
    )
    c = parse_args(["--config-file", str(path)])
    assert (c.data.data, c.data.seq_len, c.training.steps) == (chat, 32, 3)
    assert (c.execution.remat, c.execution.grad_accum) == ("none", 2)
    assert "deprecated" not in capsys.readouterr().out
    path.write_text("levers: {remat: none}\n")
    assert parse_args(["--config-file", str(path)]).execution.remat == "none"
    out = capsys.readouterr().out
    assert out.count("deprecated") == 1 and "name the group execution" in out, out


#: A flat file with ``data: FILE`` and one bad value -> the words its error names.
BAD_FLAT = {
    "misspelt key": ("lora_rnk: 4\n", ["'lora_rnk'", "did you mean 'training.lora_rank'"]),
    "bad regex": ("lora_targets: 'q_proj('\n", ["lora_targets", "nor a valid regex"]),
    "infinite lr": ("lr: .inf\n", ["lr", "positive number"]),
    "zero seq_len": ("seq_len: 0\n", ["seq_len", "positive integer"]),
    "bad choice": ("remat: everything\n", ["remat", "'everything' is not one of"]),
    "bad fraction": ("eval_split: 1.5\n", ["eval_split", "[0, 1)"]),
    "bad mesh": ("mesh: data=0\n", ["mesh", "data=N,fsdp=M"]),
    "command-line only": ("resume: true\n", ["'resume'", "command-line only"]),
    "group not a mapping": ("training: 3\n", ["'training' is a group"]),
    "list value": ("batch_size: [1, 2]\n", ["batch_size", "single value"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAT))
def test_a_flat_file_with_one_bad_value_gets_that_values_error(tmp_path, chat, capsys, case):
    text, words = BAD_FLAT[case]
    with pytest.raises(SystemExit) as e:
        jmem_main(["finetune", "--config-file", _flat_file(tmp_path, chat, text)])
    err = helpers.one_line_error(capsys, e, "--config-file", *words)
    assert "'data' is a group" not in err


def test_the_flat_keywords_of_finetune_config_work_with_a_deprecation_warning(chat):
    flat = dict(config="tiny", data=chat, steps=2, lora_rank=4, mlp_chunk=16)
    with pytest.warns(DeprecationWarning, match=r"FinetuneConfig\.from_flat"):
        c = finetune.FinetuneConfig(**flat)
    assert c == finetune.FinetuneConfig.from_flat(**flat)
    assert (c.data.data, c.training.steps, c.execution.token_chunk) == (chat, 2, 16)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="lora_rank: must"):
        finetune.FinetuneConfig(config="tiny", lora_rank=-1)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="no option 'stps'"):
        finetune.FinetuneConfig(stps=2)
    # Groups and flat keywords together: the keywords change the groups' fields.
    with pytest.warns(DeprecationWarning):
        mixed = finetune.FinetuneConfig(training=finetune.TrainingConfig(lr=1e-3), steps=5)
    assert (mixed.training.lr, mixed.training.steps) == (1e-3, 5)


def test_the_nested_form_warns_nothing_and_the_old_group_name_warns(recwarn):
    c = finetune.FinetuneConfig(
        model=finetune.ModelConfig(config="tiny"),
        data=finetune.DataConfig(batch_size=2),
        execution={"remat": "none"},
    )
    assert c.replace(steps=3).training.steps == 3 and not recwarn.list
    with pytest.warns(DeprecationWarning, match="execution=") as w:
        old = finetune.FinetuneConfig(levers=finetune.ExecutionConfig(remat="none"))
    assert old.execution == c.execution and len(w) == 1
    with pytest.warns(DeprecationWarning, match="FinetuneConfig.execution"):
        assert c.levers is c.execution
    with pytest.warns(DeprecationWarning, match="use ExecutionConfig"):
        assert fc.LeversConfig is fc.ExecutionConfig


def _counted(monkeypatch, owner, name, calls, firsts=None):
    """Wraps ``owner.name`` so that each call is counted under ``name`` (and its first
    argument appended to ``firsts``)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        if firsts is not None:
            firsts.append(args[0])
        return inner(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def test_the_command_line_parses_once_derives_once_and_initializes_once(
    monkeypatch, tmp_path, chat, capsys
):
    """``jmem finetune`` (the console script, so the huge-page decision too): the flags
    are parsed into one ``FinetuneConfig``, which the launcher and the job share; the
    defaults are resolved once and ``jax.distributed`` initialized once; a flat file's
    note is printed once."""
    calls, seen = {}, []
    _counted(monkeypatch, command, "parse_args", calls)
    _counted(monkeypatch, job, "validate", calls)
    _counted(monkeypatch, job, "initialize_distributed", calls, seen)
    _counted(monkeypatch, job, "resolve_defaults", calls, seen)
    built = []
    from_flat = fc.FinetuneConfig.from_flat.__func__
    monkeypatch.setattr(
        fc.FinetuneConfig,
        "from_flat",
        classmethod(lambda cls, **kw: built.append(kw) or from_flat(cls, **kw)),
    )
    _counted(monkeypatch, command.launcher, "restart_with_huge_pages", calls, seen)
    monkeypatch.setattr(job, "dry_run", lambda *a, **k: {})
    path = _flat_file(tmp_path, chat, "batch_size: 8\nseq_len: 32\n")
    argv = ["jmem", "finetune", "--config-file", path, "--dry-run", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    assert jmem_main() == 0
    once = dict.fromkeys(["parse_args", "initialize_distributed", "resolve_defaults"], 1)
    assert calls == {**once, "restart_with_huge_pages": 1} and len(built) == 1
    launched, initialized, resolved = seen  # the one parsed config, handed on
    assert launched is initialized is resolved and launched.data.data == chat
    assert capsys.readouterr().out.count(FLAT_NOTE) == 1


def test_the_estimate_and_the_job_convert_to_levers_by_one_function(monkeypatch, capsys):
    """``jmem estimate``'s levers are the job's (``setup.job_levers``), for every remat."""
    import jmem.__main__ as cli_main  # noqa: PLC0415

    calls = {}
    want = setup.job_levers(fc.FinetuneConfig.from_flat(remat="dots"))
    _counted(monkeypatch, setup, "job_levers", calls)
    assert cli_main._levers("dots") == want and calls == {"job_levers": 1}
    assert jmem_main(["estimate", "--model", "tiny", "--remat", "none,dots"]) == 0
    assert calls == {"job_levers": 3} and "remat=dots" in capsys.readouterr().out


@pytest.mark.slow
def test_an_old_flat_file_with_its_data_trains(tmp_path, chat, capsys):
    """The previous release's flat file (``data: FILE`` among the flags' names) trains a
    tiny model for two steps; its options are those of the flat keywords."""
    out = tmp_path / "run"
    extra = "batch_size: 8\nseq_len: 32\nsteps: 2\nlora_rank: 4\neval_split: 0\nno_progress: true\n"
    extra += f"out: {out}\n"
    path = tmp_path / "old.yaml"
    path.write_text(f"config: tiny\ndata: {chat}\n{extra}")
    summary = finetune.main(["--config-file", str(path)])
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    assert capsys.readouterr().out.count(FLAT_NOTE) == 1
    args = summary["args"]
    assert (args["data"], args["steps"], args["lora_rank"]) == (chat, 2, 4)
