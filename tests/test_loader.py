"""Loader: every parameter written exactly once, errors name the tensor, sharded checkpoints,
documented skips, and seeded dummy weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyserve.model.config import ModelConfig
from tinyserve.model.loader import CheckpointError, CheckpointNotFound, load_model

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TOKENS = torch.tensor([3, 17, 99, 42, 5, 64, 127, 0, 8])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny untied Llama checkpoint; tests copy and edit its tensors."""
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).save_pretrained(path)
    return path


def rewrite(src, dst, edit, config_edit=None):
    """Copy checkpoint src -> dst with its tensors passed through edit(dict) -> dict."""
    config = json.loads((src / "config.json").read_text())
    if config_edit:
        config.update(config_edit)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return ModelConfig.from_pretrained(dst)


def load(config, **kwargs):
    return load_model(config, torch.float32, "cpu", **kwargs)


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model.compute_logits(model(TOKENS, torch.arange(len(TOKENS))))


def test_loads_every_parameter(llama_dir):
    model = load(ModelConfig.from_pretrained(llama_dir))
    tensors = load_file(llama_dir / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    k = tensors["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(qkv[64 : 64 + 32], k)  # rows [q (4*16) | k (2*16) | v]
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up[96:], tensors["model.layers.0.mlp.up_proj.weight"])
    assert not any(p.requires_grad for p in model.parameters())


def test_missing_tensor_is_named(llama_dir, tmp_path):
    def drop(t):
        del t["model.layers.1.self_attn.k_proj.weight"], t["model.norm.weight"]
        return t

    config = rewrite(llama_dir, tmp_path, drop)
    with pytest.raises(CheckpointError, match="lacks") as e:
        load(config)
    assert "model.layers.1.self_attn.k_proj.weight" in str(e.value)
    assert "model.norm.weight" in str(e.value)


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.rogue.weight"] = torch.zeros(2)
        return t

    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.rogue.weight"):
        load(rewrite(llama_dir, tmp_path, add))


def test_shape_mismatch_names_tensor_and_shapes(llama_dir, tmp_path):
    def bad(t):
        t["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(16, 64)
        return t

    with pytest.raises(CheckpointError) as e:
        load(rewrite(llama_dir, tmp_path, bad))
    message = str(e.value)
    assert "model.layers.0.self_attn.v_proj.weight" in message
    assert "(16, 64)" in message and "(32, 64)" in message


def write_sharded(tensors: dict, path, shards: list[list[str]]) -> None:
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, path / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_loads(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    tensors = load_file(llama_dir / "model.safetensors")
    names = sorted(tensors)
    write_sharded(tensors, tmp_path, [names[::3], names[1::3], names[2::3]])
    sharded = load(ModelConfig.from_pretrained(tmp_path))
    single = load(ModelConfig.from_pretrained(llama_dir))
    assert torch.equal(logits(sharded), logits(single))


def test_duplicate_tensor_is_named(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    tensors = load_file(llama_dir / "model.safetensors")
    names = sorted(tensors)
    dup = "model.layers.0.mlp.up_proj.weight"
    write_sharded(tensors, tmp_path, [names, [dup]])  # the second shard repeats one tensor
    with pytest.raises(CheckpointError, match=f"{dup}.*twice"):
        load(ModelConfig.from_pretrained(tmp_path))


def test_no_checkpoint_file(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors") as e:
        load(ModelConfig.from_pretrained(tmp_path))
    assert isinstance(e.value, CheckpointNotFound)


def test_documented_skips(llama_dir, tmp_path):
    """Tied checkpoints may still carry lm_head.weight; old ones carry rotary inv_freq."""

    def extras(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        return t

    config = rewrite(llama_dir, tmp_path, extras, {"tie_word_embeddings": True})
    model = load(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # Untied, the same lm_head.weight is a real parameter and must be present.
    untied = rewrite(
        llama_dir, tmp_path, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}
    )
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load(untied)


def mtp_tensors(layout: str, num_layers: int = 2) -> dict[str, torch.Tensor]:
    """Random MTP tensors in a layout's checkpoint names (a Llama block per MTP layer)."""
    g = torch.Generator().manual_seed(1)
    block = transformers.models.llama.modeling_llama.LlamaDecoderLayer(
        transformers.LlamaConfig(**SIZES), 0
    ).state_dict()
    H = SIZES["hidden_size"]
    head = {"token": (H,), "hidden": (H,), "proj": (H, 2 * H), "final": (H,)}
    names = {
        "mimo": (
            "model.mtp_layers.{i}.",
            dict(
                token="token_layernorm",
                hidden="hidden_layernorm",
                proj="input_proj",
                final="final_layernorm",
            ),
        ),
        "deepseek": (
            "model.layers.{n}.",
            dict(token="enorm", hidden="hnorm", proj="eh_proj", final="shared_head.norm"),
        ),
        "qwen3_next": (
            "mtp.layers.{i}.",
            dict(
                token="pre_fc_norm_embedding", hidden="pre_fc_norm_hidden", proj="fc", final="norm"
            ),
        ),
    }[layout]
    out = {}
    for i in range(num_layers):
        prefix = names[0].format(i=i, n=SIZES["num_hidden_layers"] + i)
        head_prefix = "mtp." if layout == "qwen3_next" else prefix
        for part, shape in head.items():
            if layout == "qwen3_next" and i > 0:
                break  # one fc / norm pair for the whole stack
            out[f"{head_prefix}{names[1][part]}.weight"] = torch.randn(shape, generator=g)
        for name, t in block.items():
            out[prefix + name] = torch.randn(t.shape, generator=g)
        if layout == "deepseek":  # the layer's copies of the shared embedding and head
            out[prefix + "embed_tokens.weight"] = torch.zeros(SIZES["vocab_size"], H)
            out[prefix + "shared_head.head.weight"] = torch.zeros(SIZES["vocab_size"], H)
    return out


@pytest.mark.parametrize("layout", ["mimo", "deepseek", "qwen3_next"])
def test_mtp_layouts_load_onto_one_module(llama_dir, tmp_path, layout):
    extra = mtp_tensors(layout)
    config = rewrite(llama_dir, tmp_path, lambda t: t | extra, {"num_nextn_predict_layers": 2})
    plain = load(config)  # not drafting: the MTP tensors are skipped, nothing else changes
    assert plain.mtp is None
    model = load(config, with_mtp=True)
    assert model.mtp.layout.hidden_first == (layout == "mimo")
    layer = model.mtp.layer
    key = {"mimo": "model.mtp_layers.0.", "deepseek": "model.layers.2.", "qwen3_next": "mtp."}
    fc = {"mimo": "input_proj", "deepseek": "eh_proj", "qwen3_next": "fc"}[layout]
    assert torch.equal(layer.proj.weight, extra[key[layout] + fc + ".weight"])
    block = "mtp.layers.0." if layout == "qwen3_next" else key[layout]
    q, k = extra[block + "self_attn.q_proj.weight"], extra[block + "self_attn.k_proj.weight"]
    assert torch.equal(
        layer.block.self_attn.qkv_proj.weight[: q.shape[0] + k.shape[0]], torch.cat([q, k])
    )
    norm = {"mimo": "token_layernorm", "deepseek": "enorm", "qwen3_next": "pre_fc_norm_embedding"}[
        layout
    ]
    shift = 1.0 if layout == "qwen3_next" else 0.0  # zero-centred: stored w means (1 + w)
    assert torch.equal(layer.token_norm.weight, extra[key[layout] + norm + ".weight"] + shift)
    ln = layer.block.input_layernorm.weight
    assert torch.equal(ln, extra[block + "input_layernorm.weight"] + shift)


def test_mtp_errors_name_the_problem(llama_dir, tmp_path):
    with pytest.raises(CheckpointError, match="no MTP weights"):
        load(
            rewrite(llama_dir, tmp_path, lambda t: t, {"num_nextn_predict_layers": 1}),
            with_mtp=True,
        )
    partial = mtp_tensors("mimo", 1)
    del partial["model.mtp_layers.0.final_layernorm.weight"]
    config = rewrite(llama_dir, tmp_path, lambda t: t | partial, {"num_nextn_predict_layers": 1})
    with pytest.raises(CheckpointError, match="mtp.layer.final_norm.weight"):
        load(config, with_mtp=True)


def test_dummy_weights_are_seeded_and_finite(llama_dir):
    config = ModelConfig.from_pretrained(llama_dir)
    config.num_hidden_layers = 16  # deep enough to show activations neither vanish nor blow up
    a, b = load(config, load_format="dummy", seed=7), load(config, load_format="dummy", seed=7)
    c = load(config, load_format="dummy", seed=8)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert torch.equal(a.model.norm.weight, torch.ones(64))
    out = logits(a)
    assert torch.isfinite(out).all()
    assert 0.1 < out.std().item() < 10  # O(1) logits: neither flat nor saturated

    bf16 = load_model(config, torch.bfloat16, "cpu", load_format="dummy")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert torch.isfinite(logits(bf16)).all()
