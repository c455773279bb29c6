"""``jmem finetune --objective grpo``: the flags and their one-line refusals (a group needs
two completions, the batch whole groups, one weight per reward, a reward at all), the
options in a config file and Python; short runs on the toy prompts: the reports, a run
stopped by its reward and resumed bit for bit, the adapter in PEFT; the toy task's rise."""

import contextlib
import io
import json
import os

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import finetune
from jmem._src.cli import CliError
from jmem._src.finetune.config_file import parse_args

GRPO = ["--objective", "grpo", "--reward", "examples/grpo_rewards.py:letter_share"]

BAD_FLAGS = {
    "one generation": (GRPO + ["--num-generations", "1"], ["--num-generations", ">= 2"]),
    "batch not whole groups": (
        GRPO + ["--num-generations", "4", "--batch-size", "6"],
        ["--batch-size 6", "multiple of --num-generations 4"],
    ),
    "generation batch": (
        GRPO + ["--num-generations", "2", "--batch-size", "8", "--generation-batch", "3"],
        ["--generation-batch 3", "divide --batch-size 8"],
    ),
    "no reward": (["--objective", "grpo"], ["--objective grpo needs a reward", "--reward"]),
    "weights": (GRPO + ["--reward-weights", "1,2"], ["2 weights for 1 --reward"]),
    "weight not a number": (GRPO + ["--reward-weights", "x"], ["--reward-weights", "'x'"]),
    "grpo option with sft": (["--epsilon", "0.3"], ["--epsilon", "--objective grpo", "not sft"]),
    "reward with dpo": (
        ["--objective", "dpo", "--reward", "a:b"],
        ["--reward", "--objective grpo", "not dpo"],
    ),
    "dpo loss with grpo": (GRPO + ["--loss-type", "ipo"], ["--loss-type ipo", "dapo"]),
    "grpo loss with dpo": (["--objective", "dpo", "--loss-type", "dapo"], ["sigmoid, ipo"]),
    "seq-len": (GRPO + ["--seq-len", "64"], ["--seq-len", "--max-prompt-len"]),
    "top-p": (GRPO + ["--top-p", "0"], ["--top-p", "(0, 1]"]),
    "temperature": (GRPO + ["--temperature", "0"], ["--temperature", "positive"]),
    "scale": (GRPO + ["--scale-rewards", "std"], ["--scale-rewards", "group"]),
    "offload params": (GRPO + ["--offload", "params"], ["--offload params", "grpo"]),
    "kl without adapters": (
        GRPO + ["--beta", "0.04", "--lora-rank", "0"],
        ["--beta > 0 with --lora-rank 0", "adapters off"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_grpo_flags_are_one_line(capsys, case):
    argv, words = BAD_FLAGS[case]
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    helpers.one_line_error(capsys, e, *words)


def test_grpo_flags_parse_with_trl_defaults():
    c = parse_args(GRPO + ["--reward", "len", "--reward-weights", "1,0.5", "--batch-size", "8"])
    g = c.grpo
    assert g.reward == ("examples/grpo_rewards.py:letter_share", "len")
    assert g.reward_weights == (1.0, 0.5)
    # TRL's GRPOConfig: num_generations 8, epsilon 0.2, scale_rewards group, mu 1
    assert (g.num_generations, g.epsilon, g.epsilon_high, g.num_iterations) == (8, 0.2, None, 1)
    assert (g.temperature, g.top_p, g.top_k, g.scale_rewards) == (1.0, 1.0, 0, "group")
    assert (g.max_prompt_len, g.max_completion_len) == (512, 256)
    assert c.training.beta is None and c.training.loss_type is None  # resolved by the job
    assert finetune.FinetuneConfig.from_flat(**c.flat()) == c


def test_grpo_defaults_resolve_to_trl(tmp_path):
    from jmem._src.finetune.setup import resolve_defaults
    from jmem.models import llama

    c = finetune.FinetuneConfig.from_flat(config="tiny", objective="grpo", reward=["len"])
    c, _ = resolve_defaults(c, llama.get_config("tiny"), on_gpu=False)
    assert (c.training.beta, c.training.loss_type) == (0.0, "dapo")
    c = finetune.FinetuneConfig.from_flat(config="tiny", objective="dpo")
    c, _ = resolve_defaults(c, llama.get_config("tiny"), on_gpu=False)
    assert (c.training.beta, c.training.loss_type) == (0.1, "sigmoid")


def test_grpo_options_in_a_config_file_and_python(tmp_path):
    (tmp_path / "f.yaml").write_text(
        "training: {objective: grpo, beta: 0.04, loss_type: dr_grpo}\n"
        "grpo: {reward: [a.py:f, len], reward_weights: [2, 1], num_generations: 4,\n"
        "       epsilon_high: 0.28, num_iterations: 2}\n"
    )
    c = parse_args(["--config-file", str(tmp_path / "f.yaml")])
    assert (c.training.beta, c.training.loss_type) == (0.04, "dr_grpo")
    assert c.grpo.reward == ("a.py:f", "len") and c.grpo.reward_weights == (2.0, 1.0)
    assert (c.grpo.num_generations, c.grpo.epsilon_high, c.grpo.num_iterations) == (4, 0.28, 2)
    c = parse_args(
        [
            "--config-file",
            str(tmp_path / "f.yaml"),
            "--reward",
            "b:g",
            "--reward",
            "len",
            "--reward-weights",
            "1,1",
        ]
    )
    assert c.grpo.reward == ("b:g", "len")  # the flags replace the file's list
    with pytest.raises(CliError, match="--reward-weights|reward_weights"):
        finetune.FinetuneConfig.from_flat(objective="grpo", reward=["a:f"], reward_weights=[1, 2])
    # a dry run plans without a reward
    c = finetune.FinetuneConfig.from_flat(objective="grpo", dry_run=True)
    assert c.grpo.reward == ()


# ------------------------------------------------------------------------------ the runs

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)
PROMPTS = os.path.join(ROOT, "examples", "grpo_letters.jsonl")
TOY_REWARD = os.path.join(ROOT, "examples", "grpo_rewards.py") + ":lowercase_share"
FLAKY = os.path.join(HERE, "data", "grpo_flaky_reward.py") + ":flaky_share"
RUN = ["--config", "tiny", "--objective", "grpo", "--data", PROMPTS, "--lora-rank", "4"]
RUN += ["--batch-size", "4", "--num-generations", "2", "--max-prompt-len", "16"]
RUN += ["--max-completion-len", "8", "--no-progress", "--host-allocator", "system"]
RUN += ["--save-every", "2", "--eval-every", "2"]
#: metrics that measure time, not what was computed
TIMING = ("generation_tokens_per_s", "train_tokens_per_s")


def _main(argv):
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        summary = finetune.main(argv)
    return summary, log.getvalue()


def _computed(metrics):
    return [{k: v for k, v in m.items() if k not in TIMING} for m in metrics]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """4 steps of ``--objective grpo`` on the toy prompts with two rewards (weighted), with
    --export-merged; returns (summary, out dir, merged dir, log, argv)."""
    tmp = tmp_path_factory.mktemp("grpo")
    out, merged = tmp / "run", tmp / "merged"
    argv = RUN + ["--reward", TOY_REWARD, "--reward", FLAKY, "--reward-weights", "1,0.5"]
    argv += ["--steps", "4", "--out", str(out)]
    summary, log = _main(argv + ["--export-merged", str(merged)])
    return summary, out, merged, log, argv


@pytest.mark.slow
def test_grpo_run_reports_rewards_per_step_and_function(grpo_run):
    summary, out, _, log, _ = grpo_run
    assert summary["objective"] == "GRPO" and summary["args"]["loss_type"] == "dapo"
    assert summary["args"]["beta"] == 0.0 and summary["prompts"] == 32
    m = summary["metrics"]
    assert len(m) == len(summary["rewards"]) == len(summary["losses"]) == 4
    for step in m:  # the weighted total, TRL's names
        total = step["rewards/lowercase_share/mean"] + 0.5 * step["rewards/flaky_share/mean"]
        assert abs(step["reward"] - total) < 1e-5
        assert step["completions/max_length"] == 8 and step["completions/clipped_ratio"] == 1.0
        assert 0 <= step["clip_ratio/region_mean"] <= 1 and step["advantage_std"] >= 0
    assert summary["rewards"] == [x["reward"] for x in m]
    assert set(summary["reward_functions"]) == {"lowercase_share", "flaky_share"}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["reward"] for x in lines] == summary["rewards"]
    assert (out / "loss.png").stat().st_size > 0
    step_1 = next(x for x in log.splitlines() if x.startswith("step     1"))
    for words in ("reward", "lowercase_share", "adv std", "clip", "len 8.0", "gen", "train"):
        assert words in step_1
    assert "kl" not in step_1  # beta 0: no KL term
    assert log.count("  sample (reward") == 2 * 3  # steps 1, 2 and 4
    assert "mean reward" in log.splitlines()[-1]
    assert "prompts are longer than --max-prompt-len 16" in log  # cut, with a note


@pytest.mark.slow
def test_grpo_stopped_by_its_reward_resumes_bitwise(grpo_run, tmp_path, monkeypatch, capsys):
    """A reward that raises at step 3 stops the run in one line naming it and its error,
    the checkpoint of step 2 kept; --resume then ends as the uninterrupted run: the same
    losses, rewards and metrics, and the same adapter files."""
    summary, out, _, _, argv = grpo_run
    at = argv.index("--out")
    argv = argv[: at + 1] + [str(tmp_path / "run")] + argv[at + 2 :]
    monkeypatch.setenv("JMEM_TEST_REWARD_FAIL_AT", f"3:{tmp_path}")
    with pytest.raises(SystemExit) as e:
        _main(argv)
    line = helpers.one_line_error(capsys, e, "step 3", "flaky_share", "RuntimeError")
    assert "the reward service is down" in line and "checkpoint is step 2" in line
    monkeypatch.delenv("JMEM_TEST_REWARD_FAIL_AT")
    again, log = _main(argv + ["--resume"])
    assert "Resumed at step 2" in log
    assert again["losses"] == summary["losses"] and again["rewards"] == summary["rewards"]
    assert _computed(again["metrics"]) == _computed(summary["metrics"])
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "run" / "adapter" / name).read_bytes() == (
            out / "adapter" / name
        ).read_bytes()


