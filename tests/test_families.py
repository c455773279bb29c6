"""Gemma 2, Gemma 3 (text), Qwen3, Phi-3 and OLMo 2 (a family added as a config mapping):
loading, NF4, PEFT adapters both ways, merged export and greedy generation, each against
transformers' own classes on tiny random float32 checkpoints (the oracle)."""

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_hf_adapters

import jmem
from jmem import lora
from jmem import qlora
from jmem.models import export
from jmem.models import families
from jmem.models import hf
from jmem.models import llama

pytestmark = pytest.mark.slow  # writes checkpoints: seconds per test

torch = pytest.importorskip("torch", reason="torch (CPU) is the oracles' runtime")
transformers = pytest.importorskip("transformers", reason="the families' classes are the oracle")

_TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

#: family -> (transformers config class prefix, CausalLM class prefix, config overrides,
#: expected jmem config fields). Windows of 8 and sequences of 40 exercise the windows;
#: initializer_range 0.3 makes Gemma's scores and logits large enough that the soft-caps act.
FAMILIES = {
    "qwen3": (
        "Qwen3",
        "Qwen3",
        dict(
            num_hidden_layers=3,
            head_dim=24,  # != hidden / heads
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,  # layer 0 global, 1-2 sliding
        ),
        dict(
            qk_norm="head",
            head_dim=24,
            layer_types=("full_attention", "sliding_attention", "sliding_attention"),
        ),
    ),
    "gemma2": (
        "Gemma2",
        "Gemma2",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=1.5,
            initializer_range=0.3,
        ),
        dict(
            norm_placement="sandwich",
            norm_offset=1.0,
            scale_embeddings=True,
            attn_scale=24**-0.5,
            attn_logit_softcap=2.0,
            final_logit_softcap=1.5,
            hidden_act="gelu_pytorch_tanh",
            layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        ),
    ),
    "gemma3": (
        "Gemma3Text",
        "Gemma3",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            initializer_range=0.3,
        ),
        dict(
            qk_norm="head",
            norm_placement="sandwich",
            rope_theta=1e6,
            rope_scaling=llama.RopeScaling("linear", 8.0),
            local_rope_theta=1e4,
        ),
    ),
    "phi3": (
        "Phi3",
        "Phi3",
        dict(num_hidden_layers=2, sliding_window=16),
        dict(fused_projections=True, sliding_window=16, layer_types=None),
    ),
    "olmo2": (
        "Olmo2",
        "Olmo2",
        dict(num_hidden_layers=2),
        dict(qk_norm="proj", norm_placement="post"),
    ),
}

LONG = np.random.default_rng(4).integers(3, 97, size=(2, 40))


