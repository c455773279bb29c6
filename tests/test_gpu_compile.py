"""XLA:GPU compiles for ``h100_sxm`` on this CPU machine (``-m gpu_compile``; docs/targets.md).

Needs the ``gpu-plan`` extra (the CUDA PJRT plugin, ptxas, cuDNN) and ``JAX_PLATFORMS=cpu``
(conftest sets it); every test here skips with the reason when it is missing, so the suite
without the extra runs none of them. Each compile takes 2-40 s of CPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmem
from jmem import finetune
from jmem._src.attention import attention

TARGET = "h100_sxm"
_REASON = jmem.targets.unavailable_reason(TARGET)
pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(_REASON is not None, reason=f"no XLA:GPU compiler here: {_REASON}"),
]
CUDNN_CALL = "__cudnn$fmha"  # the custom call of cuDNN's fused attention in the HLO


def _compile(fn, *args):
    """XLA:GPU's own compile of ``fn`` for one h100_sxm device (no jmem in between)."""
    with jax.default_device(jmem.targets.devices(TARGET)[0]):
        return jax.jit(fn).lower(*args).compile()


def _unseen_program():
    """A program jmem has never seen: the gradient of an MLP over cuDNN attention."""

    def f(q, k, v, w1, w2):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        h = jax.nn.gelu(o.reshape(*o.shape[:2], -1) @ w1)
        return jnp.mean(jnp.square(h @ w2).astype(jnp.float32))

    qkv = jax.ShapeDtypeStruct((2, 2048, 8, 128), jnp.bfloat16)
    w1 = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    w2 = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
    return jax.grad(f, argnums=(0, 1, 2, 3, 4)), (qkv, qkv, qkv, w1, w2)


def test_measure_equals_xla_gpu_buffer_assignment():
    """``jmem.measure(target=)`` is XLA:GPU's buffer assignment for the target (within 1%),
    cuDNN attention included (a program XLA:CPU cannot compile at all)."""
    fn, args = _unseen_program()
    report = jmem.measure(fn, *args, target=TARGET)
    compiled = _compile(fn, *args)
    assert CUDNN_CALL in compiled.as_text()
    ma = compiled.memory_analysis()
    assert report.target == TARGET and report.source == "compiler"
    np.testing.assert_allclose(report.peak_bytes, ma.peak_memory_in_bytes, rtol=0.01)
    np.testing.assert_allclose(report.temp_bytes, ma.temp_size_in_bytes, rtol=0.01)
    assert report.argument_bytes == ma.argument_size_in_bytes == 5 * 2**23  # 5 x 8 MiB
    assert report.host_peak_bytes == 0


@pytest.mark.parametrize("impl", ["auto", "cudnn", "dense", "blockwise"])
def test_attention_paths_compile_for_the_target(impl):
    """jmem's attention compiles for h100_sxm on every path; ``"auto"`` resolves for the
    target (cuDNN) although the running backend is the CPU; the dense path's float32
    [B, nH, S, T] scores (2 x 8 x 4096^2 x 4 bytes = 1 GiB) bound its temporaries from below,
    the fused paths stay under a quarter of that."""

    def loss(q, k, v):
        idx = jnp.arange(q.shape[1])
        return attention(q, k, v, q_index=idx, implementation=impl).astype(jnp.float32).sum()

    x = jax.ShapeDtypeStruct((2, 4096, 8, 64), jnp.bfloat16)
    g = jax.grad(loss, argnums=(0, 1, 2))
    report = jmem.measure(g, x, x, x, target=TARGET)
    scores = 2 * 8 * 4096 * 4096 * 4
    if impl == "dense":
        assert report.temp_bytes >= scores
    else:
        assert report.temp_bytes < scores / 4, report
    if impl in ("auto", "cudnn"):
        assert CUDNN_CALL in _compile(g, x, x, x).as_text()
    assert jax.default_backend() == "cpu"


