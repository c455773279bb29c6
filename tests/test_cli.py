"""Command lines: every bad input exits with status 2 and one line ``error: ...`` naming the
flag or file, before anything is compiled or written (examples/qlora_7b.py and
``python -m jmem estimate``); defaults are filled with ``is None``, sized for the device."""

import json
import os
import re
import subprocess
import sys

import helpers
import pytest

from jmem import data
from jmem import finetune
from jmem import planner
from jmem.__main__ import main as jmem_main
from jmem._src.cli import CliError
from jmem._src.finetune.config_file import parse_args
from jmem._src.finetune.datasets import load_datasets
from jmem._src.finetune.rundir import prepare_out
from jmem._src.finetune.setup import check_outputs
from jmem._src.finetune.setup import model_config
from jmem._src.finetune.setup import resolve_defaults

_ROOT = os.path.join(os.path.dirname(__file__), "..")
_EXAMPLE = os.path.join(_ROOT, "examples", "qlora_7b.py")


@pytest.fixture(scope="module")
def example():
    """The job's package (``jmem finetune``; examples/qlora_7b.py only calls it)."""
    return finetune


def _config_json(directory, vocab_size=128, max_position_embeddings=512):
    """A tiny Llama config.json (no weights: every check here runs before they are read)."""
    os.makedirs(directory, exist_ok=True)
    cfg = {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(directory)


_one_line_error = helpers.one_line_error


def _files(tmp_path):
    """Inputs for the bad-input table, written once per test."""
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (tmp_path / "notext.jsonl").write_text('{"title": "no text field"}\n')
    _config_json(tmp_path / "no_tokenizer")
    return tmp_path


#: (argv, words the one-line error must contain). {t} is the test's tmp_path.
BAD_EXAMPLE_INPUTS = {
    "missing checkpoint dir": (["--checkpoint", "{t}/nowhere"], ["--checkpoint", "no such"]),
    "checkpoint without config.json": (["--checkpoint", "{t}"], ["--checkpoint", "config.json"]),
    "csv data": (["--data", "{t}/data.csv"], ["--data", "data.csv", ".txt or .jsonl"]),
    "empty txt": (["--data", "{t}/empty.txt"], ["--data", "empty.txt", "no text"]),
    "missing data file": (["--data", "{t}/missing.txt"], ["--data", "missing.txt", "no such"]),
    "broken jsonl line": (["--data", "{t}/broken.jsonl"], ["--data", "broken.jsonl:2"]),
    "jsonl without text": (["--data", "{t}/notext.jsonl"], ["--data", "notext.jsonl:1"]),
    "negative lora rank": (["--lora-rank=-1"], ["--lora-rank", "integer >= 0"]),
    "lora targets match nothing": (["--lora-targets", ".*nomatch.*"], ["--lora-targets"]),
    "lora targets bad regex": (["--lora-targets", "(q_proj"], ["--lora-targets", "regex"]),
    "checkpoint without tokenizer": (
        ["--checkpoint", "{t}/no_tokenizer"],
        ["--checkpoint", "tokenizer.json", "--tokenizer DIR"],
    ),
    "missing tokenizer dir": (["--tokenizer", "{t}/nowhere"], ["--tokenizer", "no such"]),
    "seq len 0": (["--seq-len", "0"], ["--seq-len", "positive integer"]),
    "batch size 0": (["--batch-size", "0"], ["--batch-size", "positive integer"]),
    "grad accum 0": (["--grad-accum", "0"], ["--grad-accum", "positive integer"]),
    "grad accum not dividing": (["--batch-size", "3", "--grad-accum", "2"], ["--grad-accum"]),
    "negative steps": (["--steps", "-3"], ["--steps", "positive integer"]),
    "steps not a number": (["--steps", "ten"], ["--steps", "'ten'"]),
    "eval split 1": (["--eval-split", "1"], ["--eval-split", "[0, 1)"]),
    "zero learning rate": (["--lr", "0"], ["--lr", "positive"]),
    "config and checkpoint": (["--config", "tiny", "--checkpoint", "{t}"], ["--checkpoint"]),
    "resume and overwrite": (["--resume", "--overwrite"], ["--overwrite", "--resume"]),
    "resume without checkpoint": (["--resume"], ["--resume", "no checkpoint"]),
    "export into a non-empty dir": (["--export-merged", "{t}"], ["--export-merged", "not empty"]),
    "empty sample prompt": (["--sample-prompt", ""], ["--sample-prompt", "no tokens"]),
    "sample tokens 0": (["--sample-tokens", "0"], ["--sample-tokens", "positive integer"]),
    "sizes larger than the data": (["--data", "{t}/small.txt"], ["--data", "--batch-size"]),
}


@pytest.mark.parametrize("case", sorted(BAD_EXAMPLE_INPUTS))
def test_example_bad_input_is_one_line_and_status_2(example, tmp_path, capsys, case):
    argv, words = BAD_EXAMPLE_INPUTS[case]
    t = _files(tmp_path)
    (t / "small.txt").write_text("only a few bytes of text")
    argv = [a.format(t=t) for a in argv] + ["--no-progress", "--out", str(t / "out")]
    with pytest.raises(SystemExit) as e:
        example.main(argv)
    _one_line_error(capsys, e, *words)
    assert not (t / "out").exists(), "a refused run writes nothing"


def test_tokenizer_larger_than_the_model_vocabulary(example, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(300)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    os.makedirs(tmp_path / "tok")
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    argv = ["--config", "tiny", "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        example.main(argv)
    _one_line_error(capsys, e, "--tokenizer", "300 tokens", "256")


def test_out_holding_another_run_is_refused(example, tmp_path, capsys):
    """A new run never mixes its checkpoints with an older run's: --resume or --overwrite."""
    out = tmp_path / "out"
    os.makedirs(out / "checkpoints" / "200")
    (out / "run.json").write_text(json.dumps({"lora_rank": 8}))
    with pytest.raises(SystemExit) as e:
        example.main(["--steps", "3", "--out", str(out)])
    _one_line_error(capsys, e, "--out", "[200]", "--resume", "--overwrite")
    # --resume with other shaping flags than the run in --out: named, with both values.
    with pytest.raises(SystemExit) as e:
        example.main(["--steps", "300", "--lora-rank", "4", "--resume", "--out", str(out)])
    _one_line_error(capsys, e, "--resume", "--lora-rank 4 (was 8)")
    assert os.path.isdir(out / "checkpoints" / "200")


def test_export_of_a_model_the_exporter_cannot_write_is_refused_before_training(example, tmp_path):
    """--export-merged runs after training: what it would refuse is refused up front."""
    from jmem.models import llama  # noqa: PLC0415

    cfg = llama.get_config("tiny", biases=("q_proj",))  # no transformers family has it
    args = parse_args(["--export-merged", str(tmp_path / "merged")])
    with pytest.raises(CliError, match="--export-merged .*biases"):
        check_outputs(args, cfg, data.ByteTokenizer())
    check_outputs(parse_args([]), cfg, data.ByteTokenizer())  # no export: ok


def test_overwrite_replaces_an_earlier_merged_checkpoint_only(example, tmp_path, capsys):
    """The same command twice: --overwrite may replace the run in --out and the merged
    checkpoint in --export-merged (nothing is deleted up front); a directory that is not a
    checkpoint is refused."""
    out, merged = tmp_path / "run", tmp_path / "merged"
    os.makedirs(out / "checkpoints" / "2")
    os.makedirs(merged)
    (merged / "config.json").write_text("{}")
    (merged / "model.safetensors").write_text("")
    argv = ["--out", str(out), "--export-merged", str(merged)]
    with pytest.raises(CliError, match="--export-merged .* --overwrite to replace it"):
        prepare_out(parse_args(argv))
    assert prepare_out(parse_args(argv + ["--overwrite"])) is None
    # kept: the run replaces them once it has succeeded (tests/test_faults.py)
    assert (merged / "config.json").exists() and (out / "checkpoints" / "2").is_dir()
    for name in ("config.json", "model.safetensors"):
        os.remove(merged / name)
    (merged / "notes.txt").write_text("mine")
    with pytest.raises(CliError, match="not a checkpoint; pass a new directory"):
        prepare_out(parse_args(argv + ["--overwrite"]))
    assert (merged / "notes.txt").read_text() == "mine"


def test_debug_keeps_the_traceback(example, tmp_path):
    with pytest.raises(CliError, match="--data"):
        example.main(["--data", str(tmp_path / "missing.txt"), "--debug", "--out", str(tmp_path)])


def test_defaults_are_filled_with_is_none_and_sized_for_the_device(example, tmp_path):
    """A --checkpoint run on CPU takes its shapes from config.json and CPU-sized defaults;
    on a GPU the 7B sizes, capped at the model's max_seq_len; given values are kept."""
    ck = _config_json(tmp_path / "ck", max_position_embeddings=512)
    args = parse_args(["--checkpoint", ck])
    cfg = model_config(args)
    assert (cfg.vocab_size, cfg.num_layers, cfg.max_seq_len) == (128, 2, 512)
    c, notes = resolve_defaults(args, cfg, on_gpu=False)
    assert (c.training.steps, c.data.batch_size, c.data.seq_len) == (200, 16, 128)
    assert c.training.lr == 2e-4 and c.data.eval_every == 20 and "CPU-sized" in notes[0]
    assert c.model.tokenizer == ck and c.training.lora_alpha == 16.0
    assert args == parse_args(["--checkpoint", ck])  # a new value; the given one kept
    c, _ = resolve_defaults(args, cfg, on_gpu=True)
    assert (c.training.steps, c.data.batch_size, c.data.seq_len) == (20, 1, 512)
    args = parse_args(["--checkpoint", ck, "--steps", "1", "--seq-len", "1024"])
    c, notes = resolve_defaults(args, cfg, on_gpu=False)
    assert (c.training.steps, c.data.seq_len, c.data.eval_every) == (1, 1024, 1)
    assert any("exceeds the model's max_seq_len 512" in n for n in notes)
    c, _ = resolve_defaults(parse_args([]), cfg, on_gpu=False)
    assert (c.model.config, c.model.tokenizer, c.training.lr) == ("tiny", "byte", 3e-3)
    # tiny_moe is CPU-sized and randomly initialised too: the same sizes and rate on a GPU
    c, _ = resolve_defaults(parse_args(["--config", "tiny_moe"]), cfg, on_gpu=True)
    assert (c.training.lr, c.data.batch_size, c.data.seq_len) == (3e-3, 16, 128)


@pytest.mark.slow
def test_example_entry_point_prints_no_traceback(tmp_path):
    """The script itself (``python examples/qlora_7b.py``): status 2, one line."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(_ROOT), JAX_PLATFORMS="cpu")
    argv = ["--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]
    r = subprocess.run(
        [sys.executable, _EXAMPLE, *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --data") and "Traceback" not in r.stderr


def test_instruction_data_trains_on_responses_only(example, tmp_path):
    """--data sft.jsonl: packed examples whose mask is 1 exactly on the completions."""
    sft = helpers.sft_jsonl(tmp_path / "sft.jsonl")
    args = parse_args(
        ["--data", sft, "--seq-len", "32", "--batch-size", "4", "--eval-split", "0.2"]
    )
    args, _ = resolve_defaults(args, model_config(args), on_gpu=False)
    train, held = load_datasets(args, data.ByteTokenizer())
    completions = {json.loads(line)["completion"] for line in open(sft)}
    batch = train.batch_at(data.Position())[0]
    assert set(batch) >= {"inputs", "targets", "mask", "segment_ids", "positions"}
    for row in range(batch["targets"].shape[0]):
        seg, mask, tgt = batch["segment_ids"][row], batch["mask"][row], batch["targets"][row]
        for s in set(seg[seg > 0].tolist()):
            trained = tgt[(seg == s) & (mask > 0)]
            assert data.ByteTokenizer().decode(trained) in completions
    assert held is not None and held.batches_per_epoch >= 1


# ------------------------------------------------------------------- python -m jmem estimate

BAD_ESTIMATE_INPUTS = {
    "unknown model": (["--model", "llama9"], ["--model", "llama9"]),
    "zero model": (["--model", "0"], ["--model"]),
    "seq len 0": (["--model", "7B", "--seq-len", "0"], ["--seq-len", "positive integer"]),
    "batch size -1": (["--model", "7B", "--batch-size", "-1"], ["--batch-size"]),
    "shards 0": (["--model", "7B", "--shards", "0"], ["--shards"]),
    "lora rank -1": (["--model", "7B", "--lora-rank", "-1"], ["--lora-rank"]),
    "lora target": (["--model", "7B", "--lora-targets", "qproj"], ["--lora-targets", "qproj"]),
    "memory": (["--model", "7B", "--memory", "lots"], ["--memory", "'lots'"]),
    "memory without unit": (["--model", "7B", "--memory", "24"], ["--memory", "unit"]),
    "reserve": (["--model", "7B", "--reserve", "x"], ["--reserve"]),
    "activation budget": (["--model", "7B", "--activation-budget", "6XB"], ["--activation"]),
    "unknown optimizer": (["--model", "7B", "--optimizer", "adamw,sgdd"], ["--optimizer", "sgdd"]),
    "empty optimizer list": (["--model", "7B", "--optimizer", ","], ["--optimizer"]),
    "unknown remat": (["--model", "7B", "--remat", "most"], ["--remat", "most"]),
    "param dtype": (["--model", "7B", "--param-dtype", "int8"], ["--param-dtype", "nf4"]),
    "quant without lora": (
        ["--model", "7B", "--lora-rank", "0", "--quant", "nf4"],
        ["--quant", "--lora-rank"],
    ),
    "hidden size 0": (["--model", "7B", "--hidden-size", "0"], ["--hidden-size"]),
    "shape for a config": (["--model", "tiny", "--num-layers", "3"], ["--num-layers"]),
}


@pytest.mark.parametrize("case", sorted(BAD_ESTIMATE_INPUTS))
def test_estimate_bad_input_is_one_line_and_status_2(capsys, case):
    argv, words = BAD_ESTIMATE_INPUTS[case]
    with pytest.raises(SystemExit) as e:
        jmem_main(["estimate", *argv])
    _one_line_error(capsys, e, *words)


def test_estimate_unknown_model_lists_names_once_with_a_suggestion(capsys):
    """A typo (``llama2-7b``): one list of the model names, and the closest one."""
    with pytest.raises(SystemExit) as e:
        jmem_main(["estimate", "--model", "llama2-7b"])
    err = _one_line_error(capsys, e, "--model", "'llama2-7b'", "did you mean 'llama2_7b'?")
    names = re.findall(r"[\w.]+", err)
    assert names.count("tiny") == 1 and names.count("llama3_8b") == 1, err


def test_estimate_debug_keeps_the_traceback():
    with pytest.raises(ValueError, match="lora"):
        jmem_main(["estimate", "--model", "7B", "--lora-rank", "0", "--quant", "nf4", "--debug"])


@pytest.mark.parametrize("optimizer, static_gb", [("adamw", 112.0), ("adamw_8bit", 70.0)])
def test_estimate_prints_the_static_subtotal(capsys, optimizer, static_gb):
    """params + grads + optimizer state + masters: the seeds' 112 GB / 70 GB for 7B."""
    argv = ["--model", "7B", "--accounting", "nominal", "--optimizer", optimizer]
    assert jmem_main(["estimate", *argv, "--lora-rank", "0"]) == 0  # full fine-tuning
    out = capsys.readouterr().out
    m = re.search(
        r"static \(params \+ grads \+ optimizer state \+ master weights\): ([\d.]+) GB", out
    )
    assert m and float(m.group(1)) == pytest.approx(static_gb, abs=1e-3), out
    led = planner.estimate("7B", accounting="nominal", optimizer=optimizer)
    assert float(m.group(1)) == pytest.approx(led.static / 10**9, abs=1e-3)
    assert led.total > led.static  # the table's total adds the activations


@pytest.mark.slow
def test_estimate_entry_point_status_2():
    env = dict(os.environ, PYTHONPATH=os.path.abspath(_ROOT), JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-m", "jmem", "estimate", "--model", "7B", "--seq-len", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: argument --seq-len")


#: Refused after argparse but before any line is printed: (argv, words of the one line).
SILENT_ESTIMATE_REFUSALS = {
    "reserve over memory": (
        ["--model", "llama2_7b", "--memory", "24GiB", "--reserve", "30GB"],
        ["error: --reserve 30 GB", "--memory 25.77 GB (24 GiB)"],
    ),
    "param dtype": (
        ["--model", "llama2_7b", "--param-dtype", "int3"],
        ["--param-dtype", "'int3'", "bf16, fp16, fp32"],
    ),
    "params alone under full fine-tuning": (
        ["--model", "llama2_7b", "--lora-rank", "0", "--offload", "params"],
        ["--offload params", "--lora-rank 0", "pass --offload optimizer,params"],
    ),
    "shape for a config, both phases": (
        ["--model", "tiny", "--num-layers", "3", "--objective", "grpo", "--batch-size", "8"],
        ["--num-layers", "parameter count"],
    ),
    "shape for a config": (["--model", "tiny", "--num-layers", "3"], ["--num-layers"]),
    "two state rungs": (
        ["--model", "llama2_7b", "--offload", "optimizer,optimizer+masters"],
        ["--offload", "optimizer,params"],
    ),
}


@pytest.mark.parametrize("case", sorted(SILENT_ESTIMATE_REFUSALS))
def test_estimate_refusal_prints_nothing_before_its_one_line(capsys, case):
    """No ``== optimizer=... ==`` header before the error; the flag named as typed, sizes
    in GB/GiB (not bytes), no unit hint where units were given, no ``'full'`` dtype."""
    argv, words = SILENT_ESTIMATE_REFUSALS[case]
    with pytest.raises(SystemExit) as e:
        jmem_main(["estimate", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", out
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
    for w in ("bytes", "forget a unit", "'full'", "error: reserve"):
        assert w not in err, (w, err)


def _total_gb(out: str) -> float:
    """The ``total (device)`` GB of ``jmem estimate``'s one table."""
    return float(re.search(r"total \(device\) +([\d.]+)", out).group(1))


@pytest.mark.parametrize("flag", ["optimizer,params", "optimizer+masters,params", "optimizer"])
def test_estimate_offload_optimizer_moves_the_masters_as_the_job_does(capsys, flag):
    """``--offload optimizer`` is the job's: the optimizer state and the fp32 masters (the
    planner's ``optimizer+masters``), the old spelling read the same."""
    argv = ["estimate", "--model", "llama2_7b", "--lora-rank", "0", "--offload", flag]
    assert jmem_main(argv) == 0
    got = _total_gb(capsys.readouterr().out)
    rung = flag.replace("optimizer+masters", "optimizer").replace("optimizer", "optimizer+masters")
    kw = dict(optimizer="adamw_8bit", levers=jmem_levers(), master_weights=None)
    want = planner.estimate("llama2_7b", offload=rung, **kw).total
    state_only = planner.estimate("llama2_7b", offload=flag.replace("+masters", ""), **kw)
    assert got == pytest.approx(want / 1e9, abs=1e-3)
    assert state_only.total > want  # the state-only rung is another (planner-only) figure


def jmem_levers():
    """The job's levers, as ``jmem estimate`` passes them (``--remat full``)."""
    from jmem._src.finetune.config import FinetuneConfig
    from jmem._src.finetune.setup import job_levers

    return job_levers(FinetuneConfig.from_flat(remat="full"))


def test_estimate_help_names_what_each_offload_value_moves(capsys):
    """One metavar, no ``{a,b,c}`` choices whose commas read as separators; every value
    and what it moves."""
    with pytest.raises(SystemExit):
        jmem_main(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--offload WHAT" in text and "{optimizer" not in text
    for w in ("optimizer (the optimizer state and the fp32 masters", "optimizer,params (both)"):
        assert w in text, w


def test_job_offload_dir_refusal_prints_nothing_before_its_one_line(tmp_path, capsys):
    """A bad ``--offload-dir`` path: no ``offload: ... on disk under`` line first."""
    argv = ["--config", "tiny", "--offload-dir", str(tmp_path / "no" / "x"), "--no-progress"]
    with pytest.raises(SystemExit) as e:
        finetune.main(argv + ["--out", str(tmp_path / "out"), "--host-allocator", "system"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", out
    assert err.startswith("error: --offload-dir") and err.count("\n") == 1, err
    assert not (tmp_path / "no").exists() and not (tmp_path / "out").exists()