def save_family(path, family, **overrides):
    """A tiny random float32 checkpoint of ``family`` written by transformers, with
    non-trivial norms (Gemma's stored around 0, the others around 1)."""
    config_prefix, model_prefix, extra, _ = FAMILIES[family]
    cfg = getattr(transformers, f"{config_prefix}Config")(**{**_TINY, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{model_prefix}ForCausalLM")(cfg).eval()
    low = -0.5 if family.startswith("gemma") else 0.5
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(low, low + 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{family: (directory, transformers model)}``, written once for the module."""
    root = tmp_path_factory.mktemp("families")
    return {f: (str(root / f), save_family(root / f, f)) for f in FAMILIES}


def _logits(model, tokens=LONG):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_chunked_loss_match_transformers(checkpoints, family):
    path, model = checkpoints[family]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    for field, value in FAMILIES[family][3].items():
        assert getattr(cfg, field) == value, (field, getattr(cfg, field))
    want = _logits(model)
    got = np.asarray(llama.forward(params, jnp.asarray(LONG, jnp.int32), cfg))
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)
    # loss_fn's chunked cross-entropy (final soft-cap inside) against the oracle's logits
    logz = np.log(np.sum(np.exp(want[:, :-1].astype(np.float64)), axis=-1))
    picked = np.take_along_axis(want[:, :-1], LONG[:, 1:, None], axis=-1)[..., 0]
    batch = {"inputs": jnp.asarray(LONG[:, :-1]), "targets": jnp.asarray(LONG[:, 1:])}
    loss = llama.loss_fn(params, batch, cfg, levers=jmem.Levers(loss_chunk=16))
    np.testing.assert_allclose(float(loss), np.mean(logz - picked), rtol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_nf4_on_load_equals_quantizing_dense_params(checkpoints, family):
    path, _ = checkpoints[family]
    dense, cfg = hf.load_params(path, dtype=jnp.float32)
    q, _ = hf.load_params(path, dtype=jnp.float32, quantize="nf4")
    ref = qlora.quantize_params(dense)
    assert jax.tree.structure(q) == jax.tree.structure(ref)
    for name in llama.linear_names(cfg):
        np.testing.assert_array_equal(
            q["layers"][name]["kernel"].packed, ref["layers"][name]["kernel"].packed
        )
    for name, leaf in dense["layers"].items():  # norms (QK-norms, post-norms) stay dense
        if "scale" in leaf:
            np.testing.assert_array_equal(q["layers"][name]["scale"], leaf["scale"])


def _peft_targets(cfg):
    """Two PEFT target modules of this family (Phi-3: its two fused ones)."""
    return ["qkv_proj", "gate_up_proj"] if cfg.fused_projections else ["k_proj", "down_proj"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_adapters_both_ways(checkpoints, family, tmp_path):
    """jmem adapters on every projection -> save_adapters -> PeftModel: jmem's logits
    (1e-4); PEFT's adapter -> load_adapters -> jmem: PEFT's logits (1e-4). Phi-3's fused
    qkv_proj / gate_up_proj are one adapter each, as in PEFT."""
    peft = pytest.importorskip("peft", reason="PEFT is the adapter-format oracle")
    path, model = checkpoints[family]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    ad = lora.init(jax.random.key(1), params, rank=4, alpha=8.0, targets=r"layers/.*_proj/kernel")
    assert sorted(ad) == sorted(f"layers/{n}/kernel" for n in llama.linear_names(cfg))
    ad = test_hf_adapters._perturb(ad)
    hf.save_adapters(str(tmp_path / "ad"), ad, cfg)
    c = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert c["target_modules"] == sorted(llama.linear_names(cfg))
    fwd = lora.apply(lambda p, t: llama.forward(p, t, cfg))
    base = test_hf_adapters._base
    want = _logits(peft.PeftModel.from_pretrained(base(path), str(tmp_path / "ad")).eval())
    got = np.asarray(fwd(params, ad, jnp.asarray(LONG, jnp.int32)))
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)
    assert _max_diff(want, _logits(model)) > 1e-2  # the adapters act

    theirs = test_hf_adapters.peft_made(base(path), _peft_targets(cfg), tmp_path / "theirs")
    want = _logits(theirs)
    back = hf.load_adapters(str(tmp_path / "theirs"), params, cfg)
    assert sorted(back) == sorted(f"layers/{n}/kernel" for n in _peft_targets(cfg))
    got = np.asarray(fwd(params, back, jnp.asarray(LONG, jnp.int32)))
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merged_export_loads_in_transformers(checkpoints, family, tmp_path):
    """Dense export -> AutoModelForCausalLM: the family's class, the original's logits
    (1e-4), the same config read back; NF4 base + adapters merged on export: jmem's QLoRA
    logits (1e-4)."""
    path, model = checkpoints[family]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    hf.save_params(str(tmp_path / "dense"), params, cfg, source=path)
    assert hf.load_config(str(tmp_path / "dense")) == cfg
    back = test_hf_adapters._base(str(tmp_path / "dense"))
    assert type(back).__name__ == f"{FAMILIES[family][1]}ForCausalLM"
    assert _max_diff(_logits(back), _logits(model)) <= 1e-4

    q, _ = hf.load_params(path, dtype=jnp.float32, quantize="nf4")
    ad = test_hf_adapters._perturb(lora.init(jax.random.key(2), q, rank=4))
    hf.save_params(str(tmp_path / "qlora"), q, cfg, adapters=ad, dtype=jnp.float32, source=path)
    want = np.asarray(
        lora.apply(lambda p, t: llama.forward(p, t, cfg))(q, ad, jnp.asarray(LONG, jnp.int32))
    )
    got = _logits(test_hf_adapters._base(str(tmp_path / "qlora")))
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)


def _word_tokenizer(directory, vocab_size=97):
    """A word-level tokenizer of ``vocab_size`` tokens (``t0`` ...), written as the source
    checkpoint's tokenizer files."""
    tokenizers = pytest.importorskip("tokenizers", reason="writes the source's tokenizer")
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t5"}, f)


def _with_eos(model, source, prompt):
    """Edits ``source`` so that its eos is a token the model's greedy continuation of
    ``prompt`` reaches (the latest one not generated before it: a random tiny model may
    repeat one token); returns ``(eos, steps to it)``."""
    with torch.no_grad():
        free = model.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
        ).numpy()[0, prompt.shape[1] :]
    k = max(i for i in range(len(free)) if free[i] not in free[:i])
    eos = int(free[k])
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(source, name)) as f:
            c = json.load(f)
        c.update(eos_token_id=[eos], pad_token_id=0, bos_token_id=1)
        with open(os.path.join(source, name), "w") as f:
            json.dump(c, f)
    return eos, k + 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merged_export_is_self_contained(checkpoints, family, tmp_path):
    """save_params(source=checkpoint): the export keeps the source's token ids and dtype,
    holds its tokenizer and generation config, loads with from_pretrained (Phi-3's default
    pad id 32000 would not), and transformers' generate stops at the source's eos."""
    path, model = checkpoints[family]
    src = tmp_path / "src"
    src.mkdir()
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f, open(src / name, "wb") as g:
            g.write(f.read())
    _word_tokenizer(src)
    prompt = LONG[:1, :6]
    eos, steps = _with_eos(model, src, prompt)
    params, cfg = hf.load_params(str(src), dtype=jnp.float32)
    out = tmp_path / "merged"
    hf.save_params(str(out), params, cfg, adapters={}, source=str(src))
    with open(src / "config.json") as f:
        source = json.load(f)
    with open(out / "config.json") as f:
        written = json.load(f)
    for field in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        assert written[field] == source[field], field
    assert written["torch_dtype"] == "float32" and hf.load_config(str(out)) == cfg
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    merged = test_hf_adapters._base(str(out))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_tokens_to_ids("t7") == 7
    with torch.no_grad():
        got = merged.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
        ).numpy()[0, prompt.shape[1] :]
    assert len(got) == steps and got[-1] == eos, (got, eos)