def _mlp_loss(params, batch):
    h = jax.nn.relu(batch["x"] @ params["w1"])
    return jnp.mean(jnp.square(h @ params["w2"] - batch["y"]))


@pytest.mark.parametrize("mode", [True, "leaf_by_leaf"])
def test_offloaded_optimizer_state_is_in_pinned_host_on_the_target(mode):
    """``offload_optimizer`` places Adam's two moments in ``pinned_host`` on h100_sxm: the
    host arguments are the moments' float32 bytes (2 x 16 MiB for 4M params), and the
    device arguments drop by as much. Leaf by leaf the device peak drops too; the whole-tree
    update stages the state on the device (its peak: state, grads and params at once)."""
    params = {
        "w1": jax.ShapeDtypeStruct((1024, 2048), jnp.float32),
        "w2": jax.ShapeDtypeStruct((2048, 1024), jnp.float32),
    }
    batch = {
        "x": jax.ShapeDtypeStruct((64, 1024), jnp.float32),
        "y": jax.ShapeDtypeStruct((64, 1024), jnp.float32),
    }
    reports = {}
    for offload in (False, mode):
        step = jmem.train_step(_mlp_loss, optax.adam(1e-3), offload_optimizer=offload)
        reports[offload] = step.measure(step.abstract_state(params), batch, target=TARGET)
    base, off = reports[False], reports[mode]
    moments = 2 * sum(4 * int(np.prod(p.shape)) for p in params.values())
    assert base.host_argument_bytes == 0
    np.testing.assert_allclose(off.host_argument_bytes, moments, rtol=0.01)
    assert off.argument_bytes <= base.argument_bytes - moments + 1024
    assert off.host_peak_bytes >= moments
    if mode == "leaf_by_leaf":  # one leaf's moments on the device at a time
        assert off.peak_bytes < base.peak_bytes
    else:  # docs/offload.md: the whole state staged for the update, with grads and params
        weights = moments // 2
        assert off.peak_bytes <= 1.02 * (base.argument_bytes + 2 * weights)


def _qlora_dry_run(tmp_path, argv, fsdp=None):
    """The job's ``--dry-run --target h100_sxm`` (``dry_run(target=)``), from its command
    line; ``fsdp``: ``--mesh fsdp=N`` over the target's compile-only devices."""
    argv = argv + ["--dry-run", "--target", TARGET, "--out", str(tmp_path)]
    return finetune.main(argv + (["--mesh", f"fsdp={fsdp}"] if fsdp else []))


@pytest.mark.slow
def test_qlora_step_tiny_at_4k(tmp_path):
    """The main job's QLoRA step (tiny, 4k tokens, full remat) compiles for h100_sxm: the
    arguments are the planner's params + state (the same ledger), the device peak is
    within 10% of the planner's estimate for the target (XLA:GPU's terms; 50.7 MiB
    compiled, 46.4 MiB planned) and nothing is on the host. No ``--memory``: judged against
    the target's 79.11 GiB, and the smaller cards too (it fits them all, no lever named)."""
    out = _qlora_dry_run(tmp_path, ["--config", "tiny", "--seq-len", "4096", "--batch-size", "1"])
    assert out["memory"] == jmem.targets.get(TARGET).memory_bytes and out["fits"]
    assert out["cards"] == {"fits": {24: True, 32: True, 40: True, 48: True}, "levers": {}}
    c, est = out["compiled"], out["estimate"]
    assert out["target"] == TARGET and c["target"] == TARGET
    state = est["params"] + est["optimizer_state"] + est["master_weights"]
    np.testing.assert_allclose(c["argument_bytes"] - 2 * 4 * 4096, state, rtol=0.05)
    assert c["argument_bytes"] < c["peak_bytes"]
    np.testing.assert_allclose(est["total"], c["peak_bytes"], rtol=0.10)
    assert c["host_peak_bytes"] == 0


