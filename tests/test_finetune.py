"""jmem.finetune as a library and a command: the config dataclass and config files (flags
override them; bad keys and values are one-line errors naming the key), a run on nothing to
learn is refused, small files train and evaluate, LoRA dropout keys, and the mesh (8
simulated CPU devices: same losses as one device, ~1/8 of the state per device, a run
saved on 8 devices resumes on 4)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import helpers
import jax
import numpy as np
import pytest

import jmem
import jmem._src.levers
from jmem import finetune
from jmem.__main__ import main as jmem_main
from jmem._src.cli import CliError
from jmem._src.finetune.build import build
from jmem._src.finetune.build import quantized_base
from jmem._src.finetune.config_file import parse_args
from jmem._src.finetune.datasets import load_datasets
from jmem._src.finetune.loop import init_state

SMALL = ["--config", "tiny", "--batch-size", "8", "--seq-len", "32", "--lora-rank", "4"]
SMALL += ["--no-progress", "--lr", "3e-3", "--eval-every", "2", "--eval-batches", "2"]


_one_line_error = helpers.one_line_error


# ------------------------------------------------------------------ config and config files


def test_flags_override_the_config_file_yaml_and_toml(tmp_path, capsys):
    (tmp_path / "f.yaml").write_text(
        "training:\n  lora-rank: 16\n  steps: 7\n  lr: 1e-4\ndata: {data: a.txt}\n"
    )
    (tmp_path / "f.toml").write_text(
        '[training]\nlora_rank = 16\nsteps = 7\nlr = 1e-4\n[data]\ndata = "a.txt"\n'
    )
    for name in ("f.yaml", "f.toml"):
        c = parse_args(["--config-file", str(tmp_path / name), "--steps", "5"])
        t = c.training
        assert (t.lora_rank, t.steps, t.lr, c.data.data) == (16, 5, 1e-4, "a.txt")
        assert c.data.seq_len is None and c.data.eval_split == 0.05  # untouched defaults
    assert "deprecated" not in capsys.readouterr().out
    # A value on the command line equal to the default still overrides the file.
    c = parse_args(["--config-file", str(tmp_path / "f.yaml"), "--lora-rank", "8"])
    assert c.training.lora_rank == 8
    # --checkpoint on the command line replaces the file's --config.
    (tmp_path / "m.yaml").write_text("model: {config: tiny}\n")
    c = parse_args(["--config-file", str(tmp_path / "m.yaml"), "--checkpoint", "x"])
    assert (c.model.config, c.model.checkpoint) == (None, "x")


def test_flat_config_file_keys_are_read_with_one_deprecation_note(tmp_path, capsys):
    """Earlier versions' flat keys still work: one note names each key's nested form."""
    (tmp_path / "f.yaml").write_text("lora_rank: 16\nremat: none\nmlp_chunk: 64\n")
    c = parse_args(["--config-file", str(tmp_path / "f.yaml")])
    assert (c.training.lora_rank, c.execution.remat, c.execution.token_chunk) == (16, "none", 64)
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if "flat keys are deprecated" in line]
    assert len(note) == 1, out
    assert "lora_rank -> training.lora_rank" in note[0] and "remat -> execution.remat" in note[0]
    assert "mlp_chunk is deprecated; use execution.token_chunk" in out


BAD_FILES = {
    "unknown key": ("lora_rnk: 4\n", ["f.yaml", "'lora_rnk'", "did you mean 'training.lora_rank'"]),
    "unknown nested key": ("execution:\n  remt: full\n", ["'execution.remt'", "'execution.remat'"]),
    "unknown key, old group": ("levers:\n  remt: full\n", ["'levers.remt'", "'execution.remat'"]),
    "key in another group": ("execution: {lora_rank: 4}\n", ["'execution.lora_rank'", "training"]),
    "group not a mapping": ("execution: full\n", ["'execution' is a group", "mapping"]),
    "command-line only": ("run: {resume: true}\n", ["'run.resume'", "command-line only"]),
    "bad value": ("training: {lora_rank: -1}\n", ["f.yaml", "lora_rank", "integer >= 0"]),
    "bad flat value": ("lora_rank: -1\n", ["f.yaml", "lora_rank", "integer >= 0"]),
    "bad float": ("data: {eval_split: 1.5}\n", ["eval_split", "[0, 1)"]),
    "bad choice": ("optimizer: adamw8bit\n", ["optimizer", "did you mean 'adamw_8bit'"]),
    "bool flag": ("execution: {offload: 3}\n", ["offload", "true or false"]),
    "list value": ("steps: [1, 2]\n", ["steps", "single value"]),
    "not a mapping": ("- a\n- b\n", ["f.yaml", "mapping"]),
    "both models": ("model: {config: tiny, checkpoint: x}\n", ["config", "checkpoint"]),
    "broken yaml": ("a: [\n", ["f.yaml", "YAML"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_config_file_is_one_line_naming_the_key(tmp_path, capsys, case):
    text, words = BAD_FILES[case]
    (tmp_path / "f.yaml").write_text(text)
    with pytest.raises(SystemExit) as e:
        jmem_main(["finetune", "--config-file", str(tmp_path / "f.yaml")])
    _one_line_error(capsys, e, "--config-file", *words)


def test_config_file_missing_or_of_another_kind(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        finetune.main(["--config-file", str(tmp_path / "nowhere.yaml")])
    _one_line_error(capsys, e, "--config-file", "no such file")
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        finetune.main(["--config-file", str(tmp_path / "f.json")])
    _one_line_error(capsys, e, "--config-file", ".toml")


def test_python_api_checks_values_as_the_flags_do(tmp_path):
    """Construction checks every value with the flag's own checker, naming the field."""
    with pytest.raises(CliError, match="lora_rank: must be an integer >= 0"):
        finetune.FinetuneConfig.from_flat(lora_rank=-1, out=str(tmp_path))
    with pytest.raises(ValueError, match="lora_rank: must be an integer >= 0"):
        finetune.TrainingConfig(lora_rank=-1)
    with pytest.raises(ValueError, match="remat: 'everything' is not one of"):
        finetune.FinetuneConfig(execution=finetune.ExecutionConfig(remat="everything"))
    with pytest.raises(ValueError, match="batch_size 3 must be divisible by grad_accum 2"):
        finetune.FinetuneConfig.from_flat(batch_size=3, grad_accum=2)
    with pytest.raises(TypeError, match="FinetuneConfig"):
        finetune.run({"steps": 1})
    with pytest.raises(TypeError, match="FinetuneConfig.execution: expected an? ExecutionConfig"):
        finetune.FinetuneConfig(execution=finetune.TrainingConfig())
    with pytest.raises(TypeError, match="no option 'lora_rnk' \\(did you mean 'lora_rank'"):
        finetune.FinetuneConfig.from_flat(lora_rnk=4)
    assert not os.listdir(tmp_path)
    # Values are converted as a flag's would be; groups may be dicts; every group is frozen.
    c = finetune.FinetuneConfig(
        training={"lr": "1e-3", "lora_rank": 4}, execution={"remat": "none"}
    )
    assert (c.training.lr, c.training.lora_rank, c.execution.remat) == (1e-3, 4, "none")
    assert c == finetune.FinetuneConfig.from_flat(lr=1e-3, lora_rank=4, remat="none")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.training.lr = 1.0
    d = c.replace(steps=3, mlp_chunk=0)  # a deprecated name still replaces its field
    assert (d.training.steps, d.execution.token_chunk, c.training.steps) == (3, 0, None)
    from jmem._src.finetune.config import validate

    assert validate(c) == c
    object.__setattr__(c.data, "seq_len", -1)  # changed behind the dataclass's back
    with pytest.raises(ValueError, match="seq_len: must be a positive integer"):
        validate(c)