@pytest.mark.slow
def test_grpo_adapter_loads_in_peft(grpo_run, tmp_path):
    """The adapters a GRPO run wrote give PEFT the logits jmem computes on the run's base;
    --export-merged holds the base with them merged in."""
    torch = pytest.importorskip("torch", reason="PEFT's runtime")
    transformers = pytest.importorskip("transformers", reason="the base model for PEFT")
    peft = pytest.importorskip("peft", reason="loads the adapter the run wrote")
    from jmem import lora
    from jmem._src.finetune.build import quantized_base
    from jmem._src.finetune.setup import resolve_defaults
    from jmem.models import hf
    from jmem.models import llama

    _, out, merged, _, argv = grpo_run
    cfg = llama.get_config("tiny")
    config, _ = resolve_defaults(parse_args(argv), cfg, on_gpu=False)
    hf.save_params(str(tmp_path / "base"), quantized_base(config, cfg, jnp.bfloat16, False), cfg)
    params, _ = hf.load_params(str(tmp_path / "base"), cfg, dtype=jnp.float32)
    adapters = hf.load_adapters(str(out / "adapter"), params, cfg)
    adapters = jax.tree.map(lambda x: x.astype(jnp.float32), adapters)
    assert any(float(jnp.abs(w.b).max()) > 0 for w in adapters.values())  # trained
    tokens = np.frombuffer(b"Write a word: aaa", np.uint8).astype(np.int32)[None]
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
def test_packed_rows_score_the_sampled_tokens_as_the_sampler_did():
    """``pack_rows`` puts each completion right after its prompt's real tokens: the training
    forward's per-token log-probs there (at the sampling temperature) are the sampler's, on
    every completion token, and 0 elsewhere; a float32 model, so only the two programs'
    rounding differs."""
    import jmem
    from jmem._src.finetune.grpo_step import logps_program
    from jmem._src.finetune.grpo_step import pack_rows
    from jmem.models import llama

    cfg = helpers.small_config()
    config = finetune.FinetuneConfig.from_flat(
        objective="grpo",
        reward=["len"],
        batch_size=6,
        num_generations=3,
        max_prompt_len=7,
        max_completion_len=5,
        temperature=0.7,
        lora_rank=0,
    )
    params = llama.init(jax.random.key(0), cfg, jnp.float32)
    prompts = np.asarray(jax.random.randint(jax.random.key(1), (2, 7), 1, cfg.vocab_size))
    mask = np.ones((2, 7), np.int32)
    mask[0, :3] = 0  # a left-padded prompt of 4 tokens
    ro = llama.rollout(
        params,
        prompts,
        mask,
        cfg,
        num_generations=3,
        max_new_tokens=5,
        key=jax.random.key(2),
        temperature=0.7,
        eos_token_id=5,
    )
    batch = pack_rows(config, jax.tree.map(np.asarray, ro), np.zeros(6, np.float32))
    assert batch["inputs"].shape == (6, 12) and "mask" in batch  # dapo: token weights
    assert batch["mask"].sum() == np.asarray(ro.completion_mask).sum()
    logps = logps_program(config, cfg, jmem.Levers(remat="none"))
    ours = np.asarray(logps(params, None, batch, False))
    np.testing.assert_allclose(ours, batch["old_logps"], atol=2e-4)
    assert np.all(ours[batch["mask"] == 0] == 0)
    np.testing.assert_array_equal(batch["inputs"][0, :4], prompts[0, 3:])  # padding dropped