@pytest.mark.slow
def test_qlora_step_llama_1b_at_4k_and_the_planner(tmp_path):
    """A mid-size config (llama_1b, QLoRA r=8, 4k tokens, full remat): the NF4 base and the
    adapters' state are the arguments (within 5% of the planner's), the device peak stays
    under 3 GiB, and the planner calibrated to XLA:GPU is within 10% of
    this live compile: the dry run's planner column (the step's levers, resolved for the
    target) takes XLA:GPU's terms and is closer than the XLA:CPU model of the same step
    (``tests/test_planner.py`` checks 8B at 2k-128k against the committed compiles of
    ``benchmarks/gpu_calibration.py``)."""
    from jmem import planner
    from jmem.models import llama

    argv = ["--config", "llama_1b", "--seq-len", "4096", "--batch-size", "1"]
    out = _qlora_dry_run(tmp_path, argv)
    c, est = out["compiled"], out["estimate"]
    state = est["params"] + est["optimizer_state"] + est["master_weights"]
    np.testing.assert_allclose(c["argument_bytes"], state, rtol=0.05)
    assert c["peak_bytes"] < 3 * 2**30
    np.testing.assert_allclose(est["total"], c["peak_bytes"], rtol=0.10)
    cpu = planner.estimate(
        llama.get_config("llama_1b"),
        param_dtype="bf16",
        optimizer="adamw_8bit",
        lora={"rank": 8, "targets": list(llama.LINEAR_NAMES)},
        quantization="nf4",
        remat="full",
        seq_len=4096,
        target="cpu",
    ).total
    assert abs(est["total"] / c["peak_bytes"] - 1) < abs(cpu / c["peak_bytes"] - 1)


@pytest.mark.slow
def test_full_finetuning_llama3_2_1b_fits_24_gib_with_the_skip_on(tmp_path):
    """The seeds' 24 GB table from the job: ``--lora-rank 0 --optimizer adamw`` (bf16 params,
    fp32 masters and moments: 14 bytes a parameter) on llama3_2_1b at 2,048 tokens, the
    non-finite skip on (a per-leaf select on the GPU target): the state is the planner's
    ledger, and the peak (20.02 GiB) plus the 2 GB reserve fits a 24 GiB card."""
    from jmem.models import llama

    argv = ["--config", "llama3_2_1b", "--lora-rank", "0", "--optimizer", "adamw"]
    out = _qlora_dry_run(tmp_path, argv + ["--seq-len", "2048", "--batch-size", "1"])
    c, est = out["compiled"], out["estimate"]
    n = llama.num_params(llama.get_config("llama3_2_1b"))
    assert out["trainable_params"] == n and out["compute"]["minimum"] == "6NT"
    state = est["params"] + est["optimizer_state"] + est["master_weights"]
    assert state == 14 * n
    np.testing.assert_allclose(c["argument_bytes"], state, rtol=0.01)
    assert out["cards"]["fits"][24], out["cards"]
    assert c["peak_bytes"] + jmem.planner.DEFAULT_RESERVE <= 24 * 2**30


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True])
def test_qlora_fsdp_8_devices_with_cudnn(tmp_path, offload):
    """8-device FSDP with cuDNN attention compiles for h100_sxm (it raised "Query, key and
    value should have same sharding" before q, k, v were constrained); with ``--offload``
    the optimizer state is in host bytes and the device arguments drop."""
    argv = ["--config", "tiny", "--seq-len", "512", "--batch-size", "8"]
    out = _qlora_dry_run(tmp_path, argv + (["--offload"] if offload else []), fsdp=8)
    c = out["compiled"]
    assert out["mesh"] == {"data": 1, "fsdp": 8} and out["devices"] == 8
    assert 0 < c["peak_bytes"] < 64 * 2**20
    if offload:
        assert c["host_argument_bytes"] > 0
    else:
        assert c["host_peak_bytes"] == 0


