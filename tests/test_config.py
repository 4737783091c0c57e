"""ModelConfig parsing (transformers 4/5 spellings, eos union, errors); EngineConfig checks."""

from __future__ import annotations

import json

import pytest

from tinyserve.config import EngineConfig, InvalidConfig
from tinyserve.model.config import ConfigNotFound, ModelConfig, UnsupportedModel

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def write(tmp_path, config: dict, generation: dict | None = None) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def test_llama_fields(tmp_path):
    config = ModelConfig.from_pretrained(write(tmp_path, {**LLAMA, "torch_dtype": "bfloat16"}))
    assert config.path == str(tmp_path)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert not (config.attention_bias or config.o_proj_bias or config.qk_norm)
    assert (config.bos_token_id, config.eos_token_ids) == (1, [2])
    assert config.torch_dtype == "bfloat16"
    assert config.rms_norm_eps == 1e-5


def test_kv_heads_default_to_heads():
    raw = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_dict(raw).num_key_value_heads == 4


def test_transformers4_and_5_rope_spellings_agree():
    v4 = {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}
    v5 = {
        **LLAMA,
        "architectures": None,  # transformers 5 may write null: model_type decides
        "dtype": "float32",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3},
    }
    a, b = ModelConfig.from_dict(v4), ModelConfig.from_dict(v5)
    assert a == b
    assert a.rope_theta == 500000.0
    assert a.rope_scaling == {"rope_type": "llama3", **LLAMA3}


def test_rope_defaults_follow_transformers():
    # Old "type" key; original_max_position_embeddings defaults to max_position_embeddings.
    raw = {**LLAMA, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert ModelConfig.from_dict(raw).rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    default = {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    config = ModelConfig.from_dict(default)
    assert (config.rope_theta, config.rope_scaling) == (1e6, None)


def test_qwen_family_flags():
    qwen2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    config = ModelConfig.from_dict(qwen2)
    assert config.attention_bias and not config.o_proj_bias and not config.qk_norm

    qwen3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}
    config = ModelConfig.from_dict(qwen3)
    assert config.qk_norm and not config.attention_bias and config.head_dim == 32

    mimo = {**qwen2, "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1}
    config = ModelConfig.from_dict(mimo)
    assert config.architecture == "MiMoForCausalLM" and config.attention_bias
    assert config.num_nextn_predict_layers == 1

    llama_bias = ModelConfig.from_dict({**LLAMA, "attention_bias": True, "mlp_bias": True})
    assert llama_bias.attention_bias and llama_bias.o_proj_bias and llama_bias.mlp_bias


def test_eos_ids_union_with_generation_config(tmp_path):
    path = write(tmp_path, {**LLAMA, "eos_token_id": [2, 5]}, {"eos_token_id": [5, 7, 2, 9]})
    assert ModelConfig.from_pretrained(path).eos_token_ids == [2, 5, 7, 9]


def test_eos_ids_without_generation_config_or_eos(tmp_path):
    raw = {k: v for k, v in LLAMA.items() if k != "eos_token_id"}
    assert ModelConfig.from_pretrained(write(tmp_path, raw)).eos_token_ids == []


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json") as e:
        ModelConfig.from_pretrained(tmp_path)
    assert isinstance(e.value, ConfigNotFound)
    assert str(tmp_path) in str(e.value)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "gpt2"}, "gpt2"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"use_sliding_window": True}, "sliding"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_models_are_named(change, needle):
    with pytest.raises(UnsupportedModel, match=needle):
        ModelConfig.from_dict({**LLAMA, **change})


def test_engine_config_defaults():
    config = EngineConfig()
    assert (config.dtype, config.max_num_seqs, config.block_size, config.load_format) == (
        "auto",
        256,
        16,
        "auto",
    )
    assert config.model is None  # the engine resolves the default model
    assert config.device in ("cpu", "cuda")
    assert EngineConfig(device="cpu", dtype="bfloat16", max_model_len=128).device == "cpu"
    # The overlapped loop: on with CUDA, off on the CPU (nothing to overlap there), as asked.
    assert EngineConfig(device="cuda").async_scheduling is True
    assert EngineConfig(device="cpu").async_scheduling is False
    assert EngineConfig(device="cpu", async_scheduling=True).async_scheduling is True


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "fp8"),
        ("load_format", "pt"),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("block_size", 12),
        ("block_size", 1.5),
        ("max_model_len", 0),
        ("num_kv_blocks", 0),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("seed", "x"),
        ("device", "gpu0"),
    ],
)
def test_engine_config_rejects(field, value):
    with pytest.raises(InvalidConfig) as e:
        EngineConfig(**{field: value})
    assert e.value.param == field
    assert field in str(e.value)
