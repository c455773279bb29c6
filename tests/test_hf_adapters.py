"""PEFT adapters and merged export; oracles: peft.PeftModel and transformers' LlamaForCausalLM."""

import dataclasses
import json
import os

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_hf

from jmem import lora
from jmem import qlora
from jmem._src import nf4
from jmem.models import export
from jmem.models import hf
from jmem.models import llama

torch = pytest.importorskip("torch", reason="torch (CPU) is the oracles' runtime")
transformers = pytest.importorskip("transformers", reason="LlamaForCausalLM is the oracle")
peft = pytest.importorskip("peft", reason="PEFT is the adapter-format oracle")

ALL = r"layers/.*_proj/kernel"
NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = np.random.default_rng(0).integers(0, 97, size=(2, 12))


def _base(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def _jmem_logits(params, adapters, cfg):
    fwd = lora.apply(lambda p, t: llama.forward(p, t, cfg))
    return np.asarray(fwd(params, adapters, jnp.asarray(TOKENS, jnp.int32)))


def _perturb(adapters, seed=3, std=0.05):
    """Nonzero b (and a moved), so the adapters change the logits."""
    out = {}
    for k, (path, w) in enumerate(adapters.items()):
        ka, kb = jax.random.split(jax.random.key(seed + k))
        out[path] = lora.LoraWeight(
            a=w.a + std * jax.random.normal(ka, w.a.shape, w.a.dtype),
            b=w.b + std * jax.random.normal(kb, w.b.shape, w.b.dtype),
            scale=w.scale,
            dropout=w.dropout,
            alpha=w.alpha,
            use_rslora=w.use_rslora,
            init_lora_weights=w.init_lora_weights,
        )
    return out


def peft_made(base, targets, directory):
    """A PEFT LoRA (r=4, alpha=8) on ``targets`` of ``base`` with nonzero B, saved to
    ``directory``; returns the PeftModel in eval mode."""
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(directory))
    return model.eval()


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.slow
@pytest.mark.parametrize("use_rslora,targets", [(False, ALL), (True, r".*(q|v)_proj.*")])
def test_jmem_adapters_run_in_peft(tmp_path, use_rslora, targets):
    """jmem adapters saved by save_adapters give, in PeftModel, jmem's logits (<= 1e-4)."""
    test_hf._save_tiny(tmp_path / "base", shard=False)
    params, cfg = hf.load_params(str(tmp_path / "base"), dtype=jnp.float32)
    ad = lora.init(
        jax.random.key(1),
        params,
        rank=4,
        alpha=12.0,
        modules=targets,
        use_rslora=use_rslora,
        dropout=0.1,
        init_lora_weights="gaussian",
    )
    ad = _perturb(ad)
    hf.save_adapters(str(tmp_path / "ad"), ad, cfg, base_model_name_or_path="tiny-llama")
    c = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert c["r"] == 4 and c["lora_alpha"] == 12 and c["use_rslora"] == use_rslora
    assert c["lora_dropout"] == 0.1 and c["init_lora_weights"] == "gaussian"
    model = peft.PeftModel.from_pretrained(_base(tmp_path / "base"), str(tmp_path / "ad")).eval()
    cfg_p = model.peft_config["default"]
    assert set(cfg_p.target_modules) == {p.split("/")[1] for p in ad}
    assert cfg_p.base_model_name_or_path == "tiny-llama"
    want = _torch_logits(model)
    got = _jmem_logits(params, ad, cfg)
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)
    assert _max_diff(want, _torch_logits(_base(tmp_path / "base"))) > 1e-2  # adapters act


