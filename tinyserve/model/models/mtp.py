"""Multi-token-prediction (MTP) heads for speculative decoding, three checkpoint layouts.

One MTP layer turns (target hidden h_i, next token t_{i+1}) into a guess for t_{i+2}:
    x = proj(cat[hidden_norm(h_i), token_norm(embed(t_{i+1}))])   (MiMo: hidden first)
    x = decoder_block(x) at position i, with its own paged KV      (the model's attention block)
    h' = final_norm(x);  logits = lm_head(h')                       (embedding, head: shared)
Drafts beyond the first chain the layer on its own output h'. Only the first MTP layer is built
and run (checkpoints with more keep them unused, as vLLM and SGLang do for MiMo): a deeper
layer would need its own KV at every verified position, which only a sequential depth-by-depth
pass could write.

Layouts (tensor names from the published model code; see `LAYOUTS`):
  mimo        model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj,
              final_layernorm, <block>}; reads the target's pre-norm hidden.
  deepseek    model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj, shared_head.norm,
              <block>} (DeepSeek-V3, GLM-4.5), embedding first, post-norm target hidden; the
              layer's copies of embed_tokens / shared_head.head equal the main ones and are
              skipped.
  qwen3_next  mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm, layers.0.<block>}
              (Qwen3-Next, Qwen3.5: top-level names in text and multimodal checkpoints alike),
              embedding first, post-norm hidden, zero-centred norms, no position-0 mask.
The block is a Llama/Qwen decoder layer, or on a hybrid model (Qwen3.5) a gated full-attention
layer of the model's own kind (models/qwen3_5.py) whose norms and the final norm are
ZeroCentredRMSNorms; the two input norms feed the fused kernels/mtp_input.py, which takes plain
weights in the model dtype, so their zero-centred w becomes 1 + w after loading. MiMo and
DeepSeek zero the token embedding at position 0 (as vLLM's MiMo / DeepSeek MTP do); Qwen3-Next
and Qwen3.5 keep it (vLLM's and SGLang's qwen3_next / qwen3_5 MTP).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from tinyserve.kernels.mtp_input import mtp_input, mtp_input_ref
from tinyserve.model.config import ModelConfig, UnsupportedModel
from tinyserve.model.layers.embedding import LMHead
from tinyserve.model.layers.linear import Linear
from tinyserve.model.layers.norm import RMSNorm
from tinyserve.model.layers.zero_centred_norm import ZeroCentredRMSNorm
from tinyserve.model.models.llama import LlamaDecoderLayer
from tinyserve.model.models.qwen3_5 import Qwen3_5DecoderLayer
from tinyserve.sample.sampler import greedy


@dataclass(frozen=True)
class Layout:
    hidden_first: bool  # concatenation order fed to the projection
    normed_hidden: bool  # the target hidden goes through the main model's final norm first
    zero_centred_norms: bool  # checkpoint norm weights w mean (1 + w)
    # checkpoint-name regex (group 1: layer index) -> our prefix for it, and the MTP-specific
    # sub-names -> ours; everything else under the prefix is the decoder block.
    names: dict[str, str]
    skipped: tuple[str, ...] = ()  # sub-names that duplicate shared weights
    masks_position_zero: bool = True  # the token embedding is zeroed at position 0


LAYOUTS = {
    "mimo": Layout(
        True,
        False,
        False,
        {
            "token_layernorm": "token_norm",
            "hidden_layernorm": "hidden_norm",
            "input_proj": "proj",
            "final_layernorm": "final_norm",
        },
    ),
    "deepseek": Layout(
        False,
        True,
        False,
        {
            "enorm": "token_norm",
            "hnorm": "hidden_norm",
            "eh_proj": "proj",
            "shared_head.norm": "final_norm",
        },
        skipped=("embed_tokens.", "shared_head.head."),
    ),
    "qwen3_next": Layout(
        False,
        True,
        True,
        {
            "pre_fc_norm_embedding": "token_norm",
            "pre_fc_norm_hidden": "hidden_norm",
            "fc": "proj",
            "norm": "final_norm",
        },
        masks_position_zero=False,
    ),
}


def detect_layout(names: list[str], config: ModelConfig) -> str | None:
    """The MTP layout of a checkpoint from its tensor names (None: it has no MTP weights)."""
    if any(n.startswith("model.mtp_layers.") for n in names):
        return "mimo"
    if any(n.startswith("mtp.") for n in names):
        return "qwen3_next"
    first = f"model.layers.{config.num_hidden_layers}."
    if any(n.startswith(first) for n in names):
        return "deepseek"
    return None


def mtp_prefix_pattern(layout: str, config: ModelConfig) -> re.Pattern:
    """Matches a checkpoint name of the layout's MTP tensors; group 1 = layer index (or None),
    group 2 = the name inside the layer."""
    if layout == "mimo":
        return re.compile(r"model\.mtp_layers\.(\d+)\.(.+)")
    if layout == "deepseek":
        return re.compile(r"model\.layers\.(\d+)\.(.+)")  # index >= num_hidden_layers only
    return re.compile(r"mtp\.(?:layers\.(\d+)\.)?(.+)")


def map_mtp_name(name: str, layout: str, config: ModelConfig) -> str | None:
    """Checkpoint name -> our parameter name under `mtp.`; '' for a tensor skipped on purpose;
    None when the name is not an MTP tensor of this layout."""
    m = mtp_prefix_pattern(layout, config).fullmatch(name)
    if m is None:
        return None
    index, rest = m.group(1), m.group(2)
    spec = LAYOUTS[layout]
    if layout == "deepseek":
        if int(index) < config.num_hidden_layers:
            return None  # a main-model layer
        index = str(int(index) - config.num_hidden_layers)
    if rest.startswith(spec.skipped) or int(index or 0) > 0:
        return ""  # a copy of a shared weight, or a deeper MTP layer (unused, see above)
    for ours_from, ours in spec.names.items():
        if rest.startswith(ours_from + "."):
            if layout == "qwen3_next" and index is not None:
                break  # mtp.layers.0.norm... belongs to the block, not the head
            return f"mtp.layer.{ours}{rest[len(ours_from) :]}"
    return f"mtp.layer.block.{rest}"


class MTPLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.token_norm = RMSNorm(size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(size, config.rms_norm_eps)
        self.proj = Linear(2 * size, size, bias=False)
        if config.layer_types:  # hybrid (Qwen3.5): one full-attention layer of the model's kind
            self.block = Qwen3_5DecoderLayer(config, "full_attention")
            self.final_norm = ZeroCentredRMSNorm(size, config.rms_norm_eps)
        else:
            self.block = LlamaDecoderLayer(config)
            self.final_norm = RMSNorm(size, config.rms_norm_eps)


class MTPHead(nn.Module):
    """The MTP layers plus references to the target's embedding, head and final norm."""

    def __init__(self, config: ModelConfig, target: nn.Module) -> None:
        super().__init__()
        if config.num_nextn_predict_layers < 1:
            raise UnsupportedModel(
                f"{config.architecture}: the checkpoint has no MTP layers "
                "(num_nextn_predict_layers is 0); use --speculative-method ngram"
            )
        self.layer = MTPLayer(config)
        # Plain attributes (not submodules): the weights belong to the target.
        self.__dict__["target"] = target
        # The family's (dummy weights keep it); the loader sets the checkpoint's.
        self.layout = LAYOUTS["qwen3_next" if config.layer_types else "mimo"]
        self.draft_head: LMHead | None = None  # restrict_drafts
        self.draft_ids: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        target_hidden: bool,
    ) -> torch.Tensor:
        """(T,) next tokens, (T, H) hidden at the same positions -> normed MTP output (T, H).

        `target_hidden`: the hidden comes from the target model (else from the previous MTP
        step, already normed by it).
        """
        layer = self.layer
        model = self.target.model
        if target_hidden and self.layout.normed_hidden:
            hidden = model.norm(hidden)
        fused = mtp_input if hidden.is_cuda else mtp_input_ref  # one kernel for six
        # It zeroes the embedding of rows whose position argument is 0: ones where none is.
        masked = positions if self.layout.masks_position_zero else torch.ones_like(positions)
        x = layer.proj(
            fused(
                hidden,
                input_ids,
                masked,
                model.embed_tokens.weight,
                layer.hidden_norm.weight,
                layer.token_norm.weight,
                layer.hidden_norm.eps,
                self.layout.hidden_first,
            )
        )
        x, residual = layer.block(x, None, model.rotary_emb.bind(positions))
        return layer.final_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.lm_head(hidden)

    def restrict_drafts(self, token_ids: torch.Tensor) -> None:
        """Draft only from `token_ids` (a token map): a head holding just those rows of the
        target's LM head (a copy: the rows are gathered once, not per step)."""
        weight = self.target.lm_head.weight
        self.draft_ids = token_ids.to(weight.device)
        with torch.device("meta"):  # no throwaway allocation; the weight is set next
            self.draft_head = LMHead(len(token_ids), weight.shape[1])
        self.draft_head.weight = nn.Parameter(weight[self.draft_ids], requires_grad=False)

    def draft(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, H) normed MTP outputs -> (N,) greedy drafts, into `out` if given (the
        verification rule needs a deterministic draft, spec/speculator.py)."""
        if self.draft_head is None:
            return greedy(self.compute_logits(hidden), out)
        return greedy(self.draft_head(hidden), out, ids=self.draft_ids)
