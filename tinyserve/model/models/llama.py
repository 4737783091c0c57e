"""Llama-family decoder (Llama, Qwen2, Qwen3, MiMo's main model) with HF parameter names.

Tokens of all sequences are packed in one dimension: `model(input_ids (T,), positions (T,))` ->
hidden (T, H), the residual stream before the final norm; `compute_logits(hidden (N, H))` applies
the final norm and the LM head to the N rows that need logits -> (N, V) float32. (The MTP head
of MiMo reads the pre-norm hidden of every position, so the norm moves to where it is needed.)
Attention reads the paged-KV metadata from `layers.attention.forward_context`. q/k/v and gate/up
run as packed matmuls; the loader fills them from the checkpoint's separate tensors via
`packed_modules_mapping`.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.kernels.gemv import SplitSum
from tinyserve.model.config import ModelConfig
from tinyserve.model.layers.attention import Attention
from tinyserve.model.layers.embedding import LMHead, VocabEmbedding
from tinyserve.model.layers.linear import Linear, MergedLinear, QKVLinear
from tinyserve.model.layers.norm import RMSNorm
from tinyserve.model.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            self.head_dim,
            self.num_heads,
            self.num_kv_heads,
            bias=config.attention_bias,
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, qkv: torch.Tensor, rope) -> torch.Tensor | SplitSum:
        """qkv (T, (Hq + 2 Hkv) D), the norm-fused qkv_proj output (see the decoder layer)."""
        norms = (self.q_norm, self.k_norm) if hasattr(self, "q_norm") else ()  # Qwen3
        return self.o_proj.unreduced(self.attn(qkv, rope, *norms).flatten(1))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), each matmul fused with the op before or after it where
    that pays (`normed`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, config.mlp_bias)

    def normed(
        self, norm: RMSNorm, hidden: torch.Tensor | SplitSum, residual: torch.Tensor
    ) -> tuple[torch.Tensor | SplitSum, torch.Tensor]:
        """(the MLP of norm(hidden + residual), hidden + residual). The SiLU runs in the gate_up
        kernel's epilogue where that is the dot kernel (above two rows), else in the down
        kernel's prologue (the stream kernel: one or two rows), else as its own kernel."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if gate_up.fuses_silu_mul(hidden):
            x, residual = norm(hidden, residual)
            return down.unreduced(gate_up.silu_mul(x)), residual
        y, residual = gate_up.normed(norm, hidden, residual)
        return down.gated(y), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor | SplitSum,
        residual: torch.Tensor | None,
        rope,
    ) -> tuple[torch.Tensor | SplitSum, torch.Tensor]:
        # The residual add of each block is deferred into the next norm, and each norm into
        # the matmul that reads it (one kernel at batch-1 decode, see Linear.normed); same
        # arithmetic as HF's `hidden = residual + hidden; proj(norm(hidden))`. At 33-128 rows
        # the o and down projections' split-K sums are deferred into that norm too: `hidden`
        # may be a SplitSum.
        attn = self.self_attn
        qkv, residual = attn.qkv_proj.normed(self.input_layernorm, hidden, residual)
        hidden = attn(qkv, rope)
        return self.mlp.normed(self.post_attention_layernorm, hidden, residual)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # One cos/sin table shared by all layers (a copy per layer would cost P*D*4 bytes each).
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(T,) ids -> (T, H) hidden states before the final norm, into `out` if given."""
        hidden = self.embed_tokens(input_ids)  # (T, H)
        rope = self.rotary_emb.bind(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope)
        if isinstance(hidden, SplitSum):  # the last down projection's: summed with the add
            return hidden.reduce(residual, out)
        return torch.add(hidden, residual, out=out)  # HF's last residual add, in model dtype


class LlamaForCausalLM(nn.Module):
    # checkpoint module name -> (our packed module, shard id), used by the generic loader.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp: nn.Module | None = None  # models.mtp.MTPHead, set by the loader when drafting

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, out)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden), out)
