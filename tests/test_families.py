"""The families registry (`jaxrl.model.families`): every registered family's config mapping round-trips,
and a new family is its declarations alone. The skeleton of docs/developing.md, "A new model family" (a
Llama: no q/k norms, a dense MLP in every layer), registered for the test, loads a transformers-written
`LlamaForCausalLM` checkpoint, matches its logits at 1e-4 and saves it back, with no change to the shared
blocks, the decoder or `jaxrl.model.hf`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.model import catalog, decoder, families, hf
from jaxrl.model.config import ModelConfig
from jaxrl.model.family import Family, WeightNames, common_fields, common_json
from jaxrl.model.qwen3 import weights as qwen3

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
VOCAB = 256
TOKENS_BT = np.random.default_rng(0).integers(0, VOCAB, size=(2, 12)).astype(np.int32)


def llama_fields(hf_config):
    """(a) ModelConfig fields of a "llama" config.json (transformers' LlamaConfig defaults)."""
    return common_fields(hf_config, rms_norm_eps=1e-6, max_position_embeddings=2048) | dict(use_qk_norm=False)


def llama_json(cfg):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common_json(cfg)}


# (b) the weight names: Qwen3's without the per-head norms
LLAMA_NAMES = WeightNames(top=qwen3.NAMES.top,
                          groups={"layers": {k: v for k, v in qwen3.ATTENTION.items() if k not in ("q_norm", "k_norm")},
                                  "mlp": qwen3.MLP})

def llama_kind(cfg, i):
    """(c) the layer kinds: a dense MLP in every layer."""
    return "mlp"


LLAMA = Family(name="llama", model_types=("llama",), architectures={"LlamaForCausalLM": "llama (dense)"},
               config_fields=llama_fields, config_json=llama_json, weight_names=LLAMA_NAMES,
               layer_kind=llama_kind, unused_tensor=qwen3.unused)


def test_every_registered_family_reads_back_what_it_writes():
    """Each Hosted model's config through its family's mapping and back; an unknown model type or family is
    refused by name."""
    seen = set()
    for name, hf_config in catalog.HOSTED_MODELS.items():
        cfg = ModelConfig.from_hf(hf_config)
        seen.add(cfg.family)
        assert cfg.family == families.FAMILIES[hf_config["model_type"]].name, name
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg, name
        assert cfg.to_hf()["model_type"] == hf_config["model_type"], name
    assert seen == {"qwen3", "glm4_moe"}
    assert set(catalog.ARCHITECTURES) == {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM"}
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        ModelConfig.from_hf({"model_type": "llama"})
    tiny = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=1, num_kv_heads=1,
                head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="family 'qwen3_moe' is not one of"):  # a model type, not a family
        ModelConfig(**tiny, family="qwen3_moe")
    with pytest.raises(ValueError, match="first_k_dense_replace = 1: the qwen3 family's layer kinds do not read it"):
        ModelConfig(**tiny, first_k_dense_replace=1)
    with pytest.raises(ValueError, match=r"mlp_only_layers = \(0,\): the glm4_moe family's layer kinds"):
        ModelConfig(**tiny, family="glm4_moe", mlp_only_layers=(0,))
    assert ModelConfig(**tiny, family="glm4_moe", first_k_dense_replace=1).layer_kinds == ("mlp", "moe")
    assert ModelConfig(**tiny, mlp_only_layers=(1,)).layer_kinds == ("moe", "mlp")


@pytest.mark.numerics
def test_a_new_family_is_its_declarations(monkeypatch, tmp_path):
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():  # norms near 1, weights of std 0.1: a wrong layout moves the logits
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
        want = m(torch.from_numpy(TOKENS_BT.astype(np.int64))).logits.float().numpy()
    m.save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        hf.load_hf(tmp_path / "hf")

    monkeypatch.setitem(families.FAMILIES, "llama", LLAMA)  # the registry line
    cfg, params = hf.load_hf(tmp_path / "hf")
    assert (cfg.family, cfg.use_qk_norm, cfg.mlp_layers, cfg.rms_norm_eps) == ("llama", False, (0, 1), 1e-5)
    assert "q_norm" not in params["layers"] and "moe" not in params
    positions_BT = np.broadcast_to(np.arange(TOKENS_BT.shape[1], dtype=np.int32), TOKENS_BT.shape)
    hidden_BTD, _ = jax.jit(decoder.forward, static_argnums=0)(cfg, params, jnp.asarray(TOKENS_BT),
                                                               jnp.asarray(positions_BT))
    assert float(np.max(np.abs(np.asarray(decoder.logits(params, hidden_BTD)) - want))) <= ATOL

    hf.save_hf(tmp_path / "back", cfg, params)
    back, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        got = back.eval()(torch.from_numpy(TOKENS_BT.astype(np.int64))).logits.float().numpy()
    assert float(np.max(np.abs(got - want))) <= ATOL