@pytest.mark.slow
def test_toy_task_reward_climbs(tmp_path):
    """The README's toy task: 40 steps from random init raise the mean reward (the share of
    lowercase letters) by well over 0.05 from the first 10 steps to the last 10 (measured:
    a rise of 0.10 to 0.14 for seeds 0, 1 and 2; docs/grpo.md)."""
    argv = ["--config", "tiny", "--objective", "grpo", "--data", PROMPTS, "--reward"]
    argv += [TOY_REWARD, "--batch-size", "16", "--num-generations", "8"]
    argv += ["--max-prompt-len", "32", "--max-completion-len", "16", "--steps", "40"]
    argv += ["--no-progress", "--host-allocator", "system", "--out", str(tmp_path / "run")]
    summary, _ = _main(argv + ["--save-every", "40"])
    rewards = summary["rewards"]
    assert len(rewards) == 40
    assert np.mean(rewards[-10:]) > np.mean(rewards[:10]) + 0.05, rewards


@pytest.mark.slow
def test_grpo_with_a_kl_term_and_two_updates_per_rollout(tmp_path):
    """--beta 0.04 (the reference: the base with the adapters off) and --num-iterations 2
    (the old log-probs recomputed before the first update): the KL is reported and finite,
    two updates per step follow one schedule of 2 x --steps updates."""
    argv = RUN + ["--reward", TOY_REWARD, "--steps", "2", "--out", str(tmp_path / "run")]
    argv += ["--beta", "0.04", "--num-iterations", "2", "--loss-type", "grpo"]
    argv += ["--scale-rewards", "batch", "--epsilon-high", "0.28"]
    summary, log = _main(argv)
    assert summary["args"]["beta"] == 0.04 and summary["args"]["loss_type"] == "grpo"
    kl = [m["kl"] for m in summary["metrics"]]
    assert all(np.isfinite(kl)) and min(kl) >= 0 and max(kl) > 0  # trained away from the base
    assert "kl " in next(x for x in log.splitlines() if x.startswith("step     1"))
    assert summary["learning_rates"][1] > summary["learning_rates"][0]  # warmup: 2 updates in


