"""The planner's GRPO phases: the KV-cache ledger against hand arithmetic and against the
compiled rollout (XLA:CPU, tiny), the training phase's extras, the generation batch choice."""

import jax
import jax.numpy as jnp
import pytest

from jmem import lora
from jmem import qlora
from jmem._src.finetune.rollout_compile import rollout_report
from jmem._src.planner import grpo_phases
from jmem._src.planner import kv_cache
from jmem._src.planner.estimate import estimate
from jmem._src.planner.shapes import LINEAR_NAMES
from jmem.models import llama


def test_kv_bytes_per_token_is_two_kv_heads_times_head_dim():
    # Llama 3.1 8B: 8 KV heads (GQA) of 128, bf16: 2 * 8 * 128 * 2 = 4096 B per layer.
    assert kv_cache.kv_bytes_per_token("llama3_1_8b") == 4096
    assert kv_cache.kv_bytes_per_token("llama3_1_8b", "fp32") == 8192
    # 32 layers, 2 rows of 1,024 + 19,456 tokens: 2 * 20480 * 32 * 4096 B = 5 GiB.
    got = kv_cache.kv_cache_bytes("llama3_1_8b", rows=2, tokens=20480)
    assert got == 2 * 20480 * 32 * 4096 == 5 * 2**30


def test_sliding_window_layers_capped_only_when_asked():
    cfg = llama.get_config("gemma3_1b")  # 26 layers, every 6th full, window 512
    per = kv_cache.kv_bytes_per_token(cfg)
    windows = kv_cache.layer_windows(cfg)
    assert windows.count(None) == 4 and set(windows) == {None, 512}
    assert kv_cache.layer_windows("gemma3_1b") == windows
    full = kv_cache.kv_cache_bytes(cfg, rows=3, tokens=4096)
    capped = kv_cache.kv_cache_bytes(cfg, rows=3, tokens=4096, capped=True)
    assert full == 3 * 26 * 4096 * per
    assert capped == 3 * per * (4 * 4096 + 22 * 512)
    # shorter than the window: nothing to cap
    assert kv_cache.kv_cache_bytes(cfg, rows=1, tokens=100, capped=True) == 26 * 100 * per
    with pytest.raises(ValueError, match="rows and tokens"):
        kv_cache.kv_cache_bytes(cfg, rows=0, tokens=1)


def test_generation_phase_is_weights_plus_caches_plus_other():
    kw = dict(lora=(8, LINEAR_NAMES), quantization="nf4", target="h100_sxm")
    ph = kv_cache.generation_phase(
        "llama3_1_8b", generation_batch=2, max_prompt_len=1024, max_completion_len=19456, **kw
    )
    assert ph.name == "generation" and ph.line().startswith("generation: ")
    assert ph.total == sum(ph.parts.values())
    assert ph.parts["kv_cache"] == 2 * 5 * 2**30  # two caches live on XLA:GPU
    w = estimate("llama3_1_8b", lora=(8, LINEAR_NAMES), quantization="nf4").params
    assert ph.parts["weights"] == w
    with pytest.raises(ValueError, match="generation_batch"):
        kv_cache.generation_phase(
            "tiny", generation_batch=0, max_prompt_len=1, max_completion_len=1
        )


def test_training_phase_adds_grpo_arrays_to_the_sft_estimate():
    kw = dict(lora=(8, LINEAR_NAMES), quantization="nf4", remat="full")
    ph = grpo_phases.training_phase(
        "tiny", batch_size=4, max_prompt_len=16, max_completion_len=48, beta=0.0, **kw
    )
    sft = estimate("tiny", batch_size=4, seq_len=64, **kw)
    assert ph.parts["sft"] == sft.total
    assert ph.parts["grpo_extras"] == 4 * 4 * (4 * 64 + 1)
    with_ref = grpo_phases.training_phase(
        "tiny", batch_size=4, max_prompt_len=16, max_completion_len=48, beta=0.04, **kw
    )
    assert with_ref.total - ph.total == 4 * 4 * 64  # the reference's log-probs
    assert ph.line().startswith("training: ")


