"""Qwen3.5 text decoder (hybrid: Gated DeltaNet and gated attention layers), HF parameter names.

The contract of models/llama.py: `model(input_ids (T,), positions (T,))` -> hidden (T, H) before
the final norm; `compute_logits(hidden (N, H))` -> (N, V) float32; the generic loader fills the
packed projections through `packed_modules_mapping`. `config.layer_types` picks each layer's
token mixer: "full_attention" layers keep paged KV (layers/gated_attention.py), the
"linear_attention" ones a state slot per sequence (layers/gated_deltanet.py: the runner assigns
their state rows with `allocate_states` and puts `state_slots` / `has_initial_state` in the
forward context beside the paged-KV metadata). Every norm of the decoder is zero-centred
(1 + w). Text positions only: with equal t/h/w positions the interleaved mRoPE is plain RoPE
on the first partial_rotary_factor * head_dim dims of each head. The checkpoint's MTP layer
(`mtp.*`, one full-attention decoder layer) is built by the loader when drafting with it
(models/mtp.py), else skipped with the vision tower.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.model.config import ModelConfig
from tinyserve.model.layers.activation import silu_and_mul
from tinyserve.model.layers.embedding import LMHead, VocabEmbedding
from tinyserve.model.layers.gated_attention import (
    GatedAttention,
    PartialRotaryEmbedding,
    rotary_dim,
)
from tinyserve.model.layers.gated_deltanet import GatedDeltaNet
from tinyserve.model.layers.rotary import BoundRotary
from tinyserve.model.layers.zero_centred_norm import ZeroCentredRMSNorm
from tinyserve.model.models.llama import LlamaMLP

LAYER_TYPES = ("linear_attention", "full_attention")


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str) -> None:
        super().__init__()
        assert layer_type in LAYER_TYPES, f"unknown layer type {layer_type!r}"
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: BoundRotary | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each residual add is deferred into the next norm: HF's `h = residual + mixer(norm(h))`.
        if residual is None:
            x, residual = self.input_layernorm(hidden), hidden
        else:
            x, residual = self.input_layernorm(hidden, residual)
        if hasattr(self, "linear_attn"):
            hidden = self.linear_attn(x)
        else:
            hidden = self.self_attn(x, rope)
        x, residual = self.post_attention_layernorm(hidden, residual)
        mlp = self.mlp
        return mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x))), residual


class Qwen3_5Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert len(config.layer_types) == config.num_hidden_layers, "one type per layer"
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, t) for t in config.layer_types)
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = None  # shared by the attention layers (the MTP layer's too), if any
        if "full_attention" in config.layer_types or config.num_nextn_predict_layers:
            self.rotary_emb = PartialRotaryEmbedding(
                config.head_dim,
                rotary_dim(config),
                config.max_position_embeddings,
                config.rope_theta,
                config.rope_scaling,
            )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(T,) ids -> (T, H) hidden states before the final norm, into `out` if given."""
        hidden = self.embed_tokens(input_ids)  # (T, H)
        rope = self.rotary_emb.bind(positions) if self.rotary_emb is not None else None
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope)
        return torch.add(hidden, residual, out=out)  # HF's last residual add, in model dtype


class Qwen3_5ForCausalLM(nn.Module):
    # checkpoint module name -> (our packed module, shard id), used by the generic loader.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),  # [q_h | gate_h] per head: q and gate (gated_attention.py)
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3_5Model(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp: nn.Module | None = None  # the loader's contract: the MTP head, when drafting

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, out)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden), out)