@pytest.mark.slow
def test_fsdp_8_token_chunks_move_the_unchunked_collectives(tmp_path):
    """Full fine-tuning on ``fsdp=8`` (tiny, 8 x 512 tokens) compiled for h100_sxm: token
    chunks of 64 (8 per device and loop) all-gather and reduce-scatter what the unchunked
    step does (+2%): each layer's weights gathered once per pass and their gradients
    reduced once, not per chunk (108.8 MiB of all-gathers and 5.6 MiB of reduce-scatters
    against 23.4 and 0.74 when the chunk loops gathered and reduced per chunk)."""
    argv = ["--config", "tiny", "--seq-len", "512", "--batch-size", "8", "--lora-rank", "0"]
    moved = []
    for chunk in (0, 64):
        out = _qlora_dry_run(tmp_path / str(chunk), argv + ["--token-chunk", str(chunk)], fsdp=8)
        moved.append(out["compiled"]["collective_bytes"])
    whole, chunked = moved
    for kind in ("all-gather", "reduce-scatter"):
        assert 0 < chunked[kind] <= 1.02 * whole[kind], (kind, whole, chunked)


def test_cudnn_attention_on_an_fsdp_mesh():
    """The bare fix: cuDNN attention under FSDP shardings that leave q and k/v sharded
    differently compiles for 8 h100_sxm devices (q, k, v constrained to one batch sharding
    on the mesh in context)."""
    mesh = jmem.targets.mesh(TARGET, (8,), ("fsdp",))
    P = jax.sharding.PartitionSpec
    x = jax.ShapeDtypeStruct(
        (8, 1024, 8, 64), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, P("fsdp"))
    )
    w = jax.ShapeDtypeStruct(
        (512, 512), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, P("fsdp"))
    )

    def loss(x, w):
        q = (x.reshape(*x.shape[:2], -1) @ w).reshape(x.shape)  # sharded like w's columns
        idx = jnp.arange(x.shape[1])
        return attention(q, x, x, q_index=idx, implementation="cudnn").astype(jnp.float32).sum()

    report = jmem.measure(jax.grad(loss, argnums=(0, 1)), x, w, target=TARGET)
    assert 0 < report.peak_bytes < 8 * 1024 * 8 * 64 * 2 * 4  # < 4x all of x, per device


def test_targets_config_parses_for_every_gpu_target():
    """Every GPU target's config is accepted by this jaxlib's proto and compiles a program;
    the devices report the target's name."""
    for name in jmem.targets.NAMES:
        t = jmem.targets.get(name)
        if t.platform != "gpu":
            continue
        (dev,) = jmem.targets.devices(name)
        assert dev.device_kind == t.description
        with jax.default_device(dev):
            c = jax.jit(lambda x: x @ x).lower(jax.ShapeDtypeStruct((256, 256), jnp.float32))
            assert c.compile().memory_analysis().output_size_in_bytes == 256 * 256 * 4


def test_pinned_host_sharding_survives_on_the_target_mesh():
    """The pitfall: a ``pinned_host`` sharding on a ``Mesh`` of compile-only devices loses its
    kind; on ``jmem.targets.mesh`` (an ``AbstractMesh``) it keeps it, and the compile puts
    the argument in host bytes."""
    P = jax.sharding.PartitionSpec
    concrete = jmem.targets.concrete_mesh(TARGET, (2,), ("x",))
    lost = jax.sharding.NamedSharding(concrete, P("x"), memory_kind="pinned_host")
    mesh = jmem.targets.mesh(TARGET, (2,), ("x",))
    kept = jax.sharding.NamedSharding(mesh, P("x"), memory_kind="pinned_host")
    assert lost.memory_kind is None and kept.memory_kind == "pinned_host"
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=kept)
    report = jmem.measure(lambda a: a, x, target=TARGET)
    assert report.host_argument_bytes == 1024 * 1024 * 4 // 2
    assert dataclasses.asdict(report)["target"] == TARGET


