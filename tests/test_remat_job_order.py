"""Remat policies keep their memory order on the program users run: the fine-tuning job's
own train step (``jmem.finetune``'s ``build``: NF4 base or a bf16 base, LoRA on all seven
projections, bf16 compute, 8-bit AdamW), at ``tiny`` with 1 x 4,096 tokens on XLA:CPU.
Its compiled peak goes ``none >= dots >= selective >= full`` (2% slack) for QLoRA and LoRA,
with token chunks of 2,048 (the job's default) and without, with dense and blockwise
attention; on the h100_sxm compile too (``-m gpu_compile``).

Before the policies saw through the adapters and the token chunks, ``dots`` and
``selective`` peaked at 418.4 MiB on the blockwise QLoRA cell against 126.6 MiB for
``none``: every matmul inside each token chunk was saved, stacked over the chunks, and each
adapted projection saved both of its full-width terms (``docs/remat.md``). Which cells CI
runs: the fast cell and one per axis value (``slow``); the rest is ``exhaustive``.
"""

import contextlib
import io
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmem
from jmem import lora as jlora
from jmem import qlora
from jmem._src import lora_modules
from jmem._src.finetune.build import abstract_batch
from jmem._src.finetune.build import build
from jmem._src.finetune.build import quantized_base
from jmem._src.finetune.config_file import parse_args
from jmem._src.finetune.setup import model_config
from jmem._src.finetune.setup import resolve_defaults
from jmem.models import llama

ORDER = ("none", "dots", "selective", "full")
MIB = 2**20


def _job(policy: str, seq: int, attention: str, token_chunk: int | None, target=None):
    """The job's config for ``tiny`` at 1 x ``seq`` tokens (the job's defaults otherwise)."""
    argv = ["--config", "tiny", "--seq-len", str(seq), "--batch-size", "1", "--dry-run"]
    argv += ["--remat", policy, "--attention", attention, "--out", "unused"]
    if token_chunk is not None:
        argv += ["--token-chunk", str(token_chunk)]
    if target is not None:
        argv += ["--target", target]
    config = parse_args(argv)
    cfg = model_config(config)
    config, _ = resolve_defaults(config, cfg, on_gpu=False)
    return config, cfg


def _state(config, cfg, step, base: str):
    """The abstract state of the job's step: the NF4 base (``qlora``) or a bf16 base
    (``lora``), with the job's adapters on all seven projections."""
    if base == "qlora":
        frozen = quantized_base(config, cfg, jnp.bfloat16, abstract=True)
    else:
        frozen = llama.abstract_params(cfg, jnp.bfloat16)
    t = config.training
    adapters = jax.eval_shape(
        lambda k: jlora.init(
            k,
            frozen,
            rank=t.lora_rank,
            alpha=t.lora_alpha,
            modules=lora_modules.modules(t.lora_targets),
        ),
        jax.random.key(0),
    )
    return step.abstract_state(adapters, frozen=frozen)


def _lora_build(config, cfg, target):
    """``build``'s step with a bf16 base: the job's loss through ``jmem.lora.apply``."""
    import jmem._src.finetune.build as job_build  # noqa: PLC0415

    def loss(cfg, lv):
        def loss_fn(adapters, batch, *, frozen, dropout_key=None):
            fn = jlora.apply(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv))
            return fn(frozen, adapters, batch)

        return loss_fn

    with mock.patch.object(job_build, "_loss", loss):
        return build(config, cfg, target=target, disk=False)[0]


def peak(policy, base="qlora", attention="blockwise", token_chunk=None, seq=4096, target=None):
    """The compiled peak (bytes) of the job's train step."""
    config, cfg = _job(policy, seq, attention, token_chunk, target)
    if base == "qlora":
        step = build(config, cfg, target=target, disk=False)[0]
    else:
        step = _lora_build(config, cfg, target)
    state = _state(config, cfg, step, base)
    return step.measure(state, abstract_batch(config), target=target).peak_bytes


def check_order(peaks: dict) -> None:
    """``none >= dots >= selective >= full`` within 2% of the larger figure."""
    print({p: f"{v / MIB:.1f} MiB" for p, v in peaks.items()})
    for hi, lo in zip(ORDER, ORDER[1:]):
        assert peaks[lo] <= peaks[hi] * 1.02, (hi, lo, peaks)


