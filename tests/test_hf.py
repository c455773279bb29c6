"""Loading Hugging Face Llama/Mistral/Qwen2 checkpoints and generating; oracle: transformers'
LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (torch CPU, float32)."""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import nf4
from jmem import qlora
from jmem.models import hf
from jmem.models import llama

pytestmark = pytest.mark.slow  # writes checkpoints and trains: seconds per test

torch = pytest.importorskip(
    "torch", reason="torch (CPU) is the oracle's runtime; install the test extra"
)
transformers = pytest.importorskip(
    "transformers", reason="transformers' LlamaForCausalLM is the oracle"
)


def _save_tiny(tmp_path, tie=False, shard=True):
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(
        tmp_path, safe_serialization=True, max_shard_size="100KB" if shard else "1GB"
    )
    return model


@pytest.mark.parametrize("tie,shard", [(False, True), (True, False)])
def test_logits_match_transformers(tmp_path, tie, shard):
    model = _save_tiny(tmp_path, tie=tie, shard=shard)
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == shard
    params, cfg = hf.load_params(str(tmp_path), dtype=jnp.float32)
    assert cfg.num_kv_heads == 2 and cfg.rope_theta == 50000.0 and cfg.tie_embeddings == tie
    tokens = np.random.default_rng(0).integers(0, 97, size=(2, 24))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(llama.forward(params, jnp.asarray(tokens, jnp.int32), cfg))
    assert np.max(np.abs(got - ref)) <= 1e-4, np.max(np.abs(got - ref))


def test_nf4_load_quantizes_layer_by_layer(tmp_path):
    _save_tiny(tmp_path)
    dense, cfg = hf.load_params(str(tmp_path), dtype=jnp.float32)
    q, _ = hf.load_params(str(tmp_path), dtype=jnp.float32, quantize="nf4")
    k = q["layers"]["q_proj"]["kernel"]
    assert isinstance(k, nf4.NF4Array) and k.shape == dense["layers"]["q_proj"]["kernel"].shape
    # stacking per-layer quantizations equals quantizing the stack (each matrix on its own)
    ref = nf4.quantize(dense["layers"]["q_proj"]["kernel"])
    np.testing.assert_array_equal(k.packed, ref.packed)
    np.testing.assert_allclose(nf4.dequantize(k, jnp.float32), nf4.dequantize(ref, jnp.float32))
    assert not isinstance(q["embed"]["embedding"], nf4.NF4Array)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load_config(str(tmp_path))
    _save_tiny(tmp_path, shard=False)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        hf.load_params(str(tmp_path))
    c = json.loads((tmp_path / "config.json").read_text())
    c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="rope_scaling.rope_type='yarn'.*llama3"):
        hf.load_config(str(tmp_path))


_TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
)

#: family -> (transformers class name, config overrides, expected jmem config fields)
FAMILIES = {
    "llama3_scaling": (
        "Llama",
        dict(
            rope_theta=500000.0,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,  # short, so seq 40 exercises it
            },
        ),
        dict(rope_scaling=llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 16), tie_embeddings=True),
    ),
    "linear_scaling": (
        "Llama",
        dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
        dict(rope_scaling=llama.RopeScaling("linear", 4.0)),
    ),
    "mistral_sliding": ("Mistral", dict(sliding_window=16), dict(sliding_window=16)),
    "qwen2": ("Qwen2", dict(), dict(biases=("q_proj", "k_proj", "v_proj"))),
    "llama_biases": (
        "Llama",
        dict(attention_bias=True, mlp_bias=True),
        dict(biases=llama.LINEAR_NAMES),
    ),
    "llama_gelu": ("Llama", dict(hidden_act="gelu"), dict(hidden_act="gelu")),
}


def _save_family(tmp_path, family):
    arch, overrides, _ = FAMILIES[family]
    cfg = getattr(transformers, f"{arch}Config")(**{**_TINY, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a dropped one would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_logits_match_transformers(tmp_path, family):
    model = _save_family(tmp_path, family)
    params, cfg = hf.load_params(str(tmp_path), dtype=jnp.float32)
    for field, value in FAMILIES[family][2].items():
        assert getattr(cfg, field) == value, (field, getattr(cfg, field))
    tokens = np.random.default_rng(0).integers(0, 97, size=(2, 40))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(llama.forward(params, jnp.asarray(tokens, jnp.int32), cfg))
    assert np.max(np.abs(got - ref)) <= 1e-4, np.max(np.abs(got - ref))


def test_rope_scaling_spelled_before_transformers_5(tmp_path):
    _save_family(tmp_path, "llama3_scaling")
    new = hf.load_config(str(tmp_path))
    c = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in c  # what the installed transformers writes
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}  # oldest spelling: "type"
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert hf.load_config(str(tmp_path)) == new


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_nf4_on_load_equals_quantizing_dense_params(tmp_path, family):
    _save_family(tmp_path, family)
    dense, cfg = hf.load_params(str(tmp_path), dtype=jnp.float32)
    q, _ = hf.load_params(str(tmp_path), dtype=jnp.float32, quantize="nf4")
    ref = qlora.quantize_params(dense)
    assert jax.tree.structure(q) == jax.tree.structure(ref)
    for name in llama.LINEAR_NAMES:
        np.testing.assert_array_equal(
            q["layers"][name]["kernel"].packed, ref["layers"][name]["kernel"].packed
        )
    for name in cfg.biases:  # biases stay dense, as read
        np.testing.assert_array_equal(q["layers"][name]["bias"], dense["layers"][name]["bias"])
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, size=(1, 16)), jnp.int32)
    got = llama.forward(qlora.dequantize_params(q), tokens, cfg)
    want = llama.forward(qlora.dequantize_params(ref), tokens, cfg)
    np.testing.assert_allclose(got, want, atol=1e-5)