@pytest.mark.slow
def test_the_offload_remat_policy_compiles_with_token_chunks_resolved_off(tmp_path):
    """XLA:GPU (jaxlib 0.10.2) fails layout assignment ('Expected instruction to have shape
    equal to ...') of the layer scan when the 'offload' remat policy meets the token-local
    chunk loops: the layer inputs' stack is in host memory (S(5)) while the residuals saved
    per chunk ([L, chunks, chunk, ...]) are not. For a GPU target the resolver turns token
    chunks off with remat offload (``jmem.resolve_levers``, with the reason): the job's
    ``--remat offload`` at 4,096 tokens (default 2,048-token chunks) compiles for h100_sxm,
    and the offloaded residuals are in host bytes (tiny: 143.75 MiB measured; at least the
    4 layer inputs, 4 x 4096 x 256 x 2 bytes)."""
    argv = ["--config", "tiny", "--seq-len", "4096", "--batch-size", "1", "--remat", "offload"]
    out = _qlora_dry_run(tmp_path, argv)
    c = out["compiled"]
    assert c["host_peak_bytes"] >= 4 * 4096 * 256 * 2
    assert 0 < c["peak_bytes"] < 256 * 2**20


@pytest.mark.slow
def test_the_dry_runs_advice_for_a_smaller_card_compiles_to_what_it_says(tmp_path, capsys):
    """Llama-3.1-8B QLoRA r=32 at 57,344 tokens (24.65 GiB compiled: misses the 24 GiB
    card): the dry run compiles the lever it names for 24 GiB and prints that compile's
    device and host bytes and transfers. A separate dry run of the named flags gives the
    same device and host bytes within 10%, its peak fits the card, and a --host-memory
    below the lever's host bytes either replaces the lever or says it needs more. ``jmem
    estimate --target --memory 24GiB`` prints the same compiled advice. (Measured
    2026-12-04, XLA:GPU compile for h100_sxm, no GPU: --remat offload_inputs, 10.23 GiB
    device + 14.00 GiB host, 30.1 GB moved per step; planner 10.20 GiB.)"""
    argv = ["--config", "llama3_1_8b", "--lora-rank", "32", "--seq-len", "57344"]
    argv += ["--batch-size", "1"]
    out = _qlora_dry_run(tmp_path / "job", argv)
    text = capsys.readouterr().out
    assert out["cards"]["fits"][24] is False
    what, planned = out["cards"]["levers"][24]
    row = out["cards"]["checked"][24]
    assert row[0] == what and row[-1]  # compiled, and the compile fits the card
    (line,) = [ln for ln in text.splitlines() if ln.startswith("  on a 24 GiB card: ")]
    assert f"compiled: {row[1] / 2**30:.2f} GiB device + {row[2] / 2**30:.2f} GiB host" in line
    assert "GB/s --pcie-gbps" in line and "planner-only" not in line
    flags = what.split(" (")[0].split()
    assert "DIR" not in flags, what
    alone = _qlora_dry_run(tmp_path / "lever", argv + flags + ["--memory", "24GiB"])
    c = alone["compiled"]
    assert alone["fits"] and c["peak_bytes"] == pytest.approx(row[1], rel=0.10)
    assert c["host_peak_bytes"] == pytest.approx(row[2], rel=0.10)
    if c["host_peak_bytes"]:  # a lever in host memory: its transfers are printed
        assert row[3] > 0 and row[4] > 0
    tight = max(1, c["host_peak_bytes"] // 2)
    out = _qlora_dry_run(tmp_path / "tight", argv + ["--host-memory", str(tight)])
    capsys.readouterr()
    named = out["cards"]["levers"][24]
    assert named is None or named[0] != what or "above --host-memory" in named[0]
    if named is not None and "above --host-memory" not in named[0]:
        assert out["cards"]["checked"][24] is None or out["cards"]["checked"][24][2] <= tight
    # jmem estimate --target --memory: the same compiled advice, in one line
    from jmem.__main__ import main

    est = ["estimate", "--model", "llama3_1_8b", "--lora-rank", "32", "--quant", "nf4"]
    est += ["--seq-len", "57344", "--optimizer", "adamw_8bit", "--remat", "full"]
    main(est + ["--target", TARGET, "--memory", "24GiB"])
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("advice:")]
    assert line.startswith(f"advice: {what}; compiled: {row[1] / 2**30:.2f} GiB device + ")
    assert f"{row[2] / 2**30:.2f} GiB host" in line and "GB/s" in line