def test_largest_generation_batch_is_the_largest_divisor_that_fits():
    kw = dict(
        max_prompt_len=1024,
        max_completion_len=19456,
        lora=(32, LINEAR_NAMES),
        quantization="nf4",
        target="h100_sxm",
    )
    gb, ph, why = grpo_phases.largest_generation_batch(24 * 2**30, "llama3_1_8b", rows=8, **kw)
    assert gb == 2 and ph.config["rows"] == 2
    four = kv_cache.generation_phase("llama3_1_8b", generation_batch=4, **kw)
    assert ph.total + 2e9 <= 24 * 2**30 < four.total + 2e9
    assert "largest divisor of the 8 completions" in why
    gb, _, why = grpo_phases.largest_generation_batch(6 * 2**30, "llama3_1_8b", rows=8, **kw)
    assert gb == 0 and "not even 1 row" in why


@pytest.mark.slow
@pytest.mark.parametrize("rows,prompt,completion", [(2, 16, 64), (8, 32, 512)])
def test_generation_phase_within_15_percent_of_the_compiled_rollout(rows, prompt, completion):
    cfg = llama.get_config("tiny")
    frozen = jax.eval_shape(lambda: qlora.quantize_params(llama.abstract_params(cfg, jnp.bfloat16)))
    adapters = jax.eval_shape(
        lambda k: lora.init(k, frozen, rank=8, modules=list(LINEAR_NAMES)), jax.random.key(0)
    )
    report = rollout_report(
        frozen,
        adapters,
        cfg,
        generation_batch=rows,
        max_prompt_len=prompt,
        max_completion_len=completion,
        target="cpu",
    )
    ph = kv_cache.generation_phase(
        cfg,
        generation_batch=rows,
        max_prompt_len=prompt,
        max_completion_len=completion,
        lora=(8, LINEAR_NAMES),
        quantization="nf4",
        target="cpu",
    )
    assert abs(ph.total / report.peak_bytes - 1) < 0.15, (ph.parts, report)


GRPO_8B = [
    "estimate",
    "--model",
    "llama3_1_8b",
    "--lora-rank",
    "32",
    "--objective",
    "grpo",
    "--num-generations",
    "8",
    "--batch-size",
    "8",
    "--max-prompt-len",
    "1024",
    "--max-completion-len",
    "19456",
    "--remat",
    "offload_inputs",
]  # no --target: the planner alone, with this machine's (XLA:CPU's) buffers


def _lines(capsys, argv):
    from jmem.__main__ import main  # noqa: PLC0415

    assert main(argv) == 0
    return capsys.readouterr().out.splitlines()


def test_estimate_grpo_prints_both_phases_and_picks_the_generation_batch(capsys):
    lines = _lines(capsys, [*GRPO_8B, "--memory", "24GiB"])
    gen = [ln for ln in lines if ln.startswith("generation: ")]
    train = [ln for ln in lines if ln.startswith("training: ")]
    assert len(gen) == len(train) == 1
    # XLA:CPU's four caches of 2.5 GiB a row: one row fits, two do not
    assert "rows=1" in gen[0] and gen[0].endswith("fits 24 GiB with the 2 GB reserve")
    assert "largest divisor of the 8 completions" in lines[lines.index(gen[0]) + 1]
    assert "(2 rows: " in lines[lines.index(gen[0]) + 1]
    assert "XLA:CPU's buffers" in lines[0]
    assert "rows=8, tokens=1024+19456, remat=offload_inputs" in train[0]
    assert train[0].endswith("fits 24 GiB with the 2 GB reserve")


def test_estimate_grpo_generation_batch_given_and_whole_batch(capsys):
    lines = _lines(capsys, [*GRPO_8B, "--generation-batch", "4", "--memory", "24GiB"])
    gen = next(ln for ln in lines if ln.startswith("generation: "))
    assert "rows=4" in gen and gen.endswith("does not fit 24 GiB with the 2 GB reserve")
    lines = _lines(capsys, GRPO_8B)
    assert any("rows=8" in ln for ln in lines if ln.startswith("generation: "))
    assert any("the whole batch" in ln for ln in lines)