def _edit_config(tmp_path, **changes):
    c = json.loads((tmp_path / "config.json").read_text())
    c.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"hidden_act": "tanh"}, "hidden_act='tanh'.*silu"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        (
            {
                "rope_parameters": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor=0.5",
        ),
        ({"rope_scaling": {"type": "linear"}}, r"rope_type='linear' lacks \['factor'\]"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            r"lacks \['high_freq_factor', 'low_freq_factor'",
        ),
        ({"model_type": "gemma"}, "model_type='gemma'.*qwen2"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method='gptq'"),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["full_attention", "chunked_attention"],
            },
            "layer_types=.*chunked_attention",
        ),
    ],
)
def test_unimplemented_config_fields_are_refused(tmp_path, changes, match):
    _save_family(tmp_path, "qwen2")
    c = json.loads((tmp_path / "config.json").read_text())
    c.pop("layer_types")  # as transformers < 5 wrote it: derived from max_window_layers
    (tmp_path / "config.json").write_text(json.dumps(c))
    hf.load_config(str(tmp_path))
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        hf.load_config(str(tmp_path))


def test_unread_tensors_are_an_error(tmp_path):
    model = _save_family(tmp_path, "llama_biases")
    _edit_config(tmp_path, attention_bias=False)  # the biases are in the file, not the config
    with pytest.raises(ValueError, match=r"8 tensors.*layers\.0\.self_attn\.k_proj\.bias"):
        hf.load_params(str(tmp_path), dtype=jnp.float32)
    params, cfg = hf.load_params(str(tmp_path), dtype=jnp.float32, allow_unused=True)
    assert cfg.biases == ("gate_proj", "up_proj", "down_proj")
    assert "bias" not in params["layers"]["q_proj"]
    del model


def test_legacy_rope_scaling_wins_over_a_default_rope_parameters(tmp_path):
    """transformers 5 writes ``rope_parameters: {rope_type: default}``; an older tool's
    ``rope_scaling`` next to it decides the type (its factor is not an unknown key)."""
    _save_family(tmp_path, "qwen2")
    _edit_config(tmp_path, rope_scaling={"type": "linear", "factor": 4.0})
    assert hf.load_config(str(tmp_path)).rope_scaling == llama.RopeScaling("linear", 4.0)


def test_a_tensor_missing_from_the_index_is_still_reported(tmp_path):
    """A tensor stored in a shard but absent from model.safetensors.index.json is part of
    the checkpoint: unread, it is an error as without an index."""
    from safetensors.numpy import load_file  # noqa: PLC0415
    from safetensors.numpy import save_file  # noqa: PLC0415

    _save_family(tmp_path, "qwen2")
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    tensors["model.layers.9.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard.name for k in tensors}}
    del index["weight_map"]["model.layers.9.mlp.up_proj.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"1 tensors.*layers\.9\.mlp\.up_proj"):
        hf.load_params(str(tmp_path), dtype=jnp.float32)


def test_unknown_config_field_warns(tmp_path):
    _save_tiny(tmp_path, shard=False)
    _edit_config(tmp_path, attn_logit_softcapping=30.0)
    with pytest.warns(UserWarning, match="attn_logit_softcapping"):
        hf.load_config(str(tmp_path))
    _edit_config(tmp_path, attn_logit_softcapping=None)  # null: nothing to implement
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.load_config(str(tmp_path))


@pytest.mark.parametrize("family", ["llama3_scaling", "mistral_sliding", "qwen2"])
def test_greedy_generate_matches_transformers(tmp_path, family):
    model = _save_family(tmp_path, family)
    params, cfg = hf.load_params(str(tmp_path), dtype=jnp.float32)
    prompt = np.random.default_rng(2).integers(0, 97, size=(2, 12))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = model.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
        ).numpy()
    got = llama.generate(params, jnp.asarray(prompt, jnp.int32), cfg, max_new_tokens=10)
    assert got.dtype == jnp.int32 and got.shape == (2, 22)
    np.testing.assert_array_equal(np.asarray(got), ref)  # 22 > window 16 for mistral


def test_bfloat16_checkpoint_loads_exactly(tmp_path):
    model = _save_family(tmp_path, "qwen2").to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)  # as published checkpoints
    params, cfg = hf.load_params(str(tmp_path), dtype=jnp.bfloat16)
    assert params["embed"]["embedding"].dtype == jnp.bfloat16
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(
        np.asarray(params["embed"]["embedding"], np.float32), sd["model.embed_tokens.weight"]
    )
    np.testing.assert_array_equal(
        np.asarray(params["layers"]["q_proj"]["bias"][1], np.float32),
        sd["model.layers.1.self_attn.q_proj.bias"],
    )
    np.testing.assert_array_equal(
        np.asarray(params["layers"]["down_proj"]["kernel"][0], np.float32),
        sd["model.layers.0.mlp.down_proj.weight"].T,
    )