@pytest.mark.slow
def test_estimate_answers_from_the_compiler(capsys):
    """``jmem estimate --target h100_sxm``: the job's step compiled at --seq-len (device
    peak and host bytes from XLA:GPU), and ``--max-seq`` bisects over compiles (tiny, up to
    32,768 tokens: the layer inputs offloaded fit at least as long as full remat)."""
    import re

    from jmem.__main__ import main

    main(["estimate", "--model", "tiny", "--target", TARGET, "--seq-len", "4096"])
    out = capsys.readouterr().out
    assert "XLA:GPU compile" in out and "source: compiler" in out
    peak = float(re.search(r"device peak ([\d.]+) GiB", out).group(1))
    assert 0 < peak < 1
    argv = ["estimate", "--model", "tiny", "--target", TARGET, "--max-seq", "--memory", "2.1GB"]
    main(argv + ["--search-limit", "32768"])
    out = capsys.readouterr().out
    full, offloaded = (
        int(n.replace(",", "")) for n in re.findall(r"longest sequence ([\d,]+)", out)
    )
    assert 0 < full <= offloaded <= 32768 and full % 8192 == 0


def _streamed_qlora_step(offload: bool):
    """A two-layer QLoRA train step (NF4 base, r=4 adapters, AdamW, full remat, bf16;
    ``tiny`` made smaller, 64 tokens, to keep the two compiles short) with or without
    ``Levers(offload_params=True)``, and its abstract state and batch."""
    from jmem.models import llama  # noqa: PLC0415

    small = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4)
    cfg = dataclasses.replace(llama.get_config("tiny"), num_kv_heads=2, **small)
    lv = jmem.Levers(remat="full", offload_params=offload)

    def loss_fn(adapters, batch, *, frozen):
        fn = jmem.qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv))
        return fn(frozen, adapters, batch)

    frozen = jax.eval_shape(
        lambda: jmem.qlora.quantize_params(llama.abstract_params(cfg, jnp.bfloat16))
    )
    adapters = jax.eval_shape(lambda: jmem.lora.init(jax.random.key(0), frozen, rank=4))
    step = jmem.train_step(loss_fn, optax.adamw(1e-3), precision="p=f32,c=bf16,o=f32", levers=lv)
    tokens = jax.ShapeDtypeStruct((1, 64), jnp.int32)
    return step, step.abstract_state(adapters, frozen=frozen), {"inputs": tokens, "targets": tokens}


