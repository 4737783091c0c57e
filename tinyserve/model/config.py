"""Model configuration: `ModelConfig.from_pretrained(path)` parses an HF config.json
(transformers 4 or 5 spelling) for the Llama / Qwen2 / Qwen3 / MiMo family into plain fields;
unsupported models raise `UnsupportedModel`. `resolve_dtype` picks the run dtype for a device.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch


class ConfigNotFound(FileNotFoundError):
    """The model directory has no config.json."""


class UnsupportedModel(ValueError):
    """config.json describes a model (or a feature of one) that tinyserve cannot run."""


# HF architecture name -> model_type; model_type is the fallback when `architectures` is null.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MiMoForCausalLM": "mimo",  # Qwen2 body + MTP layers (model.mtp_layers.*)
    "Qwen3_5ForCausalLM": "qwen3_5_text",  # hybrid: Gated DeltaNet + gated attention
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its text model (text_config); no vision
}
SUPPORTED_ROPE_TYPES = ("linear", "llama3", "yarn")
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(slots=True)
class ModelConfig:
    path: str  # the model directory (config.json, *.safetensors)
    architecture: str  # a key of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3"|"yarn"|"linear", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # Llama's `attention_bias` also puts a bias on o_proj
    mlp_bias: bool = False  # Llama only
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"  # the checkpoint's dtype; HF loads float32 when absent
    num_nextn_predict_layers: int = 0  # MTP layers the checkpoint ships (speculative decoding)
    # Hybrid models (Qwen3.5): each layer's token mixer, "full_attention" (paged KV) or
    # "linear_attention" (Gated DeltaNet: a state slot per sequence); empty: all attention.
    layer_types: list[str] = field(default_factory=list)
    linear_conv_kernel_dim: int = 4
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    ssm_state_dtype: str = "float32"  # the DeltaNet recurrent state's (HF's mamba_ssm_dtype)
    partial_rotary_factor: float = 1.0  # rotary on the first factor * head_dim dims of a head
    attn_output_gate: bool = False  # attention output * sigmoid(gate); q_proj yields the gate
    # mRoPE (t, h, w) rotary-pair sections; text tokens have one position for all three.
    mrope_section: list[int] = field(default_factory=list)
    mrope_interleaved: bool = False

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        path = os.fspath(path)
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise ConfigNotFound(f"no config.json in model directory {path!r}")
        with open(config_file) as f:
            raw = json.load(f)
        generation: dict[str, Any] = {}
        generation_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_file):
            with open(generation_file) as f:
                generation = json.load(f)
        return cls.from_dict(raw, path, generation)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], path: str = "", generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        arch = _architecture(raw)
        model_type = ARCHITECTURES[arch]
        if model_type == "qwen3_5":
            raw = _text_config(raw)
        is_hybrid = model_type in ("qwen3_5", "qwen3_5_text")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"{arch}: hidden_act {raw['hidden_act']!r} (only silu)")
        if raw.get("use_sliding_window", False):
            raise UnsupportedModel(f"{arch}: use_sliding_window=true is not supported")
        if not is_hybrid and raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModel(f"{arch}: partial_rotary_factor != 1 is not supported")
        missing = [k for k in REQUIRED_KEYS if raw.get(k) is None]
        if missing:
            raise UnsupportedModel(f"{arch}: config.json lacks {', '.join(missing)}")

        num_heads = raw["num_attention_heads"]
        # HF defaults when a key is absent: Qwen3Config.head_dim = 128, others hidden // heads.
        head_dim = raw.get("head_dim") or (
            {"qwen3": 128, "qwen3_5_text": 256, "qwen3_5": 256}.get(model_type)
            or raw["hidden_size"] // num_heads
        )
        max_pos = raw.get("max_position_embeddings") or (2048 if model_type == "llama" else 32768)
        rope_theta, rope_scaling = _parse_rope(raw, arch, max_pos)
        llama_bias = bool(raw.get("attention_bias", False))
        is_qwen2 = model_type in ("qwen2", "mimo")
        return cls(
            path=path,
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 hardcodes q/k/v bias and no o_proj bias; Llama/Qwen3 read attention_bias
            # for all four projections.
            attention_bias=True if is_qwen2 else llama_bias,
            o_proj_bias=False if is_qwen2 else llama_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw, generation or {}),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or "float32",
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers")
            or raw.get("mtp_num_hidden_layers")
            or 0,
            **(_hybrid_fields(raw) if is_hybrid else {}),
        )


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text model: its text_config, where the top level decides the
    tied head (as transformers does) and gives the dtype and ids the text config lacks."""
    text = dict(raw.get("text_config") or {})
    text["architectures"] = raw.get("architectures")
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    for key in ("torch_dtype", "dtype", "bos_token_id", "eos_token_id"):
        if text.get(key) is None and raw.get(key) is not None:
            text[key] = raw[key]
    return text