_COMMON = dict(bos_token_id=1, eos_token_id=2, initializer_range=0.02, use_cache=True)
#: config.json of published checkpoints (the fields that shape the model), and our preset.
PUBLISHED = {
    "llama3_1_8b": dict(
        architectures=["LlamaForCausalLM"],
        attention_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
        hidden_size=4096,
        intermediate_size=14336,
        max_position_embeddings=131072,
        mlp_bias=False,
        model_type="llama",
        num_attention_heads=32,
        num_hidden_layers=32,
        num_key_value_heads=8,
        pretraining_tp=1,
        rms_norm_eps=1e-05,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        rope_theta=500000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        transformers_version="4.43.0.dev0",
        vocab_size=128256,
    ),
    "mistral_7b": dict(
        architectures=["MistralForCausalLM"],
        hidden_act="silu",
        hidden_size=4096,
        intermediate_size=14336,
        max_position_embeddings=32768,
        model_type="mistral",
        num_attention_heads=32,
        num_hidden_layers=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-05,
        rope_theta=10000.0,
        sliding_window=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        transformers_version="4.34.0.dev0",
        vocab_size=32000,
    ),
    "qwen2_5_7b": dict(
        architectures=["Qwen2ForCausalLM"],
        attention_dropout=0.0,
        hidden_act="silu",
        hidden_size=3584,
        intermediate_size=18944,
        max_position_embeddings=32768,
        max_window_layers=28,
        model_type="qwen2",
        num_attention_heads=28,
        num_hidden_layers=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-06,
        rope_scaling=None,
        rope_theta=1000000.0,
        sliding_window=131072,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        transformers_version="4.43.1",
        use_sliding_window=False,
        vocab_size=152064,
    ),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_configs_load_as_the_presets_without_warnings(preset):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = hf.config_from_dict({**_COMMON, **PUBLISHED[preset]})
    assert cfg == llama.get_config(preset), (cfg, llama.get_config(preset))


def test_tied_checkpoint_storing_a_head_is_checked(tmp_path):
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file

    _save_tiny(tmp_path, tie=True, shard=False)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, path)
    hf.load_params(str(tmp_path), dtype=jnp.float32)  # the same matrix: read and accepted
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, path)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hf.load_params(str(tmp_path), dtype=jnp.float32)


@pytest.mark.parametrize("family", ["llama3_scaling", "mistral_sliding", "qwen2"])
def test_greedy_rollout_of_left_padded_prompts_matches_transformers(tmp_path, family):
    """Left padding (an attention_mask, positions from each row's first real token) and the
    stop at EOS, as transformers' ``generate``; rows after their EOS hold the pad id."""
    model = _save_family(tmp_path, family)
    params, cfg = hf.load_params(str(tmp_path), dtype=jnp.float32)
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, 97, size=(3, 9))
    mask = (np.arange(9)[None] >= np.asarray([[0], [4], [2]])).astype(np.int64)
    prompt = prompt * mask  # pad id 0 on the left
    kw = dict(num_generations=1, max_new_tokens=12, temperature=0.0)
    free = llama.rollout(params, prompt, mask, cfg, **kw)
    eos = int(free.completion_ids[1, 3])  # row 1 stops at its fourth token
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = model.generate(
            torch.tensor(prompt),
            attention_mask=torch.tensor(mask),
            max_new_tokens=12,
            do_sample=False,
        ).numpy()[:, 9:]
    got = llama.rollout(params, prompt, mask, cfg, eos_token_id=eos, pad_token_id=0, **kw)
    ids = np.asarray(got.completion_ids)
    np.testing.assert_array_equal(ids[:, : ref.shape[1]], ref)
    assert np.all(ids[:, ref.shape[1] :] == 0)
    assert int(got.completion_mask[1].sum()) == np.flatnonzero(ids[1] == eos)[0] + 1 <= 4