@pytest.mark.slow
def test_offloaded_params_are_streamed_per_layer_on_the_target():
    """``Levers(offload_params=True)`` on h100_sxm: the frozen base is host arguments (its
    bytes exactly) and the device arguments drop by as much; the HLO reads the host stack
    only by a dynamic slice of one layer inside the layer loops (XLA turns it into an
    asynchronous host-to-device copy, ``dynamic-slice-start``/``-done``), and no device
    buffer holds a stacked ``[L, ...]`` base array."""
    from jmem._src.measure import _compile_for  # noqa: PLC0415
    from jmem._src.measure import report_from_compiled  # noqa: PLC0415

    reports = {}
    for offload in (False, True):
        step, state, batch = _streamed_qlora_step(offload)
        compiled = _compile_for(step.jitted, jmem.targets.get(TARGET), (state, batch), {})
        reports[offload] = report_from_compiled(compiled, TARGET)
    base_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.frozen))
    plain, streamed = reports[False], reports[True]
    assert plain.host_argument_bytes == 0
    assert streamed.host_argument_bytes == base_bytes
    assert streamed.argument_bytes == plain.argument_bytes - base_bytes
    assert streamed.peak_bytes < plain.peak_bytes
    text = compiled.as_text()
    stacked = {
        f"{jnp.dtype(x.dtype).name}[{','.join(map(str, x.shape))}]"
        for x in jax.tree.leaves(state.frozen["layers"])
    }
    for line in text.splitlines():  # a stacked shape appears only in host memory (S(5))
        for s in stacked:
            for hit in line.split(s + "{")[1:]:
                assert hit.split("}")[0].endswith("S(5)"), line[:200]
    starts = [ln for ln in text.splitlines() if "dynamic-slice-start" in ln and "S(5)" in ln]
    assert len(starts) >= 2 * len(stacked)  # each layer leaf: forward and backward loops


def test_fp8_llama_step_compiles_to_fp8_matmuls_on_the_target():
    """``jmem.fp8.apply`` over the Llama loss (tiny, bf16, 2,048 tokens in 1,024-token
    chunks, full remat) compiles for h100_sxm, and XLA:GPU runs the projections as FP8
    matmuls: the compiled HLO holds f8e4m3fn operands (forward) and f8e5m2 ones (the
    gradients, E5M2 in the backward pass, as Transformer Engine's hybrid format)."""
    from jmem.models import llama

    cfg = llama.CONFIGS["tiny"]
    params = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg, jnp.bfloat16))
    metas = jax.eval_shape(lambda p: jmem.fp8.init_metas(p, llama.LINEAR_NAMES), params)
    lv = jmem.Levers(remat="full", token_chunk=1024, fp8=True)
    loss = jmem.fp8.apply(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv))
    batch = {k: jax.ShapeDtypeStruct((1, 2048), jnp.int32) for k in ("inputs", "targets")}
    grad = jax.grad(jmem.remat(loss, "full"), argnums=(0, 1))
    compiled = _compile(grad, params, metas, batch)
    hlo = compiled.as_text()
    assert "f8e4m3fn" in hlo and "f8e5m2" in hlo
    assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2**20


def test_single_device_skip_is_a_select_without_a_second_state_copy():
    """On one h100_sxm device the non-finite skip of a full fine-tuning step (bf16 params,
    fp32 masters, AdamW) is a per-leaf select: no conditional in the HLO, and the
    temporaries are those of the step without the skip (a cond's branch copied every
    donated param and state leaf: 16 bytes per parameter). XLA:CPU keeps the cond."""
    from jmem._src.measure import _compile_for
    from jmem._src.measure import report_from_compiled

    cfg = jmem.models.llama.get_config("tiny")
    cfg = dataclasses.replace(cfg, hidden_size=512, intermediate_size=1536, num_layers=4)
    params = jax.eval_shape(
        lambda k: jmem.models.llama.init(k, cfg, jnp.bfloat16), jax.random.key(0)
    )
    n = sum(x.size for x in jax.tree.leaves(params))
    batch = {k: jax.ShapeDtypeStruct((1, 512), jnp.int32) for k in ("inputs", "targets")}
    temps, texts = {}, {}
    for skip in (True, False):
        step = jmem.train_step(
            lambda p, b: jmem.models.llama.loss_fn(p, b, cfg, levers=jmem.Levers()),
            optax.adamw(1e-4, mask=jmem.decay_mask),
            precision="p=bf16,c=bf16,o=f32",
            master_weights=True,
            remat="full",
            skip_nonfinite=skip,
        )
        state = step.abstract_state(params)
        compiled = _compile_for(step.jitted, jmem.targets.get(TARGET), (state, batch), {})
        temps[skip] = report_from_compiled(compiled, TARGET).temp_bytes
        texts[skip] = compiled.as_text()
    assert " conditional(" not in texts[True], "the skip compiled to a conditional"
    assert temps[True] <= temps[False] + 0.5 * n, (temps, n)


