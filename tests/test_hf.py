"""Loading Hugging Face Llama checkpoints; oracle: transformers' LlamaForCausalLM (torch CPU)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jmem import nf4
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
    with pytest.raises(ValueError, match="rope_scaling"):
        hf.load_config(str(tmp_path))
