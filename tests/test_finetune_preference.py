"""``jmem finetune --objective dpo|orpo|simpo``: the flags and their one-line errors, preference
pairs in TRL's formats (prompt tokens masked, chosen and rejected as ``[2, S]`` rows), the bad
data errors, and runs on a toy separable set (tests/data/prefs.jsonl): DPO's first loss is
ln 2 (the adapters' B at zero: the policy is its reference), accuracy rises, the adapter
loads in PEFT, resume checks the objective, ORPO and SimPO train."""

import contextlib
import io
import json
import math
import os

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import data as jdata
from jmem import finetune
from jmem._src.cli import CliError
from jmem._src.finetune.config_file import parse_args
from jmem._src.finetune.datasets import load_datasets

HERE = os.path.dirname(__file__)
PREFS = os.path.join(HERE, "data", "prefs.jsonl")  # 32 text pairs, separable by wording
CHAT = os.path.join(HERE, "data", "prefs_chat.jsonl")  # 8 conversational pairs
SMALL = ["--config", "tiny", "--batch-size", "4", "--seq-len", "48", "--lora-rank", "4"]
SMALL += ["--no-progress", "--lr", "3e-3", "--eval-every", "10", "--eval-batches", "1"]


def _text(ids) -> str:
    return bytes(np.asarray(ids, np.uint8)).decode()


# ------------------------------------------------------------------------------ the flags

