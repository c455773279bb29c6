"""jmem.targets without the GPU compiler: names, device facts, errors, and backend choices
that resolve for the platform being compiled for (the compiles themselves are in
tests/test_gpu_compile.py, ``-m gpu_compile``)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jmem
from jmem._src.attention import attention

GIB = 2**30


def test_named_targets_and_their_memory():
    names = set(jmem.targets.NAMES)
    assert {"h100_sxm", "h200", "a100_sxm_80", "a100_sxm_40", "b200", "rtx4090", "cpu"} <= names
    assert jmem.targets.get("h100_sxm").memory_bytes == 84942979072  # 79.1 GiB usable
    assert 23.9 * GIB < jmem.targets.get("rtx4090").memory_bytes <= 24 * GIB
    assert jmem.targets.get("a100_sxm_40").memory_bytes < 40 * GIB
    t = jmem.targets.get("h200")
    assert jmem.targets.get(t) is t and t.platform == "gpu"
    cpu = jmem.targets.get("cpu")
    assert cpu.platform == "cpu" and cpu.memory_bytes is None and cpu.target_config is None


@pytest.mark.parametrize("name", ["h100_sxm", "h200", "a100_sxm_80", "a100_sxm_40", "b200"])
def test_gpu_configs_carry_the_device_facts_jaxlib_accepts(name):
    """Each config is a ``GpuTargetConfigProto`` text with the device's memory and compute
    capability, and without ``collective_memory_granularity`` (jaxlib 0.10's proto lacks it:
    parsing would fail)."""
    t = jmem.targets.get(name)
    text = t.target_config
    assert f"device_memory_size: {t.memory_bytes}" in text
    assert 'platform_name: "CUDA"' in text and f'"{t.description}"' in text
    assert "collective_memory_granularity" not in text
    major = {"h100_sxm": 9, "h200": 9, "a100_sxm_80": 8, "a100_sxm_40": 8, "b200": 10}[name]
    assert f"cuda_compute_capability {{ major: {major} " in text


def test_bad_names_and_arguments_raise_one_line():
    with pytest.raises(ValueError, match="h100_sxm, h200") as e:
        jmem.targets.get("h100")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="positive int"):
        jmem.targets.devices("cpu", 0)
    with pytest.raises(ValueError, match="same length"):
        jmem.targets.mesh("cpu", (2, 2), ("x",))
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        jmem.targets.devices("cpu", 10_000)


def test_cpu_target_is_the_host():
    assert jmem.targets.devices("cpu", 2) == jax.devices("cpu")[:2]
    m = jmem.targets.mesh("cpu", (2, 4), ("data", "fsdp"))
    assert isinstance(m, jax.sharding.Mesh) and m.shape == {"data": 2, "fsdp": 4}
    assert jmem.targets.current().name == "cpu"
    assert jmem.targets.unavailable_reason("cpu") is None


def test_missing_plugin_names_the_extra():
    """Without the CUDA plugin a GPU target says, in one line, what to install."""
    reason = jmem.targets.unavailable_reason("h100_sxm")
    if reason is None:
        pytest.skip("the CUDA plugin is installed: tests/test_gpu_compile.py compiles")
    assert "\n" not in reason
    assert 'pip install "jmem[gpu-plan]"' in reason or "JAX_PLATFORMS=cpu" in reason
    with pytest.raises(RuntimeError, match="gpu-plan|JAX_PLATFORMS"):
        jmem.targets.devices("h100_sxm", 8)


def test_compile_platform_follows_the_default_device():
    seen = []

    def f(x):
        seen.append(jmem.targets.compile_platform())
        return x + 1

    jax.jit(f).lower(jax.ShapeDtypeStruct((2,), jnp.float32))
    with jax.default_device(jax.devices("cpu")[0]):
        jax.jit(f).lower(jax.ShapeDtypeStruct((3,), jnp.float32))
    assert seen == ["cpu", "cpu"]


def test_attention_platform_resolves_cudnn_for_the_platform_given():
    """``platform=`` decides what ``"auto"``/``"cudnn"`` resolve for: on "gpu" cuDNN is
    chosen (its trace is jax's cuDNN rule), on "cpu" it is refused with the reason."""
    q = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
    idx = jnp.arange(16)
    with pytest.raises(ValueError, match="compiling for 'cpu'"):
        attention(q, q, q, q_index=idx, implementation="cudnn", platform="cpu")
    with pytest.raises(ValueError, match="platform must be"):
        attention(q, q, q, q_index=idx, platform="cuda")
    cpu = jax.make_jaxpr(lambda a: attention(a, a, a, q_index=idx, platform="cpu"))(q)
    assert "_dot_product_attention" not in str(cpu)
    try:
        gpu = str(jax.make_jaxpr(lambda a: attention(a, a, a, q_index=idx, platform="gpu"))(q))
    except RuntimeError as e:  # without cuDNN installed jax refuses its cuDNN path (chosen)
        assert "cuDNN is not detected" in str(e)
    else:
        assert "_dot_product_attention_fwd" in gpu  # jax.nn's cuDNN rule


def test_measure_reports_device_and_host_apart_on_cpu():
    """On the CPU target the report names it, keeps host bytes apart, and ``target="cpu"``
    equals the default."""
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    r = jmem.measure(lambda a: a @ a, x, target="cpu")
    assert r == jmem.measure(lambda a: a @ a, x)
    assert r.target == "cpu" and r.source == "compiler" and r.host_peak_bytes == 0
    assert "device peak" in str(r)
    with pytest.raises(ValueError, match="unknown"):
        jmem.measure(lambda a: a, x, target="tpu_v9")


def test_a_step_on_a_cpu_mesh_says_how_to_measure_it_for_a_gpu():
    mesh = jmem.sharding.make_mesh(1, 2, devices=jax.devices()[:2])
    step = jmem.train_step(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match=r"mesh=jmem.targets.mesh\('h100_sxm'"):
        step.measure(None, None, target="h100_sxm")


def test_the_job_refuses_target_without_dry_run(capsys):
    """``jmem finetune --target`` compiles only: without ``--dry-run`` one line, status 2;
    a GPU target without the extra names it (skipped where the extra is installed)."""
    from jmem import finetune

    with pytest.raises(SystemExit) as e:
        finetune.main(["--config", "tiny", "--target", "h100_sxm", "--steps", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "add --dry-run" in err
    if jmem.targets.unavailable_reason("h100_sxm") is None:
        pytest.skip("the gpu-plan extra is installed here")
    with pytest.raises(SystemExit) as e:
        finetune.main(["--config", "tiny", "--target", "h100_sxm", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "jmem[gpu-plan]" in err and err.count("\n") == 1


def test_estimate_target_refuses_what_the_job_does_not_compile(capsys):
    """``jmem estimate --target`` compiles the job's step (QLoRA, or full fine-tuning with
    ``--lora-rank 0``): a parameter count or LoRA on a float base gets one line, status 2."""
    from jmem.__main__ import main

    for argv in (["--model", "7B"], ["--model", "tiny", "--quant", "none"]):
        with pytest.raises(SystemExit) as e:
            main(["estimate", *argv, "--target", "cpu"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "--target compiles" in err