def test_export_carries_only_fields_that_do_not_set_the_computation():
    source = {
        "model_type": "qwen3",
        "eos_token_id": 151645,
        "hidden_size": 8,
        "rope_theta": 1.0,
        "torch_dtype": "bfloat16",
        "some_new_field": 3,
    }
    assert families.carried_fields(source, "qwen3") == {"eos_token_id": 151645, "some_new_field": 3}
    assert families.carried_fields(source, "llama") == {"eos_token_id": 151645}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generate_matches_transformers(checkpoints, family):
    path, model = checkpoints[family]
    params, cfg = hf.load_params(path, dtype=jnp.float32)
    prompt = np.random.default_rng(2).integers(3, 97, size=(2, 6))
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = model.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=14,  # 20 tokens: past the windows of 8 and 16
            do_sample=False,
        ).numpy()
    got = llama.generate(params, jnp.asarray(prompt, jnp.int32), cfg, max_new_tokens=14)
    np.testing.assert_array_equal(np.asarray(got), ref)


def _edited(checkpoints, family, **changes):
    with open(f"{checkpoints[family][0]}/config.json") as f:
        c = json.load(f)
    return {**c, **changes}


@pytest.mark.parametrize(
    "family,changes,match",
    [
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ("gemma2", {"hidden_activation": "tanh"}, "hidden_activation='tanh'"),
        ("gemma3", {"model_type": "gemma3"}, "model_type='gemma3'.*gemma3_text"),
        (
            "gemma3",
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "sliding_attention.rope_type='linear'",
        ),
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                }
            },
            "rope_type='longrope'",
        ),
        ("phi3", {"rope_scaling": {"type": "su", "short_factor": [1.0]}}, "rope_type='su'"),
        ("phi3", {"resid_pdrop": 0.1}, "resid_pdrop=0.1"),
        ("phi3", {"attention_bias": True}, "attention_bias=True"),
        (
            "phi3",  # Phi-4-mini's partial rotary (inside rope_parameters, as transformers 5)
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
            "partial_rotary_factor=0.75",
        ),
        ("qwen3", {"layer_types": ["full_attention", "chunked_attention", "x"]}, "layer_types"),
        ("olmo2", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ],
)
def test_unimplemented_fields_are_refused_by_name_and_value(checkpoints, family, changes, match):
    hf.config_from_dict(_edited(checkpoints, family))
    with pytest.raises(ValueError, match=match):
        hf.config_from_dict(_edited(checkpoints, family, **changes))