def test_estimate_grpo_refuses_partial_groups(capsys):
    from jmem.__main__ import main  # noqa: PLC0415

    with pytest.raises(SystemExit) as e:
        main([*GRPO_8B, "--batch-size", "12"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "must be a multiple of --num-generations 8" in err and "\n" == err[-1]


def _job_config(**flags):
    from jmem import finetune  # noqa: PLC0415

    base = dict(config="llama3_1_8b", lora_rank=32, objective="grpo", num_generations=8)
    base.update(batch_size=8, max_prompt_len=1024, max_completion_len=19456, dry_run=True)
    return finetune.FinetuneConfig.from_flat(**{**base, **flags})


def test_the_resolver_picks_offload_and_the_generation_batch_for_24_gib():
    from jmem._src.finetune import grpo_plan  # noqa: PLC0415

    cfg = llama.get_config("llama3_1_8b")
    config, lines = grpo_plan.resolve(_job_config(), cfg, target="h100_sxm")
    assert config.execution.remat == "offload_inputs" and config.grpo.generation_batch == 2
    assert config.run.memory == 24 * 2**30
    assert lines[0].startswith("resolver: --remat offload_inputs: the planned training phase")
    assert lines[1].startswith("resolver: generation batch 2: the largest divisor")
    # what the flags set is kept: an explicit remat and generation batch
    given = _job_config(remat="selective", generation_batch=4, memory=80 * 2**30)
    config, lines = grpo_plan.resolve(given, cfg, target="h100_sxm")
    assert config.execution.remat == "selective" and config.grpo.generation_batch == 4
    assert config.execution.offload in ("none", "params")


@pytest.mark.slow
def test_grpo_dry_run_on_cpu_prints_one_line_per_phase(tmp_path, capsys):
    from jmem import finetune  # noqa: PLC0415

    argv = ["--config", "tiny", "--objective", "grpo", "--num-generations", "4"]
    argv += ["--batch-size", "8", "--max-prompt-len", "16", "--max-completion-len", "48"]
    # one device (the test session has 8): the planner's generation phase is one device's
    out = finetune.main([*argv, "--mesh", "fsdp=1", "--dry-run", "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    gen = [ln for ln in lines if ln.startswith("generation: ")]
    train = [ln for ln in lines if ln.startswith("training: ")]
    assert len(gen) == len(train) == 1
    assert "device peak" in gen[0] and "(planner " in gen[0] and "(planner " in train[0]
    rec = out["phases"]["generation"]
    assert abs(rec["planner_bytes"] / rec["peak_bytes"] - 1) < 0.15
    assert out["fits"] and out["args"]["generation_batch"] == 8


def test_estimate_refuses_grpo_flags_without_the_objective(capsys):
    from jmem.__main__ import main  # noqa: PLC0415

    with pytest.raises(SystemExit) as e:
        main(["estimate", "--model", "tiny", "--num-generations", "4", "--beta", "0.1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--num-generations, --beta apply to --objective grpo" in err


def test_the_resolver_adds_gradient_accumulation_when_offload_is_not_enough():
    from jmem._src.finetune import grpo_plan  # noqa: PLC0415

    cfg = llama.get_config("llama3_1_8b")
    config, lines = grpo_plan.resolve(_job_config(memory=16 * 2**30), cfg, target="h100_sxm")
    assert config.execution.remat == "offload_inputs" and config.execution.grad_accum == 2
    assert [ln.split(":")[1].strip() for ln in lines[:2]] == [
        "--remat offload_inputs",
        "--grad-accum 2",
    ]
    planned = grpo_plan.training_phase(config, cfg, "h100_sxm")
    assert planned.config["rows"] == 4 and planned.total + 2e9 <= 16 * 2**30
