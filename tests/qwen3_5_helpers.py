"""Tiny random Qwen3.5 text checkpoints written by transformers (fp32), random MTP weights added
to them (`add_mtp_weights`), and transformers' greedy continuation: shared by test_qwen3_5*.py
and test_gpu_qwen3_5.py."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

try:
    import transformers
except ImportError:  # the tests that need it skip (pytest.importorskip)
    transformers = None

VOCAB = 128
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # rotary on 8 dims of 32 (partial_rotary_factor 0.25)
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    max_position_embeddings=128,
)
LIN, FULL = "linear_attention", "full_attention"
VARIANTS = {
    # DeltaNet first and last, attention between; two value heads per key head.
    "lin_first_last": dict(layer_types=[LIN, FULL, LIN, LIN]),
    # ... with room for 1,400-token prompts.
    "lin_first_last_long": dict(layer_types=[LIN, FULL, LIN, LIN], max_position_embeddings=1536),
    # The published pattern's period (3 x DeltaNet, 1 x attention), tied head, Hv == Hk,
    # head_dim 16 (4 rotary dims), a kernel of width 3.
    "published_tied": dict(
        layer_types=[LIN, LIN, LIN, FULL],
        tie_word_embeddings=True,
        linear_num_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=3,
    ),
    "attention_first": dict(layer_types=[FULL, LIN, FULL, LIN], num_key_value_heads=1),
    # A 12-token vocabulary: greedy outputs repeat n-grams, so n-gram drafts come and are
    # accepted (and rejected) often.
    "small_vocab": dict(layer_types=[LIN, FULL, LIN], vocab_size=12),
}


# A tiny vision tower for Qwen3_5ForConditionalGeneration checkpoints (its weights are skipped).
TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    num_position_embeddings=16,
)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations: matrices ~ N(0, 1/fan_in), zero-centred norms w ~ 0.2 N(0, 1) (scale
    1 + w), the gated norm's weight 1 + 0.2 N(0, 1), A in [0.5, 8) (decays from mild to
    strong), small dt_bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:  # linears, embeddings, conv1d (C, 1, W)
                p.copy_(noise * p.shape[-1] ** -0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 8.0, generator=g).log())
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)


def make_checkpoint(path, variant: str, seed: int):
    extra = VARIANTS[variant]
    config = transformers.Qwen3_5TextConfig(
        **{**BASE, **extra}, num_hidden_layers=len(extra["layer_types"])
    )
    torch.manual_seed(seed)
    hf = transformers.Qwen3_5ForCausalLM(config)
    randomize_(hf, seed)
    hf.config._attn_implementation = "eager"
    hf.save_pretrained(path)
    return hf.eval()


def add_mtp_weights(path, text, seed: int, echo: bool = False) -> dict[str, torch.Tensor]:
    """Random top-level `mtp.*` tensors in the published layout written into the checkpoint at
    `path` (its config.json, or its text_config, gets `mtp_num_hidden_layers: 1`): fc (H, 2H),
    the zero-centred pre_fc_norm_embedding / pre_fc_norm_hidden / norm, and layers.0 shaped as
    a full-attention decoder layer of `text` (transformers' text model: names and shapes taken
    from it). `echo`: the layer mostly passes the target's hidden through (fc's hidden half is
    the identity, the attention's and the MLP's outputs are scaled by 0.1), so the drafts mostly
    repeat the last token and runs of one token in the greedy output accept several drafts a
    step. Returns them."""
    full = text.config.layer_types.index("full_attention")
    layer = text.layers[full].state_dict()  # input_layernorm, self_attn.*, mlp.*, ...
    size = text.config.hidden_size
    shapes = {f"layers.0.{name}": t.shape for name, t in layer.items()}
    shapes |= {"fc.weight": (size, 2 * size)}
    shapes |= {f"{n}.weight": (size,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden")}
    shapes |= {"norm.weight": (size,)}
    g = torch.Generator().manual_seed(seed)
    mtp = {}
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=g)
        # matrices ~ N(0, 1/fan_in); zero-centred norms w ~ 0.2 N(0, 1) (scale 1 + w)
        mtp[f"mtp.{name}"] = noise * shape[-1] ** -0.5 if len(shape) > 1 else 0.2 * noise
    if echo:
        mtp["mtp.fc.weight"][:, :size] *= 0.1
        mtp["mtp.fc.weight"][:, size:] = torch.eye(size)  # [embedding | hidden] -> hidden
        for name in ("layers.0.self_attn.o_proj", "layers.0.mlp.down_proj"):
            mtp[f"mtp.{name}.weight"] *= 0.1
        for name in ("pre_fc_norm_hidden", "norm"):
            mtp[f"mtp.{name}.weight"].zero_()
    file = os.path.join(path, "model.safetensors")
    save_file(load_file(file) | mtp, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return mtp


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0].tolist()


def eager_decode_graphs(llm, verify: bool = False) -> None:
    """Give `llm`'s runner decode graphs that replay eagerly (capture=False): the graph-step
    path on the CPU, with the hybrid model's state inputs. `verify`: verify graphs too (per-token
    state slots as inputs), and an MTP engine's drafting after their replays, as on the GPU."""
    from tinyserve.runner.draft_graphs import DraftGraphs
    from tinyserve.runner.graphs import DecodeGraphs

    r = llm.engine.runner
    args = (r.model, r.config.max_num_seqs, r.max_blocks_per_seq, r.num_kv_blocks, r.block_size)
    r.graphs = DecodeGraphs(*args, capture=False, state_scratch=r.state_scratch)
    if verify:
        q = r.config.num_speculative_tokens + 1
        r.verify_graphs = DecodeGraphs(
            *args, query_len=q, capture=False, state_scratch=r.state_scratch
        )
        if r.drafter is not None:
            r.draft_graphs = DraftGraphs(
                r.verify_graphs, r.drafter.draft_tokens, r.graphs.last_sampled
            )