def test_gemma_layer_patterns_without_layer_types(checkpoints):
    """Before transformers 5, Gemma 2 alternated local/global layers implicitly and Gemma 3
    wrote sliding_window_pattern and rope_local_base_freq: the same layers load."""
    c = _edited(checkpoints, "gemma2")
    del c["layer_types"]
    assert hf.config_from_dict(c).layer_types == FAMILIES["gemma2"][3]["layer_types"]
    c = _edited(checkpoints, "gemma3", num_hidden_layers=7, sliding_window_pattern=3)
    del c["layer_types"]
    rope = c.pop("rope_parameters")
    c.update(
        rope_theta=rope["full_attention"]["rope_theta"],
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
    )
    cfg = hf.config_from_dict(c)
    assert [t[0] for t in cfg.layer_types] == list("ssfssfs")
    assert cfg.local_rope_theta == 1e4 and cfg.rope_scaling == llama.RopeScaling("linear", 8.0)


def test_hf_config_refuses_a_config_no_family_computes():
    cfg = llama.get_config("tiny", num_layers=2, qk_norm="head", fused_projections=True)
    with pytest.raises(ValueError, match="match no transformers family"):
        export.hf_config(cfg)
    # Gemma 2 has no per-layer RoPE base: the exported config could not say it
    gemma2 = hf.config_from_dict(families.hf_config(llama.get_config("gemma2_2b")))
    with pytest.raises(ValueError, match="cannot express.*local_rope_theta"):
        export.hf_config(llama.get_config(gemma2, local_rope_theta=1e4))