_AXES = [
    ("qlora", "blockwise", None),  # the job's defaults: token chunks of 2,048
    ("qlora", "blockwise", 0),
    ("qlora", "dense", None),
    ("lora", "blockwise", None),
    ("qlora", "dense", 0),
    ("lora", "blockwise", 0),
    ("lora", "dense", None),
    ("lora", "dense", 0),
]
_CI = 4  # one cell per axis value: the first four


@pytest.mark.parametrize(
    "base,attention,token_chunk",
    [
        pytest.param(
            *cell, marks=() if i < _CI else (pytest.mark.exhaustive,), id="-".join(map(str, cell))
        )
        for i, cell in enumerate(_AXES)
    ],
)
@pytest.mark.slow
def test_order_on_the_job_step(base, attention, token_chunk):
    check_order({p: peak(p, base, attention, token_chunk) for p in ORDER})


def _saved_residuals(policy: str, seq: int) -> list[str]:
    config, cfg = _job(policy, seq, "blockwise", seq // 4)
    step = build(config, cfg, disk=False)[0]
    frozen = quantized_base(config, cfg, jnp.bfloat16, abstract=True)
    adapters = _state(config, cfg, step, "qlora").params
    lv = step.levers

    def loss(ad, batch):
        fn = qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv))
        return fn(frozen, ad, batch)

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(
            jmem.remat(loss, policy), adapters, abstract_batch(config)
        )
    return [line for line in buf.getvalue().splitlines() if "from the argument" not in line]


def test_dots_saves_no_chunk_internals_and_one_value_per_adapted_matmul():
    """The fast cell: under ``dots``, the QLoRA step at 128 tokens in chunks of 32 saves no
    MLP-wide ``[.., 688]`` value (the MLP lives inside the chunks, recomputed per chunk),
    and its 16-bit residuals are ``uint16`` bits (no float32 copy of their stacks on
    XLA:CPU). Before, each chunk's matmul outputs were saved, stacked over the chunks,
    both full-width terms of each adapted projection among them."""
    lines = _saved_residuals("dots", 128)
    mlp = [line for line in lines if re.match(r"\w+\[([\d,]*,)?688\]", line)]
    assert not mlp, mlp
    stacked = [line for line in lines if "output of scan" in line and "decoder.py" in line]
    # the layer input, q/k/v per chunk, the attention output (bits) and its f32 lse
    assert len(stacked) == 6, stacked
    assert all(line.startswith(("u16[", "f32[4,1,128,4,2]")) for line in stacked), stacked


_GPU = "h100_sxm"
_GPU_REASON = jmem.targets.unavailable_reason(_GPU)


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.skipif(_GPU_REASON is not None, reason=f"no XLA:GPU compiler here: {_GPU_REASON}")
@pytest.mark.parametrize(
    "attention", ["blockwise", pytest.param("cudnn", marks=pytest.mark.exhaustive)]
)
def test_order_on_the_job_step_for_h100(attention):
    """The same order on the h100_sxm compile (XLA:GPU, no GPU), QLoRA at the job's
    defaults, ``tiny`` at 4,096 tokens: measured 121.0 / 84.6 / 84.6 / 61.9 MiB for
    blockwise attention (docs/remat.md)."""
    check_order({p: peak(p, attention=attention, target=_GPU) for p in ORDER})


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dots", "selective", ("mlp_down",)])
def test_qlora_gradients_are_unchanged_by_the_saving_policies(policy):
    """bf16 QLoRA gradients through the rebuilt chunks, the named adapted matmuls and the
    ``uint16`` residuals equal those without remat, bitwise on XLA:CPU (the same values are saved or
    recomputed by the same ops), at 128 tokens in chunks of 32."""
    config, cfg = _job("none", 128, "blockwise", 32)
    lv = jmem.resolve_levers(jmem.Levers(attention="blockwise", token_chunk=32), cfg, (2, 128))
    params = llama.init(jax.random.key(0), cfg, jnp.bfloat16)
    frozen = qlora.quantize_params(params)
    adapters = jlora.init(jax.random.key(1), frozen, rank=4, alpha=8.0)
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)  # b = 0 would hide the LoRA path
    tokens = jax.random.randint(jax.random.key(2), (2, 129), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss(ad, b):
        fn = qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv))
        return fn(frozen, ad, b)

    want = jax.jit(jax.grad(loss))(adapters, batch)
    got = jax.jit(jax.grad(jmem.remat(loss, policy)))(adapters, batch)
    jax.tree.map(np.testing.assert_array_equal, got, want)  # bitwise on XLA:CPU