@pytest.mark.slow
def test_peft_adapter_runs_in_jmem(tmp_path):
    """A PEFT-made adapter (nonzero B, rsLoRA, every linear layer) read by load_adapters
    gives PEFT's logits in jmem (<= 1e-4), with its config fields on the LoraWeights."""
    base = test_hf._save_tiny(tmp_path / "base", shard=False)
    conf = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=NAMES,
        lora_dropout=0.05,
        use_rslora=True,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(base, conf)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    model.save_pretrained(tmp_path / "ad")
    model.eval()
    want = _torch_logits(model)
    params, cfg = hf.load_params(str(tmp_path / "base"), dtype=jnp.float32)
    ad = hf.load_adapters(str(tmp_path / "ad"), params, cfg)
    assert list(ad) == [f"layers/{n}/kernel" for n in sorted(NAMES)]  # params' leaf order
    w = ad["layers/q_proj/kernel"]
    chex.assert_shape([w.a, w.b], [(3, 64, 4), (3, 4, 64)])
    assert (w.dropout, w.use_rslora, w.alpha, w.init_lora_weights) == (0.05, True, 8.0, True)
    assert w.scale == pytest.approx(
        model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"]
    )
    got = _jmem_logits(params, ad, cfg)
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)
    # The same adapters on an NF4 base load too (paths and shapes from the NF4Array leaves).
    q, _ = hf.load_params(str(tmp_path / "base"), dtype=jnp.float32, quantize="nf4")
    helpers.assert_bitwise_equal(hf.load_adapters(str(tmp_path / "ad"), q, cfg), ad)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_load_round_trip_is_bitwise(tmp_path, dtype):
    cfg = helpers.small_config()
    params = llama.abstract_params(cfg)
    ad = lora.init(
        jax.random.key(0),
        params,
        rank=3,
        alpha=7.0,
        modules=r"layers/(q|down)_proj/kernel",
        use_rslora=True,
        dropout=0.25,
        init_lora_weights=False,
        dtype=dtype,
    )
    hf.save_adapters(str(tmp_path), ad, cfg)
    back = hf.load_adapters(str(tmp_path), params, cfg)
    helpers.assert_bitwise_equal(back, ad)  # also compares the static fields (treedef)
    assert all(w.a.dtype == dtype for w in back.values())


def _write_config(path, **changes):
    c = json.loads((path / "adapter_config.json").read_text())
    c.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(c))


@pytest.mark.parametrize(
    "field,value",
    [
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("rank_pattern", {"q_proj": 8}),
        ("alpha_pattern", {"q_proj": 3}),
        ("bias", "lora_only"),
        ("target_modules", ["q_proj", "embed_tokens"]),
        ("layers_to_transform", [0]),
        ("init_lora_weights", "pissa"),
        ("peft_type", "IA3"),
        ("lora_bias", True),
    ],
)
def test_load_refuses_what_it_does_not_implement(tmp_path, field, value):
    cfg = helpers.small_config()
    params = llama.abstract_params(cfg)
    ad = lora.init(jax.random.key(0), params, rank=2)
    hf.save_adapters(str(tmp_path), ad, cfg)
    _write_config(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=field if field != "peft_type" else "IA3"):
        hf.load_adapters(str(tmp_path), params, cfg)


@pytest.mark.slow
def test_load_and_save_refuse_unmappable_adapters(tmp_path):
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file

    cfg = helpers.small_config()
    params = llama.abstract_params(cfg)
    ad = lora.init(jax.random.key(0), params, rank=2)
    # Equal patterns are no patterns: accepted.
    hf.save_adapters(str(tmp_path), ad, cfg)
    _write_config(tmp_path, rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 16})
    helpers.assert_bitwise_equal(hf.load_adapters(str(tmp_path), params, cfg), ad)
    # A tensor jmem cannot map (modules_to_save's copy of the head) and a missing layer.
    f = str(tmp_path / "adapter_model.safetensors")
    t = load_file(f)
    save_file({**t, "base_model.model.lm_head.lora_A.weight": np.zeros((2, 64), np.float32)}, f)
    with pytest.raises(ValueError, match="lm_head"):
        hf.load_adapters(str(tmp_path), params, cfg)
    save_file({k: v for k, v in t.items() if ".layers.1." not in k}, f)
    with pytest.raises(ValueError, match="layers_to_transform"):
        hf.load_adapters(str(tmp_path), params, cfg)
    # Saving: a head adapter has no PEFT Llama module here; ranks must agree.
    head = lora.init(jax.random.key(0), params, rank=2, modules=r"lm_head/kernel")
    with pytest.raises(ValueError, match="lm_head/kernel"):
        hf.save_adapters(str(tmp_path), head, cfg)
    mixed = {**ad, **lora.init(jax.random.key(0), params, rank=4, modules=r"layers/o_proj/kernel")}
    with pytest.raises(ValueError, match="rank"):
        hf.save_adapters(str(tmp_path), mixed, cfg)