def _grpo_dry_run(tmp_path, capsys, argv):
    """``jmem finetune --objective grpo --dry-run --target h100_sxm``: its record and the
    lines that begin with a phase's name."""
    out = _qlora_dry_run(tmp_path, ["--objective", "grpo", *argv])
    lines = capsys.readouterr().out.splitlines()
    phases = {ln.split(":")[0]: ln for ln in lines if ln.startswith(("generation:", "training:"))}
    return out, phases, [ln for ln in lines if ln.startswith("resolver:")]


@pytest.mark.slow
def test_grpo_dry_run_prints_both_phases_next_to_the_planner(tmp_path, capsys):
    """Both GRPO phases of a small preset compile for h100_sxm: the rollout's micro-batch
    (prefill and decoding over the KV cache) and the training step, each printed as
    ``<phase>: ... device peak X (planner Y)``, the planner within 15% of each; the resolver
    picks the whole batch as the generation micro-batch (it fits 24 GiB)."""
    argv = ["--config", "llama_1b", "--num-generations", "4", "--batch-size", "4"]
    argv += ["--max-prompt-len", "128", "--max-completion-len", "384"]
    out, phases, why = _grpo_dry_run(tmp_path, capsys, argv)
    assert set(phases) == {"generation", "training"}
    assert "device peak" in phases["generation"] and "(planner " in phases["training"]
    assert any("generation batch 4: the largest divisor" in ln for ln in why)
    for rec in out["phases"].values():
        np.testing.assert_allclose(rec["planner_bytes"], rec["peak_bytes"], rtol=0.15)
    assert out["memory"] == 24 * 2**30 and out["fits"]


@pytest.mark.slow
def test_grpo_8b_20k_tokens_fits_24_gib_in_both_phases(tmp_path, capsys):
    """The GRPO figure: Llama-3.1-8B, LoRA r=32, 8 completions of 1,024 + 19,456 tokens: the
    resolver turns on layer-input offload for the training step and picks a generation
    micro-batch of 2 rows; both compiled peaks stay under 24 GiB (16.2 and 16.4 GiB when
    recorded; about 90 s of compiles on 2 cores)."""
    argv = ["--config", "llama3_1_8b", "--lora-rank", "32", "--num-generations", "8"]
    argv += ["--batch-size", "8", "--max-prompt-len", "1024", "--max-completion-len", "19456"]
    out, phases, why = _grpo_dry_run(tmp_path, capsys, argv)
    assert any(ln.startswith("resolver: --remat offload_inputs") for ln in why)
    assert out["args"]["remat"] == "offload_inputs" and out["args"]["generation_batch"] == 2
    for rec in out["phases"].values():
        assert rec["peak_bytes"] + 2e9 <= 24 * 2**30
    assert out["fits"]


@pytest.mark.slow
def test_estimate_grpo_target_prints_the_planner_and_the_compiled_phases(capsys):
    """``jmem estimate --objective grpo --target h100_sxm``: per phase the planner's line
    (XLA:GPU's buffers) and the compiled one with its verdict against ``--memory``."""
    from jmem.__main__ import main

    argv = ["estimate", "--model", "tiny", "--objective", "grpo", "--num-generations", "4"]
    argv += ["--batch-size", "8", "--max-prompt-len", "64", "--max-completion-len", "448"]
    assert main([*argv, "--memory", "24GiB", "--target", TARGET]) == 0
    lines = capsys.readouterr().out.splitlines()
    for phase in ("generation", "training"):
        planned = [ln for ln in lines if ln.startswith(f"{phase}: rows=")]
        compiled = [ln for ln in lines if ln.startswith(f"{phase}: compiled for {TARGET}")]
        assert len(planned) == len(compiled) == 1, lines
        assert compiled[0].endswith("fits 24 GiB")