def _hybrid_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's fields, with transformers' Qwen3_5TextConfig defaults."""
    num_layers = raw["num_hidden_layers"]
    interval = raw.get("full_attention_interval") or 4
    layer_types = raw.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)
    ]
    unknown = set(layer_types) - {"linear_attention", "full_attention"}
    if len(layer_types) != num_layers or unknown:
        raise UnsupportedModel(
            f"layer_types {layer_types!r}: one of linear_attention / full_attention per layer"
        )
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 0.25
    return dict(
        layer_types=list(layer_types),
        linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim") or 4,
        linear_num_key_heads=raw.get("linear_num_key_heads") or 16,
        linear_num_value_heads=raw.get("linear_num_value_heads") or 32,
        linear_key_head_dim=raw.get("linear_key_head_dim") or 128,
        linear_value_head_dim=raw.get("linear_value_head_dim") or 128,
        ssm_state_dtype=raw.get("mamba_ssm_dtype") or "float32",
        partial_rotary_factor=float(factor),
        attn_output_gate=True,  # transformers' Qwen3.5 always gates (q_proj is 2 Hq D wide)
        mrope_section=list(rope.get("mrope_section") or []),
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
    )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    if not archs:  # transformers 5 may write `architectures: null`
        for arch, model_type in ARCHITECTURES.items():
            if raw.get("model_type") == model_type:
                return arch
    name = archs or raw.get("model_type")
    raise UnsupportedModel(
        f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}"
    )


def _parse_rope(raw: dict[str, Any], arch: str, max_pos: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` or 4 `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"{arch}: rope_type {rope_type!r}; supported: default, "
            + ", ".join(SUPPORTED_ROPE_TYPES)
        )
    if rope_type in ("llama3", "yarn"):
        # As HF's standardize_rope_params: a top-level value (Phi3 style) wins, else the dict's,
        # else max_position_embeddings.
        if raw.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", max_pos)
    return theta, {"rope_type": rope_type, **params}


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    """config.json's eos_token_id UNION generation_config.json's, order kept, no repeats."""
    ids: list[int] = []
    for value in (raw.get("eos_token_id"), generation.get("eos_token_id")):
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


# The generation_config.json fields vLLM's `--generation-config` turns into request defaults.
GENERATION_DEFAULT_KEYS = (
    "repetition_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def sampling_defaults(directory: str | os.PathLike) -> dict[str, Any]:
    """The sampling defaults the checkpoint's creator recommends: those of GENERATION_DEFAULT_KEYS
    that DIRECTORY/generation_config.json sets (none without the file), `max_new_tokens` renamed
    `max_tokens` (vLLM's `--generation-config auto` / DIR). Raises ValueError for values that
    no request could carry."""
    from tinyserve.sampling_params import InvalidParameter, SamplingParams

    path = os.path.join(os.fspath(directory), "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    out = {k: raw[k] for k in GENERATION_DEFAULT_KEYS if raw.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    try:
        SamplingParams(**out)
    except (InvalidParameter, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    return out


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        # Decode is bound by reading weights: bf16 halves the bytes, and oneDNN runs bf16
        # matmuls natively on CPUs with AVX-512 BF16 / AMX (BENCHMARKS.md, CPU).
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    # NOTE: fp32 checkpoints run in bf16 on the GPU, as vLLM does for 'auto'.
    cfg = model_config.torch_dtype
    return torch.float16 if cfg == "float16" else torch.bfloat16