# ------------------------------------------------------------------------- merged export


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_save_params_loads_in_transformers(tmp_path, tie):
    """save_params(adapters=) -> AutoModelForCausalLM gives jmem's LoRA logits (<= 1e-4),
    sharded with an index; the loader reads it back bitwise."""
    cfg = helpers.small_config(vocab_size=97, num_layers=3, tie_embeddings=tie)
    params = llama.init(jax.random.key(0), cfg)
    params = jax.tree.map(lambda x: x * 2.0, params)  # norms of 2: a swapped norm shows
    ad = _perturb(lora.init(jax.random.key(1), params, rank=4, modules=ALL))
    hf.save_params(str(tmp_path), params, cfg, max_shard_bytes=40_000, adapters=ad)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert ("lm_head.weight" in index["weight_map"]) != tie
    want = _jmem_logits(params, ad, cfg)
    got = _torch_logits(_base(tmp_path))
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)
    back, cfg_back = hf.load_params(str(tmp_path), dtype=jnp.float32)
    assert cfg_back == cfg
    helpers.assert_bitwise_equal(back, lora.merge(params, ad))


@pytest.mark.slow
def test_save_params_nf4_one_matrix_at_a_time(tmp_path, monkeypatch):
    """An NF4 base with adapters is exported dequantizing one [in, out] matrix per call;
    transformers then gives jmem's QLoRA logits (<= 1e-4)."""
    cfg = helpers.small_config(vocab_size=97, num_layers=3)
    params = llama.init(jax.random.key(0), cfg)
    q = qlora.quantize_params(params)
    ad = _perturb(lora.init(jax.random.key(1), q, rank=4, modules=ALL))
    seen = []
    real = nf4.dequantize
    monkeypatch.setattr(
        nf4, "dequantize", lambda x, *a, **k: seen.append(x.shape) or real(x, *a, **k)
    )
    hf.save_params(str(tmp_path), q, cfg, adapters=ad, dtype=jnp.float32)
    assert len(seen) == 7 * cfg.num_layers and all(len(s) == 2 for s in seen), seen
    monkeypatch.undo()
    want = _jmem_logits(q, ad, cfg)
    got = _torch_logits(_base(tmp_path))
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)
    # One shard by default; the exported weights are lora.merge's, bitwise.
    assert os.listdir(tmp_path).count("model-00001-of-00001.safetensors") == 1
    back, _ = hf.load_params(str(tmp_path), dtype=jnp.float32)
    helpers.assert_bitwise_equal(back, lora.merge(q, ad))


@pytest.mark.slow
def test_hf_config_refuses_fields_it_does_not_write(tmp_path):
    cfg = helpers.small_config()
    c = export.hf_config(cfg)
    assert c["model_type"] == "llama" and c["num_key_value_heads"] == 2

    @dataclasses.dataclass(frozen=True)
    class Capped(llama.LlamaConfig):  # a field a later family adds
        attn_logit_softcapping: float | None = None

    assert export.hf_config(Capped(**dataclasses.asdict(cfg)))["hidden_size"] == 64
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        export.hf_config(Capped(**dataclasses.asdict(cfg), attn_logit_softcapping=30.0))
    params = llama.init(jax.random.key(0), cfg)
    with pytest.raises(ValueError, match="layout"):
        hf.save_params(str(tmp_path), {**params, "extra": {"w": jnp.ones(3)}}, cfg)
    with pytest.raises(ValueError, match="name no leaf"):
        hf.save_params(str(tmp_path), params, cfg, adapters={"nope": None})


# ------------------------------------------------------- every family the loader accepts

# examples/qlora_7b.py's default --lora-targets: a substring regex that also matches biases
PROJ_ANY = r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*"
LONG = np.random.default_rng(4).integers(0, 97, size=(2, 40))  # > window 16, > rope's 16