_IDS = dict(bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.02, use_cache=True)
#: config.json of published checkpoints (the fields that shape the model), and the preset.
PUBLISHED = {
    "gemma2_2b": dict(
        architectures=["Gemma2ForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        attn_logit_softcapping=50.0,
        cache_implementation="hybrid",
        final_logit_softcapping=30.0,
        head_dim=256,
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        hidden_size=2304,
        intermediate_size=9216,
        max_position_embeddings=8192,
        model_type="gemma2",
        num_attention_heads=8,
        num_hidden_layers=26,
        num_key_value_heads=4,
        query_pre_attn_scalar=256,
        rms_norm_eps=1e-06,
        rope_theta=10000.0,
        sliding_window=4096,
        torch_dtype="float32",
        transformers_version="4.42.4",
        vocab_size=256000,
    ),
    "gemma3_1b": dict(
        architectures=["Gemma3ForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        attn_logit_softcapping=None,
        cache_implementation="hybrid",
        final_logit_softcapping=None,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        hidden_size=1152,
        intermediate_size=6912,
        max_position_embeddings=32768,
        model_type="gemma3_text",
        num_attention_heads=4,
        num_hidden_layers=26,
        num_key_value_heads=1,
        query_pre_attn_scalar=256,
        rms_norm_eps=1e-06,
        rope_local_base_freq=10000,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=512,
        sliding_window_pattern=6,
        torch_dtype="bfloat16",
        transformers_version="4.50.0.dev0",
        vocab_size=262144,
    ),
    "qwen3_0_6b": dict(
        architectures=["Qwen3ForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        head_dim=128,
        hidden_act="silu",
        hidden_size=1024,
        intermediate_size=3072,
        max_position_embeddings=40960,
        max_window_layers=28,
        model_type="qwen3",
        num_attention_heads=16,
        num_hidden_layers=28,
        num_key_value_heads=8,
        rms_norm_eps=1e-06,
        rope_scaling=None,
        rope_theta=1000000,
        sliding_window=None,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        transformers_version="4.51.0",
        use_sliding_window=False,
        vocab_size=151936,
    ),
    "phi3_mini": dict(
        architectures=["Phi3ForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        auto_map={"AutoConfig": "configuration_phi3.Phi3Config"},
        embd_pdrop=0.0,
        hidden_act="silu",
        hidden_size=3072,
        intermediate_size=8192,
        max_position_embeddings=4096,
        model_type="phi3",
        num_attention_heads=32,
        num_hidden_layers=32,
        num_key_value_heads=32,
        original_max_position_embeddings=4096,
        resid_pdrop=0.0,
        rms_norm_eps=1e-05,
        rope_scaling=None,
        rope_theta=10000.0,
        sliding_window=2047,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        transformers_version="4.40.2",
        vocab_size=32064,
    ),
}

#: parameter counts published for those checkpoints (safetensors totals / model cards).
PUBLISHED_PARAMS = {
    "gemma2_2b": 2_614_341_888,
    "gemma2_9b": 9_241_705_984,
    "gemma3_1b": 999_885_952,
    "qwen3_0_6b": 596_049_920,  # its file also stores the tied head: 751,632,384
    "qwen3_8b": 8_190_735_360,
    "phi3_mini": 3_821_079_552,
    "olmo2_7b": 7_298_617_344,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_configs_load_as_the_presets_without_warnings(preset):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = hf.config_from_dict({**_IDS, **PUBLISHED[preset]})
    assert cfg == llama.get_config(preset), (cfg, llama.get_config(preset))


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_counts_equal_the_published_ones(preset):
    assert llama.num_params(llama.get_config(preset)) == PUBLISHED_PARAMS[preset]
    hash(llama.get_config(preset))  # a static jit argument


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_main_job_trains_each_family_and_peft_loads_its_adapter(tmp_path, family):
    """``python examples/qlora_7b.py --checkpoint DIR`` (NF4 on load, byte tokenizer on a
    260-token vocabulary) trains the family, and PeftModel on the transformers model with
    the adapter directory it wrote computes jmem's logits (dense base + adapters, 1e-4)."""
    peft = pytest.importorskip("peft", reason="loads the adapters the run wrote")
    ckpt = tmp_path / "hf"
    save_family(ckpt, family, vocab_size=260)
    root = os.path.join(os.path.dirname(__file__), "..")
    argv = ["--checkpoint", str(ckpt), "--tokenizer", "byte", "--steps", "3", "--seq-len", "16"]
    argv += ["--batch-size", "2", "--lora-rank", "2", "--lr", "1e-2", "--no-progress"]
    argv += ["--out", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root)}
    run = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "qlora_7b.py"), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    adapter_dir = str(tmp_path / "run" / "adapter")
    params, cfg = hf.load_params(str(ckpt), dtype=jnp.float32)
    adapters = hf.load_adapters(adapter_dir, params, cfg)
    assert sorted(adapters) == sorted(f"layers/{n}/kernel" for n in llama.linear_names(cfg))
    assert any(float(jnp.abs(w.b).max()) > 0 for w in adapters.values())  # trained
    adapters = jax.tree.map(lambda x: x.astype(jnp.float32), adapters)
    tokens = np.arange(3, 23, dtype=np.int32)[None]
    ours = lora.apply(lambda p, t: llama.forward(p, t, cfg))(params, adapters, tokens)
    base = test_hf_adapters._base(str(ckpt))
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    assert _max_diff(ours, _logits(model, tokens)) <= 1e-4


# Gemma's chat templates (tokenizer_config.json of google/gemma-2-2b-it, gemma-3-1b-it):
# no system role in Gemma 2 (an error), Gemma 3 folds it into the first user turn.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif "
    "%}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


@pytest.mark.parametrize("template", [GEMMA2_TEMPLATE, GEMMA3_TEMPLATE], ids=["gemma2", "gemma3"])
def test_gemma_chat_templates_render_as_transformers(template):
    """jmem.data's renderer gives transformers' apply_chat_template text, assistant spans
    that hold the answers, and transformers' error text where the template raises (Gemma 2:
    no system role)."""
    tokenizers = pytest.importorskip("tokenizers", reason="builds the oracle tokenizer")
    from jmem._src.data import chat_template  # noqa: PLC0415

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, "<unk>")),
        bos_token="<bos>",
        eos_token="<eos>",
    )
    tok.chat_template = template
    chat = [
        {"role": "user", "content": "Hi "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    system = [{"role": "system", "content": "Be brief."}, *chat]
    for messages in (chat, system):
        if template is GEMMA2_TEMPLATE and messages is system:
            with pytest.raises(Exception, match="System role not supported") as theirs:
                tok.apply_chat_template(messages, tokenize=False)
            with pytest.raises(ValueError, match=f"conversation: {theirs.value}$"):
                chat_template.render_chat(messages, template, bos_token="<bos>")
            continue
        want = tok.apply_chat_template(messages, tokenize=False)
        assert chat_template.render_chat(messages, template, bos_token="<bos>") == want
        text, spans = chat_template.assistant_spans(messages, template, bos_token="<bos>")
        assert [text[a:b] for a, b in spans] == ["Hello.<end_of_turn>\n", "4<end_of_turn>\n"]


def _family_config(checkpoints, family, **overrides):
    return llama.get_config(hf.load_config(checkpoints[family][0]), **overrides)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_remat_saves_memory_and_keeps_gradients_on_each_family(checkpoints, family):
    """jmem.remat(loss, "full") on each family: the gradients of the plain loss (float32
    rounding), and at most half its temporary bytes (compiled memory_analysis)."""
    import jmem  # noqa: PLC0415

    cfg = _family_config(checkpoints, family)
    params = llama.init(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 257), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    loss = lambda p, b: llama.loss_fn(p, b, cfg)
    plain = jmem.measure(jax.grad(loss), params, batch).temp_bytes
    remat = jmem.measure(jax.grad(jmem.remat(loss, "full")), params, batch).temp_bytes
    assert remat <= 0.5 * plain, (remat, plain)
    got = jax.jit(jax.grad(jmem.remat(loss, "full")))(params, batch)
    want = jax.jit(jax.grad(loss))(params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got, want)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_long_context_paths_match_dense_with_family_features(checkpoints, family):
    """Memory-efficient attention (jmem.ops' blockwise, 3 query and key blocks of 512 at
    1030 tokens) and the token-local chunks (256 tokens: norms, projections, RoPE, MLP) under
    soft-capping, per-layer windows, a custom scale, QK-norm, sandwich and post norms and
    fused projections: the dense, untiled logits and gradients (1e-5)."""
    import jmem  # noqa: PLC0415

    cfg = _family_config(checkpoints, family)
    dense = jmem.Levers(attention="dense", token_chunk=0)
    blockwise = jmem.Levers(attention="blockwise", token_chunk=256)
    params = llama.init(jax.random.key(0), cfg)
    params = jax.tree.map(lambda x: x * 10 if x.ndim == 3 else x, params)  # caps act
    tokens = jax.random.randint(jax.random.key(1), (1, 1031), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    np.testing.assert_allclose(
        llama.forward(params, batch["inputs"], cfg, levers=blockwise),
        llama.forward(params, batch["inputs"], cfg, levers=dense),
        atol=1e-5,
    )
    grad = jax.jit(jax.grad(lambda p, b, lv: llama.loss_fn(p, b, cfg, levers=lv)), static_argnums=2)
    g_block, g_dense = grad(params, batch, blockwise), grad(params, batch, dense)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g_block, g_dense)


# ------------------------------------------------------- one table of model knowledge


def test_presets_family_options_and_linear_names_come_from_one_table():
    from jmem._src import model_table

    assert list(llama.CONFIGS) == list(model_table.PRESETS)
    assert llama.LINEAR_NAMES is model_table.LINEAR_NAMES
    assert llama.FUSED_LINEAR_NAMES is model_table.FUSED_LINEAR_NAMES
    for model_type, fam in families.FAMILIES.items():
        assert dict(fam.options) == model_table.FAMILY_OPTIONS[model_type], model_type
    for name, preset in model_table.PRESETS.items():
        cfg = llama.get_config(name)
        # the family a preset names is the one the family table finds for its config
        assert families.family_of(cfg) == preset["family"], name
        for option, value in model_table.FAMILY_OPTIONS[preset["family"]].items():
            assert getattr(cfg, option) == value, (name, option)


def test_llama_shaped_families_are_chosen_by_their_rejects_entries():
    small = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    assert families.family_of(llama.get_config("tiny", **small)) == "llama"
    assert families.family_of(llama.get_config("tiny", sliding_window=8, **small)) == "mistral"
    qkv = ("q_proj", "k_proj", "v_proj")
    assert families.family_of(llama.get_config("tiny", biases=qkv, **small)) == "qwen2"
    softcapped = llama.get_config("tiny", final_logit_softcap=30.0, **small)
    with pytest.raises(ValueError, match="Llama has no per-layer attention types or soft-caps"):
        families.family_of(softcapped)
    for name in ("llama", "mistral", "qwen2"):
        assert families.FAMILIES[name].rejects(softcapped), name
    # a Windows entry writes what it reads back: layer types from its own rule
    six = {**small, "num_layers": 6}
    for model_type in ("qwen2", "gemma2", "gemma3_text"):
        fam = families.FAMILIES[model_type]
        types = fam.windows.layer_types({"max_window_layers": 1}, 6)
        assert len(set(types)) == 2, (model_type, types)
        cfg = llama.get_config("tiny", sliding_window=8, layer_types=tuple(types), **six)
        written = families.write_windows(cfg, model_type)
        del written["layer_types"]  # placed by the rule alone
        read = families.layer_windows({"num_hidden_layers": 6, **written}, fam)
        assert read == (8, tuple(types)), (model_type, read)