def test_the_name_table_is_the_one_every_parser_and_implementation_reads():
    """The flags, the levers, the planner and the implementations share one name table
    (``jmem._src.names``, no JAX); the levers' long-context defaults are LlamaConfig's."""
    from jmem._src import names
    from jmem._src.attention import IMPLEMENTATIONS
    from jmem._src.finetune import config as fc
    from jmem._src.remat import REMAT_POLICIES
    from jmem.models import llama

    assert names.MODEL_NAMES == tuple(sorted(llama.CONFIGS))
    assert tuple(REMAT_POLICIES) == names.REMAT_NAMES
    assert fc.REMAT_NAMES is names.REMAT_NAMES is jmem.planner.REMAT_MODES
    assert IMPLEMENTATIONS is names.ATTENTION_NAMES
    assert jmem.targets.NAMES is names.COMPILE_TARGET_NAMES
    d = jmem.Levers()
    assert fc.LONG_CONTEXT_DEFAULTS == (d.attention, d.loss_chunk, d.token_chunk)
    with pytest.raises(RuntimeError, match="jmem._src.names lists"):
        names.check_implements("T", ("a", "b"), {"a": 1})


def test_help_is_grouped_by_config_group_and_imports_no_jax():
    """``jmem finetune --help`` lists every field's flag under its group's title, and
    parsing the flags imports no JAX (a fresh interpreter)."""
    from jmem._src.finetune import config as fc
    from jmem._src.finetune.config_file import make_parser

    text = make_parser("jmem finetune").format_help()
    for group, cls in fc.GROUPS.items():
        block = text.split(f"\n{group}:\n", 1)[1].split("\n\n\n", 1)[0]
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in block, (group, f.name)
    assert "[--mlp-chunk" not in text and "\n  --mlp-chunk" not in text  # alias hidden
    code = (
        "import sys; from jmem._src.finetune.config_file import parse_args; "
        "c = parse_args(['--lora-rank', '4', '--mlp-chunk', '8']); "
        "assert c.execution.token_chunk == 8; print('jax' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=os.path.abspath(os.path.join(__file__, "..", "..")))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.splitlines() == [
        "note: --mlp-chunk is deprecated; use --token-chunk",
        "False",
    ], (r.stdout, r.stderr)