def _logits(model, tokens=LONG):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _qwen2_config(**overrides):
    return helpers.small_config(vocab_size=97, biases=("q_proj", "k_proj", "v_proj"), **overrides)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(test_hf.FAMILIES))
def test_family_export_loads_in_transformers(tmp_path, family):
    """transformers checkpoint -> jmem -> save_params -> AutoModelForCausalLM: the same
    family class, logits within 1e-4 of the original; jmem reads back the same config.
    From an NF4 base with adapters on every projection (PROJ_ANY: biases matched, not
    adapted), the export computes jmem's QLoRA logits."""
    arch = test_hf.FAMILIES[family][0]
    model = test_hf._save_family(tmp_path / "src", family)
    params, cfg = hf.load_params(str(tmp_path / "src"), dtype=jnp.float32)
    hf.save_params(str(tmp_path / "dense"), params, cfg)
    assert hf.load_config(str(tmp_path / "dense")) == cfg
    back = _base(tmp_path / "dense")
    assert type(back).__name__ == f"{arch}ForCausalLM"
    want = _logits(model)
    assert _max_diff(_logits(back), want) <= 1e-4, _max_diff(_logits(back), want)

    q, _ = hf.load_params(str(tmp_path / "src"), dtype=jnp.float32, quantize="nf4")
    ad = _perturb(lora.init(jax.random.key(1), q, rank=4, modules=PROJ_ANY))
    assert sorted(ad) == [f"layers/{n}/kernel" for n in sorted(llama.LINEAR_NAMES)]
    hf.save_params(str(tmp_path / "qlora"), q, cfg, adapters=ad, dtype=jnp.float32)
    assert hf.load_config(str(tmp_path / "qlora")) == cfg
    fwd = lora.apply(lambda p, t: llama.forward(p, t, cfg))
    want = np.asarray(fwd(q, ad, jnp.asarray(LONG, jnp.int32)))
    got = _logits(_base(tmp_path / "qlora"))
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)
    assert _max_diff(got, _logits(model)) > 1e-2  # the adapters act


def test_hf_config_round_trips_through_the_loader():
    """config_from_dict(hf_config(c)) == c for every field; transformers reads the same
    RoPE (its rope_parameters) and family; configs no family computes are refused."""
    rope = llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    configs = {
        "llama": helpers.small_config(rope_scaling=rope, hidden_act="gelu_pytorch_tanh"),
        "mistral": helpers.small_config(sliding_window=16, rope_theta=1e6),
        "qwen2": _qwen2_config(sliding_window=8, tie_embeddings=True),
    }
    for model_type, cfg in configs.items():
        c = export.hf_config(cfg)
        assert c["model_type"] == model_type and hf.config_from_dict(c) == cfg
        t = transformers.AutoConfig.for_model(**c)
        assert t.architectures == [export.ARCHITECTURES[model_type]]
    t = transformers.AutoConfig.for_model(**export.hf_config(configs["llama"]))
    assert t.rope_parameters["rope_type"] == "llama3" and t.rope_parameters["factor"] == 8.0
    assert t.hidden_act == "gelu_pytorch_tanh"
    c = export.hf_config(helpers.small_config(biases=("gate_proj", "up_proj", "down_proj")))
    assert c["model_type"] == "llama" and c["mlp_bias"] and not c["attention_bias"]
    with pytest.raises(ValueError, match="match no transformers family"):
        export.hf_config(helpers.small_config(biases=("q_proj",)))
    with pytest.raises(ValueError, match="Mistral has no biases"):
        export.hf_config(helpers.small_config(biases=llama.LINEAR_NAMES, sliding_window=4))


@pytest.mark.slow
def test_save_params_refuses_undeclared_biases(tmp_path):
    cfg = _qwen2_config()
    params = llama.init(jax.random.key(0), cfg)
    plain = dataclasses.replace(cfg, biases=())
    with pytest.raises(ValueError, match=r"unexpected leaves \['layers/k_proj/bias'"):
        hf.save_params(str(tmp_path), params, plain)
    layers = {**params["layers"], "q_proj": {"kernel": params["layers"]["q_proj"]["kernel"]}}
    with pytest.raises(ValueError, match=r"missing \['layers/q_proj/bias'\]"):
        hf.save_params(str(tmp_path), {**params, "layers": layers}, cfg)