@pytest.mark.slow
def test_grpo_killed_while_saving_resumes_bitwise(grpo_run, tmp_path):
    """kill -9 while checkpoint 4 is saved (its files written, before orbax's rename):
    --resume continues from checkpoint 2 and ends as the uninterrupted run, the same losses,
    rewards and metrics bit for bit (tests/_faults_worker.py, as tests/test_faults.py)."""
    summary, _, _, _, argv = grpo_run
    at = argv.index("--out")
    argv = argv[: at + 1] + [str(tmp_path / "run")] + argv[at + 2 :]
    helpers.killed("save:4", argv)
    assert not (tmp_path / "run" / "summary.json").exists()
    again, log = _main(argv + ["--resume"])
    assert "Resumed at step 2" in log
    assert again["losses"] == summary["losses"] and again["rewards"] == summary["rewards"]
    assert _computed(again["metrics"]) == _computed(summary["metrics"])


BAD_INPUTS = {
    "no data": ([], ["--objective grpo needs --data", "prompt"]),
    "a reward's column": (
        ["--data", PROMPTS, "--reward", "answer_match"],
        ["--reward", "answer_match", "'answer'"],
    ),
    "no such reward file": (["--data", PROMPTS, "--reward", "nope.py:f"], ["--reward", "nope.py"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_grpo_inputs_are_one_line_before_compiling(tmp_path, capsys, case):
    extra, words = BAD_INPUTS[case]
    argv = ["--config", "tiny", "--objective", "grpo", "--out", str(tmp_path / "run")]
    argv += ["--reward", TOY_REWARD] if "--reward" not in extra else []
    with pytest.raises(SystemExit) as e:
        finetune.main(argv + extra)
    helpers.one_line_error(capsys, e, *words)
    assert not (tmp_path / "run").exists()  # refused before --out is touched


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_grad_accum_gives_the_whole_batch_loss(loss_type):
    """--grad-accum 2 on microbatches of 2 and 8 completion tokens: the step's loss is the
    whole batch's (dapo: a token mean, so microbatches weigh by their tokens; grpo: a mean
    of sequence means, weighed equally)."""
    from jmem._src.finetune.build import build
    from jmem._src.finetune.loop import trainable_and_frozen
    from jmem._src.finetune.setup import resolve_defaults
    from jmem.models import llama

    cfg = llama.get_config("tiny")
    rng = np.random.default_rng(0)
    batch = {
        "inputs": rng.integers(0, 256, (4, 8)).astype(np.int32),
        "targets": rng.integers(0, 256, (4, 8)).astype(np.int32),
        "advantages": np.asarray([1.0, -1.0, 0.5, -0.5], np.float32),
        "old_logps": np.full((4, 8), -5.5, np.float32),
    }
    mask = np.zeros((4, 8), np.float32)
    mask[:2, 3] = 1  # microbatch 1: 2 tokens
    mask[2:, 4:] = 1  # microbatch 2: 8 tokens
    losses = []
    for accum in (1, 2):
        c = finetune.FinetuneConfig.from_flat(
            config="tiny",
            objective="grpo",
            reward=["len"],
            batch_size=4,
            num_generations=2,
            max_prompt_len=4,
            max_completion_len=4,
            grad_accum=accum,
            loss_type=loss_type,
            steps=2,
            lora_rank=4,
        )
        c, _ = resolve_defaults(c, cfg, on_gpu=False)
        step, _, dtype, _ = build(c, cfg)
        trainable, frozen = trainable_and_frozen(c, cfg, dtype)
        key = "mask" if loss_type == "dapo" else "completion_mask"
        state = step.init(trainable, frozen=frozen)
        _, metrics = step(state, {**batch, key: mask})
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_a_run_without_generation_batch_takes_the_largest_that_fits():
    """A training run's ``--generation-batch`` unset: the planner's largest divisor of the
    batch whose generation phase fits the memory (``--memory`` or the accelerator's)."""
    from jmem._src.finetune import grpo_plan
    from jmem.models import llama

    cfg = llama.get_config("llama3_1_8b")
    flags = GRPO + ["--config", "llama3_1_8b", "--lora-rank", "32", "--batch-size", "8"]
    config = parse_args(flags + ["--max-prompt-len", "1024", "--max-completion-len", "19456"])
    gib = 2**30
    picked = {}
    for memory in (24 * gib, 48 * gib, 141 * gib):
        resolved, line = grpo_plan.run_generation_batch(config, cfg, memory)
        gb = resolved.grpo.generation_batch
        assert 8 % gb == 0 and line.startswith(f"resolver: generation batch {gb}"), line
        picked[memory] = gb
    assert picked[24 * gib] <= picked[48 * gib] < picked[141 * gib], picked
    given = parse_args(flags + ["--generation-batch", "4"])
    assert grpo_plan.run_generation_batch(given, cfg, 16 * gib) == (given, None)