BAD_FLAGS = {
    "beta with sft": (["--beta", "0.2"], ["--beta", "--objective dpo|orpo|simpo", "not sft"]),
    "ipo with orpo": (["--objective", "orpo", "--loss-type", "ipo"], ["--loss-type", "dpo"]),
    "gamma with dpo": (["--objective", "dpo", "--simpo-gamma", "0.5"], ["--simpo-gamma"]),
    "smoothing with ipo": (
        ["--objective", "dpo", "--loss-type", "ipo", "--label-smoothing", "0.1"],
        ["--label-smoothing", "sigmoid only"],
    ),
    "smoothing range": (["--objective", "dpo", "--label-smoothing", "0.5"], ["[0, 0.5)"]),
    "negative beta": (["--objective", "dpo", "--beta", "-1"], ["--beta", "positive"]),
    "unknown objective": (["--objective", "kto"], ["--objective", "kto"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_objective_flags_are_one_line(capsys, case):
    argv, words = BAD_FLAGS[case]
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    helpers.one_line_error(capsys, e, *words)


def test_objective_options_in_a_config_file_and_python(tmp_path):
    (tmp_path / "f.yaml").write_text(
        "training: {objective: simpo, beta: 2.5, simpo_gamma: 0.8, label_smoothing: 0.1}\n"
    )
    t = parse_args(["--config-file", str(tmp_path / "f.yaml")]).training
    assert (t.objective, t.beta, t.simpo_gamma, t.label_smoothing) == ("simpo", 2.5, 0.8, 0.1)
    with pytest.raises(CliError, match=r"loss_type applies to objective dpo\|grpo, not simpo"):
        finetune.FinetuneConfig.from_flat(objective="simpo", loss_type="ipo")
    from jmem._src.finetune.build import preference_hyperparams
    from jmem._src.finetune.setup import resolve_defaults
    from jmem.models import llama

    c = finetune.FinetuneConfig.from_flat(config="tiny", objective="dpo", loss_type="ipo")
    c, _ = resolve_defaults(c, llama.get_config("tiny"), on_gpu=False)
    assert c.training.beta == 0.1  # resolved, so run.json and --resume compare it
    assert preference_hyperparams(c) == {"beta": 0.1, "loss_type": "ipo", "label_smoothing": 0.0}
    c = finetune.FinetuneConfig.from_flat(config="tiny", objective="simpo")
    c, _ = resolve_defaults(c, llama.get_config("tiny"), on_gpu=False)
    assert preference_hyperparams(c) == {"beta": 2.0, "gamma": 1.0, "label_smoothing": 0.0}


# ------------------------------------------------------------------------------ the data


def test_text_pairs_mask_the_prompt_and_keep_chosen_before_rejected():
    """Text pairs as TRL's standard format: prompt + answer verbatim, only the answer's
    tokens in completion_mask; axis 1 is (chosen, rejected)."""
    pairs = jdata.load_preferences(PREFS)
    rows, counts = jdata.pack_pairs(pairs[:3], jdata.ByteTokenizer(), 48)
    assert {k: v.shape for k, v in rows.items()} == {
        "inputs": (3, 2, 48),
        "targets": (3, 2, 48),
        "completion_mask": (3, 2, 48),
    }
    assert counts == {"pairs": 3, "truncated": 0, "max_tokens": 46}
    m = rows["completion_mask"] > 0
    assert _text(rows["targets"][0, 0][m[0, 0]]) == "Sure: rivers are lovely."
    assert _text(rows["targets"][0, 1][m[0, 1]]) == "No. rivers bore me!"
    prompt = len("Tell me about rivers.\n")
    assert _text(rows["inputs"][0, 0, :prompt]) == "Tell me about rivers.\n"
    assert not m[0, 0, : prompt - 1].any() and m[0, 0, prompt - 1]  # the first answer target
    # Cut at seq_len + 1 tokens: counted, the answer's start kept.
    _, counts = jdata.pack_pairs(pairs[:3], jdata.ByteTokenizer(), 30)
    assert counts["truncated"] == 6


def test_chat_pairs_use_the_template_and_an_implicit_prompt(tmp_path):
    """Conversational pairs: the prompt rendered with the generation prompt, the answer
    after it; without "prompt", the shared leading messages are the prompt."""
    pairs = jdata.load_preferences(CHAT)
    explicit, implicit = pairs[0], pairs[-1]
    assert implicit["prompt"] == [{"role": "user", "content": "About birds?"}]
    assert [m["role"] for m in implicit["chosen"]] == ["assistant"]
    rows, _ = jdata.pack_pairs([explicit, implicit], jdata.ByteTokenizer(), 64)
    m = rows["completion_mask"] > 0
    head = jdata.render_prompt("About rivers?", jdata.ByteTokenizer())
    assert _text(rows["inputs"][0, 0, : len(head)]) == head
    assert _text(rows["targets"][0, 0][m[0, 0]]) == "Sure: rivers are lovely."
    assert _text(rows["targets"][1, 1][m[1, 1]]) == "No. birds bore me!"
    # A .json file (an array of examples) reads as its .jsonl lines.
    (tmp_path / "p.json").write_text(json.dumps([json.loads(x) for x in open(CHAT)]))
    again = jdata.load_preferences(str(tmp_path / "p.json"))
    assert [p["chosen"] for p in again] == [p["chosen"] for p in pairs]


BAD_DATA = {
    "missing field": (
        '{"prompt": "a", "chosen": "b"}',
        [":2: missing field 'rejected'"],
    ),
    "missing prompt": ('{"chosen": "b", "rejected": "c"}', [":2: missing field 'prompt'"]),
    "identical": (
        '{"prompt": "a", "chosen": "same", "rejected": "same"}',
        [":2:", "identical"],
    ),
    "prompt too long": (
        json.dumps({"prompt": "x" * 60, "chosen": "y", "rejected": "z"}),
        [":2: the prompt is 60 tokens, longer than --seq-len 48", "longer --seq-len"],
    ),
    "mixed types": (
        '{"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}',
        [":2:", "must both be strings or both message lists"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_preference_data_is_one_line_naming_line_and_field(tmp_path, capsys, case):
    line, words = BAD_DATA[case]
    good = open(PREFS).readline()
    path = tmp_path / "p.jsonl"
    path.write_text(good + line + "\n" + good * 8)
    argv = SMALL + ["--objective", "dpo", "--data", str(path), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        finetune.main(argv + ["--eval-split", "0"])
    helpers.one_line_error(capsys, e, "--data", str(path), *words)
    assert not (tmp_path / "o").exists()


def test_a_preference_objective_needs_a_pair_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        finetune.main(SMALL + ["--objective", "orpo", "--out", str(tmp_path / "o")])
    helpers.one_line_error(capsys, e, "--objective orpo needs --data FILE.jsonl", "chosen")
    c = finetune.FinetuneConfig.from_flat(
        config="tiny", objective="dpo", data=PREFS, seq_len=48, batch_size=40
    )
    with pytest.raises(CliError, match="fewer than one batch of --batch-size 40"):
        load_datasets(c, jdata.ByteTokenizer())


def test_held_out_pairs_are_a_random_split():
    c = finetune.FinetuneConfig.from_flat(
        config="tiny", objective="dpo", data=PREFS, seq_len=48, batch_size=4, eval_split=0.25
    )
    train, held = load_datasets(c, jdata.ByteTokenizer())
    assert train.report["pairs"]["train"]["pairs"] == 24
    assert held.rows["inputs"].shape == (8, 2, 48) and held.batch_size == 4
    batch = train.batch_at(jdata.Position())[0]
    assert batch["inputs"].shape == (4, 2, 48) and "mask" not in batch  # pairs, not tokens
    held_text = {_text(r[0]) for r in held.rows["inputs"]}
    assert not held_text & {_text(r[0]) for r in train.rows["inputs"]}


# ------------------------------------------------------------------------------ the runs


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """``jmem finetune --config tiny --objective dpo --data prefs.jsonl --steps 20`` (small
    sizes), with --export-merged; returns (summary, out dir, merged dir, printed log)."""
    tmp = tmp_path_factory.mktemp("dpo")
    out, merged = tmp / "run", tmp / "merged"
    argv = SMALL + ["--objective", "dpo", "--data", PREFS, "--steps", "20", "--eval-split", "0.25"]
    argv += ["--save-every", "10", "--out", str(out), "--export-merged", str(merged)]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        summary = finetune.main(argv)
    return summary, out, merged, log.getvalue(), argv


@pytest.mark.slow
def test_dpo_run_starts_at_ln2_and_learns_the_toy_preferences(dpo_run):
    summary, out, _, log, _ = dpo_run
    assert summary["objective"] == "DPO" and summary["args"]["beta"] == 0.1
    assert abs(summary["losses"][0] - math.log(2)) < 1e-4  # B = 0: the policy is its reference
    first = summary["metrics"][0]
    # B = 0: the policy's log-probs are the reference's up to the rounding of two programs
    assert abs(first["rewards/margins"]) < 1e-5 and first["rewards/accuracies"] == 0
    late = [m["rewards/accuracies"] for m in summary["metrics"][-5:]]
    assert np.mean(late) > 0.5 and summary["last_metrics"]["rewards/margins"] > 0.5
    assert summary["losses"][-1] < 0.5 * math.log(2)
    evals = summary["eval_metrics"]
    assert [s for s, _ in evals] == [0, 10, 20] == [s for s, _ in summary["eval_losses"]]
    assert evals[0][1]["rewards/accuracies"] == 0 and evals[-1][1]["rewards/accuracies"] > 0.5
    assert summary["pairs"]["held_out"]["pairs"] == 8
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(20)) + [0, 10, 20]
    assert lines[19]["rewards/margins"] == summary["metrics"][19]["rewards/margins"]
    assert lines[-1]["eval/rewards/accuracies"] == evals[-1][1]["rewards/accuracies"]
    assert (out / "loss.png").stat().st_size > 0
    step_1 = next(x for x in log.splitlines() if x.startswith("step     1"))
    assert "margin 0.0000  acc 0.00  chosen 0.0000  rejected 0.0000" in step_1
    assert "eval loss" in log and "(accuracy" in log


@pytest.mark.slow
def test_dpo_adapter_loads_in_peft_and_the_merged_export_matches(dpo_run, tmp_path):
    """The adapters the run wrote, on the run's base (exported from its NF4 weights), give
    PEFT the logits jmem computes; --export-merged holds the base with them merged in."""
    torch = pytest.importorskip("torch", reason="PEFT's runtime")
    transformers = pytest.importorskip("transformers", reason="the base model for PEFT")
    peft = pytest.importorskip("peft", reason="loads the adapter the run wrote")
    from jmem import lora
    from jmem._src.finetune.build import quantized_base
    from jmem._src.finetune.setup import resolve_defaults
    from jmem.models import hf
    from jmem.models import llama

    _, out, merged, _, argv = dpo_run
    config, _ = resolve_defaults(parse_args(argv), llama.get_config("tiny"), on_gpu=False)
    cfg = llama.get_config("tiny")
    hf.save_params(str(tmp_path / "base"), quantized_base(config, cfg, jnp.bfloat16, False), cfg)
    params, _ = hf.load_params(str(tmp_path / "base"), cfg, dtype=jnp.float32)
    adapters = hf.load_adapters(str(out / "adapter"), params, cfg)
    adapters = jax.tree.map(lambda x: x.astype(jnp.float32), adapters)
    assert any(float(jnp.abs(w.b).max()) > 0 for w in adapters.values())  # trained
    tokens = np.frombuffer(b"Tell me about tea.\nSure: tea", np.uint8).astype(np.int32)[None]
    ours = lora.apply(lambda p, t: llama.forward(p, t, cfg))(params, adapters, tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "base"), dtype=torch.float32
    )
    model = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)
    merged_params, _ = hf.load_params(str(merged), cfg, dtype=jnp.float32)
    merged_logits = llama.forward(merged_params, jnp.asarray(tokens), cfg)
    np.testing.assert_allclose(np.asarray(merged_logits), theirs, atol=0.1)  # bf16 weights


@pytest.mark.slow
def test_dpo_resume_checks_the_objective_and_continues(dpo_run, capsys):
    summary, out, merged, _, argv = dpo_run
    argv = [a for a in argv if a not in ("--export-merged", str(merged))]
    for flag, value in (("--beta", "0.2"), ("--objective", "simpo")):
        with pytest.raises(SystemExit) as e:
            finetune.main(argv + ["--resume", flag, value])
        helpers.one_line_error(capsys, e, "--resume", f"{flag} {value}")
    at = argv.index("--steps")
    again = finetune.main(argv[:at] + ["--steps", "22"] + argv[at + 2 :] + ["--resume"])
    assert len(again["losses"]) == len(again["metrics"]) == 22
    assert again["losses"][:20] == summary["losses"] and again["metrics"][:20] == summary["metrics"]
    assert [s for s, _ in again["eval_metrics"]] == [0, 10, 20, 22]


@pytest.mark.slow
@pytest.mark.parametrize("objective,data", [("orpo", PREFS), ("simpo", CHAT)])
def test_orpo_and_simpo_train_a_few_steps(tmp_path, objective, data):
    argv = SMALL + ["--objective", objective, "--data", data, "--steps", "3", "--seq-len", "64"]
    summary = finetune.main(
        argv + ["--eval-split", "0", "--batch-size", "2", "--out", str(tmp_path)]
    )
    assert summary["objective"] == {"orpo": "ORPO", "simpo": "SimPO"}[objective]
    assert len(summary["metrics"]) == 3 and all(np.isfinite(summary["losses"]))
    if objective == "orpo":  # the SFT term: the chosen answers' NLL per token
        assert summary["losses"][0] > summary["metrics"][0]["nll_loss"] > 0
    else:  # rewards are beta (2.0) times the per-token mean log-probs: no reference
        m = summary["metrics"][0]
        assert m["rewards/chosen"] == pytest.approx(2.0 * m["logps/chosen"], rel=1e-5)
        assert summary["losses"][0] > 0
    assert summary["chat"] == (data == CHAT)


def test_the_dry_run_batch_and_levers_count_pairs_as_two_rows():
    """--dry-run compiles a [B, 2, S] batch of pairs; the levers are resolved for the 2B
    rows of a microbatch (--grad-accum splits whole pairs)."""
    from jmem._src.finetune.build import abstract_batch
    from jmem._src.finetune.build import job_resolved_levers
    from jmem.models import llama

    c = finetune.FinetuneConfig.from_flat(
        config="tiny", objective="dpo", batch_size=4, grad_accum=2, seq_len=64
    )
    batch = abstract_batch(c)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "inputs": ((4, 2, 64), jnp.int32),
        "targets": ((4, 2, 64), jnp.int32),
        "completion_mask": ((4, 2, 64), jnp.float32),
    }
    lv = job_resolved_levers(c, llama.get_config("tiny"), jnp.bfloat16)
    assert "256 tokens: one chunk" in lv.describe()  # 2 pairs x 2 answers x 64 tokens
    sft = abstract_batch(c.replace(objective="sft"))
    assert {k: v.shape for k, v in sft.items()} == {"inputs": (4, 64), "targets": (4, 64)}