# ------------------------------------------------------------ LoRA targets skip biases


@pytest.mark.slow
def test_lora_modules_never_adapt_biases_and_qwen2_qlora_trains():
    """On a Qwen2 tree (stacked q/k/v biases [L, out], rank 2 like a matrix) a regex
    matching biases and norm scales adapts kernels only, and QLoRA training lowers the loss."""
    optax = pytest.importorskip("optax")
    cfg = _qwen2_config()
    q = qlora.quantize_params(llama.init(jax.random.key(0), cfg))
    assert q["layers"]["q_proj"]["bias"].shape == (cfg.num_layers, cfg.num_heads * cfg.head_dim)
    kernels = [f"layers/{n}/kernel" for n in llama.LINEAR_NAMES]
    for targets in (PROJ_ANY, r".*", lora.DEFAULT_MODULES):
        ad = lora.init(jax.random.key(1), q, modules=targets)
        assert set(ad) <= set(kernels) | {"lm_head/kernel", "embed/embedding"}, sorted(ad)
        assert not any(p.endswith(("/bias", "/scale")) for p in ad), sorted(ad)
    with pytest.raises(ValueError, match="biases and norm scales excluded"):
        lora.init(jax.random.key(1), q, modules=r"layers/q_proj/bias")
    ad = lora.init(jax.random.key(1), q, rank=8, modules=PROJ_ANY)
    assert sorted(ad) == sorted(kernels)
    loss = qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg))
    opt = optax.adam(3e-3)
    state = opt.init(ad)
    batch = helpers.token_batch(cfg, batch_size=4, seq_len=16)

    @jax.jit
    def step(ad, state):
        value, g = jax.value_and_grad(lambda a: loss(q, a, batch))(ad)
        updates, state = opt.update(g, state, ad)
        return optax.apply_updates(ad, updates), state, value

    losses = []
    for _ in range(15):
        ad, state, value = step(ad, state)
        losses.append(float(value))
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.05, losses


# ------------------------------------------------------------ PEFT adapters, all families


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "mistral_sliding"])
def test_peft_adapters_on_other_families(tmp_path, family):
    """jmem adapters -> save_adapters -> PeftModel on the transformers base: jmem's logits
    (<= 1e-4); PEFT's own adapter -> load_adapters -> jmem: PEFT's logits (<= 1e-4)."""
    test_hf._save_family(tmp_path / "base", family)
    params, cfg = hf.load_params(str(tmp_path / "base"), dtype=jnp.float32)
    ad = _perturb(lora.init(jax.random.key(1), params, rank=4, alpha=8.0, modules=PROJ_ANY))
    hf.save_adapters(str(tmp_path / "ad"), ad, cfg)
    c = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert c["target_modules"] == sorted(llama.LINEAR_NAMES) and c["bias"] == "none"
    model = peft.PeftModel.from_pretrained(_base(tmp_path / "base"), str(tmp_path / "ad"))
    want = _logits(model.eval())
    fwd = lora.apply(lambda p, t: llama.forward(p, t, cfg))
    got = np.asarray(fwd(params, ad, jnp.asarray(LONG, jnp.int32)))
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)
    assert _max_diff(want, _logits(_base(tmp_path / "base"))) > 1e-2

    theirs = peft_made(_base(tmp_path / "base"), ["k_proj", "down_proj"], tmp_path / "theirs")
    want = _logits(theirs)
    back = hf.load_adapters(str(tmp_path / "theirs"), params, cfg)
    assert sorted(back) == ["layers/down_proj/kernel", "layers/k_proj/kernel"]
    got = np.asarray(fwd(params, back, jnp.asarray(LONG, jnp.int32)))
    assert _max_diff(got, want) <= 1e-4, _max_diff(got, want)