@pytest.mark.parametrize("argv", [["--help"], ["finetune", "--help"]])
def test_help_answers_in_under_two_seconds(argv):
    """``python -m jmem --help`` and ``jmem finetune --help`` import no JAX (measured: 0.1 s
    and 0.2 s on a loaded 2-core machine, against ~3 s for ``import jax``)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(os.path.join(__file__, "..", "..")))
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "jmem", *argv], capture_output=True, text=True, env=env, timeout=60
    )
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0 and "usage: jmem" in r.stdout, r.stderr
    assert elapsed < 2.0, elapsed


UNKNOWN_FLAGS = {
    "--export": (["--export", "d"], ["--export", "did you mean --export-merged?", "--out/adapter"]),
    "abbreviation": (["--lora-r", "4"], ["--lora-r", "did you mean --lora-rank?"]),
    "with =": (["--sed=3"], ["--sed", "did you mean --seed?"]),
    "estimate": (["estimate", "--model", "7B", "--seq", "4"], ["--seq", "--seq-len?"]),
}


@pytest.mark.parametrize("case", sorted(UNKNOWN_FLAGS))
def test_unknown_or_abbreviated_flags_are_refused_with_the_closest(capsys, case):
    """No abbreviations (``--lora-r 4`` used to be ``--lora-rank 4``): an unknown flag is one
    line naming the closest real flag."""
    argv, words = UNKNOWN_FLAGS[case]
    argv = argv if argv[0] == "estimate" else ["finetune", *argv]
    with pytest.raises(SystemExit) as e:
        jmem_main(argv)
    _one_line_error(capsys, e, "unrecognized argument", *words)


def test_mesh_flag_is_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        finetune.main(["--mesh", "data=2,tp=4"])
    _one_line_error(capsys, e, "--mesh", "data=N,fsdp=M")
    with pytest.raises(SystemExit) as e:
        finetune.main(SMALL + ["--mesh", "fsdp=16", "--out", str(tmp_path / "o")])
    _one_line_error(capsys, e, "--mesh fsdp=16", f"{jax.device_count()} are visible")
    with pytest.raises(SystemExit) as e:
        finetune.main(SMALL + ["--mesh", "data=1,fsdp=3", "--out", str(tmp_path / "o")])
    _one_line_error(capsys, e, "--batch-size 8", "data * fsdp = 3")


@pytest.mark.slow
def test_config_file_run_with_a_flag_override(tmp_path):
    """``python -m jmem finetune --config-file f.yaml --steps 2``: the file's options, the
    flag's steps; summary.json records the devices and the mesh."""
    cfg = tmp_path / "f.yaml"
    cfg.write_text(
        "model: {config: tiny}\ndata: {batch_size: 8, seq_len: 32}\n"
        "training: {lora_rank: 4, steps: 50}\n"
    )
    out = tmp_path / "run"
    argv = ["finetune", "--config-file", str(cfg), "--steps", "2", "--no-progress"]
    assert jmem_main(argv + ["--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    record = json.loads((out / "run.json").read_text())
    for versions in (summary["versions"], record["versions"]):
        assert versions["jax"] == jax.__version__ and versions["jmem"]
        assert set(versions) == {"jmem", "jax", "jaxlib", "flax", "optax"}
    assert summary["args"]["lora_rank"] == 4 and summary["args"]["seq_len"] == 32
    assert summary["devices"] == jax.device_count() == summary["mesh"]["fsdp"]
    assert summary["processes"] == 1


# -------------------------------------------------- nothing to learn, small files


def _chat(path, n=40):
    """``n`` chat examples of ~58 byte tokens whose response starts after token 40."""
    system = "You are a helpful assistant."
    with open(path, "w") as f:
        for i in range(n):
            msgs = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return str(path)


def test_examples_with_no_response_token_in_reach_are_refused(tmp_path, capsys):
    """The issue's smallest input: every response lies past --seq-len 16, so the run would
    train on nothing: one line, status 2, before anything is compiled or written."""
    data = _chat(tmp_path / "chat.jsonl")
    argv = ["--config", "tiny", "--data", data, "--seq-len", "16", "--batch-size", "2"]
    argv += ["--steps", "2", "--eval-split", "0", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        finetune.main(argv)
    err = _one_line_error(capsys, e, "none of the 40 training examples", "--seq-len")
    assert "longer --seq-len" in err and not (tmp_path / "o").exists()


def test_a_fraction_of_untrained_examples_is_counted(tmp_path, capsys):
    """Some examples lose their response: a notice and the counts (train.report, which
    summary.json records)."""
    long = {"prompt": "x" * 60, "completion": "y"}
    rows = [long] * 4 + [{"prompt": "q" * 12, "completion": "a" * 4}] * 12  # 6 rows
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = finetune.FinetuneConfig.from_flat(
        config="tiny", data=str(path), seq_len=32, batch_size=2, eval_split=0.0, steps=1
    )
    train, held = load_datasets(c, __import__("jmem").data.ByteTokenizer())
    counts = train.report["examples"]["train"]
    assert (counts["examples"], counts["untrained"], counts["truncated"]) == (16, 4, 4)
    assert held is None and "eval_skipped" not in train.report
    assert "note: 4 of 16 training examples keep no response token" in capsys.readouterr().out


def test_small_text_and_example_files_hold_out_what_they_can(tmp_path, capsys):
    """Default --eval-split 0.05 on small files: at least one row (text) or example is held
    out and evaluated in a batch smaller than --batch-size; when the data cannot spare one,
    evaluation is skipped with a notice (and the reason goes to summary.json)."""
    tok = __import__("jmem").data.ByteTokenizer()
    text = tmp_path / "t.txt"
    text.write_text(
        "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(60))
    )
    c = finetune.FinetuneConfig.from_flat(data=str(text), seq_len=128, batch_size=16)
    train, held = load_datasets(c, tok)
    assert held is not None and held.batch_size < 16 and held.batches_per_epoch == 1
    assert train.batches_per_epoch >= 1 and "eval_skipped" not in train.report
    tight = tmp_path / "tight.txt"
    tight.write_text("x" * (16 * 129 + 50))
    train, held = load_datasets(
        finetune.FinetuneConfig.from_flat(data=str(tight), seq_len=128, batch_size=16), tok
    )
    assert held is None and "no row of 129 tokens" in train.report["eval_skipped"]
    assert "note: evaluation skipped" in capsys.readouterr().out
    sft = helpers.sft_jsonl(tmp_path / "sft.jsonl", n=5)
    c = finetune.FinetuneConfig.from_flat(data=sft, seq_len=32, batch_size=2, eval_split=0.1)
    train, held = load_datasets(c, tok)
    assert held is not None and train.report["examples"]["held_out"]["examples"] == 1


def _first_full_line(row) -> int:
    """The number of the first line that starts inside a window of byte tokens."""
    return int(bytes(np.asarray(row, np.uint8)).decode().split("\n")[1][:5])


def test_held_out_windows_and_examples_come_from_across_the_data(tmp_path):
    """--eval-split holds out windows (text) or examples drawn at random across the file,
    never its tail: a file sorted by topic is evaluated on all of its parts."""
    tok = __import__("jmem").data.ByteTokenizer()
    text = tmp_path / "sorted.txt"
    text.write_text("".join(f"{i:05d} the quick brown fox jumps over it.\n" for i in range(3000)))
    c = finetune.FinetuneConfig.from_flat(data=str(text), seq_len=63, batch_size=4, eval_split=0.1)
    train, held = load_datasets(c, tok)
    held_lines = [_first_full_line(r) for r in held.rows["inputs"]]
    train_lines = {_first_full_line(r) for r in train.rows["inputs"]}
    assert len(held.rows["inputs"]) == int(len(text.read_bytes()) * 0.1) // 64
    assert min(held_lines) < 300 and max(held_lines) > 2700, held_lines
    assert not set(held_lines) & train_lines  # disjoint windows
    sft = helpers.sft_jsonl(tmp_path / "sft.jsonl", n=200)
    c = finetune.FinetuneConfig.from_flat(data=sft, seq_len=32, batch_size=2, eval_split=0.1)
    prompts = [json.loads(x)["prompt"] for x in open(sft)]
    held_ex = __import__("jmem._src.finetune.datasets", fromlist=["x"])._split_examples(c, prompts)[
        1
    ]
    where = sorted(prompts.index(p) for p in held_ex)
    assert len(where) == 20 and where[0] < 40 and where[-1] > 160, where


@pytest.mark.slow
def test_first_run_on_a_60_line_text_file_trains_and_evaluates(tmp_path):
    """A new user's first run: their own 60-line file and the default flags (two steps)."""
    text = tmp_path / "notes.txt"
    lines = [
        f"Note {i}: remember to water the plants and call the office about the report.\n"
        for i in range(60)
    ]
    text.write_text("".join(lines))
    out = tmp_path / "run"
    summary = finetune.main(
        ["--data", str(text), "--steps", "2", "--no-progress", "--out", str(out)]
    )
    assert len(summary["losses"]) == 2 and np.isfinite(summary["last_eval_loss"])
    assert [s for s, _ in summary["eval_losses"]] == [0, 2]  # before and after: 2 steps


@pytest.mark.slow
def test_long_context_flags_reach_the_model_and_train_as_dense(tmp_path):
    """--attention/--loss-chunk/--token-chunk set the run's levers (not the model config),
    and a run with blockwise attention and chunked loss/MLP trains to the dense run's
    losses (bf16 compute: within 2e-2 nats)."""
    from jmem._src.finetune.setup import job_levers
    from jmem._src.finetune.setup import model_config
    from jmem.models import llama

    c = parse_args(["--config", "tiny", "--attention", "blockwise", "--loss-chunk", "0"])
    lv = job_levers(c)
    assert (lv.attention, lv.loss_chunk, lv.token_chunk) == ("blockwise", 0, 2048)
    assert model_config(c) == llama.get_config("tiny")
    c = parse_args(["--config", "tiny", "--mlp-chunk", "64"])  # the deprecated name
    assert job_levers(c).token_chunk == 64 == c.execution.token_chunk
    argv = SMALL + ["--steps", "2", "--eval-split", "0", "--mesh", "fsdp=1"]
    dense = finetune.main(
        argv
        + ["--attention", "dense", "--loss-chunk", "0", "--token-chunk", "0"]
        + ["--out", str(tmp_path / "dense")]
    )
    tiled = finetune.main(
        argv
        + ["--attention", "blockwise", "--loss-chunk", "64", "--token-chunk", "64"]
        + ["--out", str(tmp_path / "tiled")]
    )
    np.testing.assert_allclose(tiled["losses"], dense["losses"], atol=2e-2)
    assert tiled["args"]["attention"] == "blockwise" and tiled["args"]["loss_chunk"] == 64


# ---------------------------------------------------------------------------- LoRA dropout


@pytest.mark.slow
def test_lora_dropout_key_per_step_and_none_at_evaluation():
    """--lora-dropout: the state carries the run's dropout key (from --seed), the train step
    gives the loss a key per step (same step: same loss; another step: another), and the
    loss without a key (evaluation) applies no dropout (the loss of dropout 0)."""
    from jmem import lora
    from jmem._src import lora_modules
    from jmem.models import llama

    c = finetune.FinetuneConfig.from_flat(
        config="tiny", steps=4, lr=1e-3, batch_size=4, grad_accum=2, lora_dropout=0.5
    )
    c = c.replace(lora_alpha=16.0)
    cfg = llama.get_config("tiny")
    _, loss_fn, dtype, _ = build(c, cfg)
    frozen = quantized_base(c, cfg, dtype, abstract=False)
    modules = lora_modules.modules(c.training.lora_targets)
    a = lora.init(jax.random.key(1), frozen, rank=4, alpha=16.0, modules=modules, dropout=0.5)
    a = jax.tree.map(lambda x: x + 0.05, a)  # non-zero B: dropout shows
    a0 = lora.init(jax.random.key(1), frozen, rank=4, alpha=16.0, modules=modules)
    a0 = jax.tree.map(lambda x: x + 0.05, a0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (4, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    from jmem._src.finetune.build import dropout_key

    assert dropout_key(c.replace(lora_dropout=0.0)) is None
    k3, k4 = (jax.random.fold_in(dropout_key(c), s) for s in (3, 4))
    loss = jax.jit(lambda a, b, k: loss_fn(a, b, frozen=frozen, dropout_key=k))
    evaluate = jax.jit(lambda a, b: loss_fn(a, b, frozen=frozen))
    assert float(loss(a, batch, k3)) == float(loss(a, batch, k3))
    assert float(loss(a, batch, k3)) != float(loss(a, batch, k4))
    assert float(evaluate(a, batch)) == float(evaluate(a0, batch))  # evaluation: no dropout
    assert float(loss(a, batch, k3)) != float(evaluate(a, batch))


@pytest.mark.slow
def test_lora_dropout_run_resumes_bitwise(tmp_path):
    """--lora-dropout 0.1: the masks come from --seed and the step, so an interrupted and
    resumed run gives the uninterrupted run's losses bit for bit (and not dropout 0's)."""
    out = str(tmp_path / "run")
    argv = SMALL + ["--steps", "4", "--save-every", "2", "--eval-split", "0", "--mesh", "fsdp=1"]
    full = finetune.main(argv + ["--lora-dropout", "0.1", "--out", out])
    shutil.rmtree(os.path.join(out, "checkpoints", "4"))
    resumed = finetune.main(argv + ["--lora-dropout", "0.1", "--out", out, "--resume"])
    assert resumed["losses"] == full["losses"]
    plain = finetune.main(argv + ["--out", str(tmp_path / "plain")])
    assert plain["losses"][1:] != full["losses"][1:]


# --------------------------------------------------------------------- mesh (8 CPU devices)


def _fraction_per_device(tree):
    """Bytes on device 0 over the bytes of the whole (global) tree."""
    leaves = jax.tree.leaves(tree)
    return sum(x.addressable_shards[0].data.nbytes for x in leaves) / sum(x.nbytes for x in leaves)


_MESH_RUN = SMALL + ["--steps", "4", "--save-every", "2", "--eval-split", "0"]


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    """A 4-step run on an FSDP mesh of the 8 simulated devices, checkpoints 2 and 4:
    ``(out, summary)``. Tests copy ``out`` before changing it."""
    out = tmp_path_factory.mktemp("eight") / "run"
    return out, finetune.main(_MESH_RUN + ["--mesh", "data=1,fsdp=8", "--out", str(out)])


@pytest.mark.slow
def test_eight_devices_train_as_one_and_hold_an_eighth_of_the_state(eight_devices, tmp_path):
    """FSDP over 8 simulated devices gives the 1-device losses within 2e-3 nats (bf16
    compute; the reductions run in another order). Each device holds 1/8 of the frozen NF4
    base (plus the replicated norm scales) and of the optimizer state's moments wherever
    their 8-bit blocks divide by 8 (the `tiny` model's 688-wide matrices have 43 blocks, so
    those stay whole; Llama-2-7B's all divide); the LoRA adapters themselves are replicated
    (jmem.sharding: small, and every device needs all of them)."""
    assert jax.device_count() == 8
    one = finetune.main(_MESH_RUN + ["--mesh", "fsdp=1", "--out", str(tmp_path / "one")])
    eight = eight_devices[1]
    np.testing.assert_allclose(eight["losses"], one["losses"], atol=2e-3)
    assert (one["devices"], eight["devices"]) == (1, 8)
    assert eight["mesh"] == {"data": 1, "fsdp": 8}
    from jmem import sharding
    from jmem.models import llama

    c = finetune.FinetuneConfig.from_flat(
        config="tiny", steps=1, lr=1e-3, lora_alpha=8.0, lora_rank=4
    )
    cfg = llama.get_config("tiny")
    step, _, dtype, _ = build(c, cfg, mesh=sharding.make_mesh(1, 8))
    state = init_state(c, cfg, step, dtype, None, None)[0]
    assert _fraction_per_device(state.frozen) < 0.13
    assert _fraction_per_device(state.opt_state) < 0.65
    assert _fraction_per_device(state.params) == 1.0


@pytest.mark.slow
def test_a_run_saved_on_eight_devices_resumes_on_four(eight_devices, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(eight_devices[0], out)
    full = eight_devices[1]
    shutil.rmtree(out / "checkpoints" / "4")
    resumed = finetune.main(_MESH_RUN + ["--mesh", "fsdp=4", "--out", str(out), "--resume"])
    np.testing.assert_array_equal(resumed["losses"][:2], full["losses"][:2])  # restored
    np.testing.assert_allclose(resumed["losses"], full["losses"], atol=2e-3)
    assert resumed["mesh"] == {"data": 1, "fsdp": 4}


@pytest.mark.slow
def test_dry_run_reports_per_device_memory_for_the_mesh(tmp_path):
    """The dry run compiles for the mesh given and reports one device's bytes: on 8 devices
    the arguments are under 40% of one device's (the `tiny` model's replicated adapters and
    norm scales are the rest; at 7B the NF4 base dominates and it is split 8 ways)."""
    argv = ["--config", "tiny", "--dry-run", "--seq-len", "64", "--batch-size", "8"]
    one = finetune.main(argv + ["--mesh", "fsdp=1", "--out", str(tmp_path / "a")])
    eight = finetune.main(argv + ["--mesh", "fsdp=8", "--out", str(tmp_path / "b")])
    assert eight["mesh"] == {"data": 1, "fsdp": 8} and eight["per_device"]
    args1, args8 = one["compiled"]["argument_bytes"], eight["compiled"]["argument_bytes"]
    assert args8 < 0.4 * args1, (args8, args1)


# ------------------------------------------------------------------- two processes (gloo)


def _two_processes(argv, timeout=300):
    """``jmem finetune argv`` in 2 processes of 2 CPU devices each, joined by
    ``--coordinator``; returns their outputs (asserting both exit 0)."""
    worker = os.path.join(os.path.dirname(__file__), "_finetune_worker.py")
    common = ["--coordinator", f"127.0.0.1:{helpers.free_port()}", "--num-processes", "2"]
    argvs = [[worker, *argv, *common, "--process-id", str(i)] for i in range(2)]
    return helpers.run_processes(argvs, timeout=timeout)


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume(tmp_path):
    """2 processes x 2 CPU devices: one FSDP mesh of 4, process 0 alone prints (process 1's
    output is empty, gloo's lines included) and writes the summary and adapters,
    checkpoints are written and restored by both; a resumed run continues from step 2 with
    the losses it had."""
    if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
        pytest.skip("this JAX has no gloo CPU collectives")
    out = str(tmp_path / "run")
    argv = SMALL + ["--save-every", "2", "--eval-split", "0.05", "--out", out]
    logs = _two_processes(argv + ["--steps", "2"])
    # process 1 prints nothing, gloo's connection lines included (process 0 prints the run
    # and, unavoidably, its own gloo lines)
    assert "first loss" in logs[0]
    assert "[Gloo]" not in logs[1] and "first loss" not in logs[1], logs[1][-2000:]
    first = json.loads(open(os.path.join(out, "summary.json")).read())
    assert first["processes"] == 2 and first["devices"] == 4
    assert first["mesh"] == {"data": 1, "fsdp": 4} and len(first["losses"]) == 2
    assert os.path.exists(os.path.join(out, "adapter", "adapter_config.json"))
    logs = _two_processes(argv + ["--steps", "4", "--resume"])
    assert "Resumed at step 2" in logs[0]
    assert "[Gloo]" not in logs[1] and "Resumed" not in logs[1], logs[1][-2000:]
    second = json.loads(open(os.path.join(out, "summary.json")).read())
    assert second["losses"][:2] == first["losses"] and len(second["losses"]) == 4
    assert all(np.isfinite(second["losses"])) and np.isfinite(second["last_eval_loss"])


@pytest.mark.slow
def test_no_remat_inlines_the_layers():
    """--remat none: the job's loss runs the model with ``scan_unroll=True`` (a layer loop
    would stack every saved activation), with the loss of the layer loop."""
    from jmem.models import llama

    cfg = llama.get_config("tiny")
    tokens = np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    losses, scans = {}, {}
    for remat in ("none", "full"):
        c = finetune.FinetuneConfig.from_flat(
            config="tiny", steps=4, lr=1e-3, remat=remat, lora_alpha=16.0
        )
        _, loss_fn, dtype, _ = build(c, cfg)
        frozen = quantized_base(c, cfg, dtype, abstract=False)
        jaxpr = jax.make_jaxpr(lambda b: loss_fn(None, b, frozen=frozen))(batch).jaxpr
        scans[remat] = [e.params["unroll"] for e in jaxpr.eqns if e.primitive.name == "scan"]
        losses[remat] = float(jax.jit(lambda b: loss_fn(None, b, frozen=frozen))(batch))
    assert scans["none"] and all(u >= cfg.num_layers or u is True for u in scans["none"])
    assert scans["full"] == [1] * len(scans["full"])
    # bf16 compute (the job's default): XLA fuses inlined layers differently (1.4e-4
    # measured); float32 equality is tests/test_llama.py::ScanUnrollTest.
    assert abs(losses["none"] - losses["full"]) < 2e-3
