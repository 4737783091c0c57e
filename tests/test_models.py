"""Llama-family model vs transformers on tiny random checkpoints (fp32, max abs diff <= 1e-4).

Covers Llama (rope default/llama3/yarn/linear, biases), Qwen2 (qkv bias, tied), Qwen3 (q/k norm,
head_dim != hidden/heads), MiMo (Qwen2 + skipped MTP weights), and the paged-KV path exactly as
the engine drives it: chunked prefill, then decode, then mixed batches of several sequences.
The slow test repeats the comparison on the real SmolLM2 checkpoint.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyserve.model.config import ModelConfig
from tinyserve.model.layers.attention import Attention, AttentionMetadata, forward_context
from tinyserve.model.layers.rotary import compute_inv_freq
from tinyserve.model.loader import load_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# Small original context so positions up to ~30 hit every scaling regime.
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3}),
    "llama_yarn_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": YARN, "tie_word_embeddings": True},
    ),
    "llama_linear_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3_head_dim": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3_yarn": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 16, "rope_parameters": {**YARN, "rope_theta": 1e6}},
    ),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """HF's init (std 0.02, norms 1, biases 0) makes logits nearly flat and hides bugs; use
    O(1) activations, non-trivial norm weights and biases instead."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, device="cpu").to(p.device)
            if p.dim() == 2:
                p.copy_(noise * p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)  # biases


def make_checkpoint(path, variant: str, seed: int = 0):
    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**BASE, **extra)
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(config)
    randomize_(hf, seed)
    hf.config._attn_implementation = "eager"  # plain fp32 softmax reference
    hf.save_pretrained(path)
    return hf.eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), make_checkpoint(path, request.param)


def load_ours(path: str):
    return load_model(ModelConfig.from_pretrained(path), torch.float32, torch.device("cpu"))


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # (T, V)


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(BASE["vocab_size"]) for _ in range(n)]


@torch.no_grad()
def test_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    ours = load_ours(path)
    tokens = random_tokens(30, seed=1)
    hidden = ours(torch.tensor(tokens), torch.arange(len(tokens)))
    assert hidden.shape == (len(tokens), BASE["hidden_size"])
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}, LLAMA3, YARN])
def test_inv_freq_is_computed_on_cpu_under_any_default_device(scaling):
    # The loader builds the model inside `with device:`; inv_freq must still be the CPU float32
    # computation HF does, or a CUDA build mixes devices (and rounds differently).
    with torch.device("meta"):
        inv_freq, _ = compute_inv_freq(16, 10000.0, scaling, max_position=64)
    assert inv_freq.device.type == "cpu" and inv_freq.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Paged KV path, driven like the engine: per step, each sequence contributes its tokens
# [start, end) and has context_len = end tokens of KV (cached prefix + this step's tokens).


class PagedCache:
    """A block pool per layer, poisoned with NaN so any read of an unwritten slot shows up."""

    def __init__(self, model, num_blocks: int, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, out-of-order block ids
        config = model.config
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        for module in model.modules():
            if isinstance(module, Attention):
                module.k_cache = torch.full(shape, float("nan"))
                module.v_cache = torch.full(shape, float("nan"))

    def allocate(self, num_tokens: int) -> list[int]:
        num_blocks = -(-num_tokens // self.block_size)
        table, self.free = self.free[:num_blocks], self.free[num_blocks:]
        return table

    def metadata(self, rows: list[tuple[int, int, list[int]]]) -> AttentionMetadata:
        """rows: (start, end, block_table) per sequence."""
        bs = self.block_size
        slots = [
            table[p // bs] * bs + p % bs for start, end, table in rows for p in range(start, end)
        ]
        query_lens = [end - start for start, end, _ in rows]
        context_lens = [end for _, end, _ in rows]
        width = max(len(table) for _, _, table in rows)
        tables = [table + [0] * (width - len(table)) for _, _, table in rows]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
            max_context_len=max(context_lens),
            is_decode_only=all(n == 1 for n in query_lens),
        )


@torch.no_grad()
def run_step(model, cache: PagedCache, seqs, tables, rows: list[tuple[int, int, int]]):
    """rows: (seq index, start, end). Returns one logits tensor (end - start, V) per row."""
    ids = torch.tensor([t for i, start, end in rows for t in seqs[i][start:end]])
    positions = torch.tensor([p for _, start, end in rows for p in range(start, end)])
    md = cache.metadata([(start, end, tables[i]) for i, start, end in rows])
    with forward_context(md):
        logits = model.compute_logits(model(ids, positions))
    return logits.split(md.query_lens_cpu)


def test_paged_chunked_prefill_then_decode(checkpoint):
    path, hf = checkpoint
    ours = load_ours(path)
    cache = PagedCache(ours, num_blocks=16, block_size=4, seed=0)
    tokens = random_tokens(19, seed=2)
    expected = hf_logits(hf, tokens)
    tables = [cache.allocate(len(tokens))]
    # Two prefill chunks (the second attends to the first through the cache), then decode.
    steps = [(0, 7), (7, 13)] + [(p, p + 1) for p in range(13, len(tokens))]
    for start, end in steps:
        (logits,) = run_step(ours, cache, [tokens], tables, [(0, start, end)])
        torch.testing.assert_close(logits, expected[start:end], atol=ATOL, rtol=0)


def test_paged_mixed_batches_match_each_sequence_alone(checkpoint):
    path, hf = checkpoint
    ours = load_ours(path)
    cache = PagedCache(ours, num_blocks=32, block_size=4, seed=1)
    lengths = [11, 18, 8, 13]
    seqs = [random_tokens(n, seed=10 + i) for i, n in enumerate(lengths)]
    expected = [hf_logits(hf, s) for s in seqs]
    tables = [cache.allocate(n) for n in lengths]
    schedule = [
        [(0, 0, 5), (1, 0, 12), (2, 0, 6), (3, 0, 3)],  # prefills of different lengths
        [(0, 5, 6), (1, 12, 17), (2, 6, 7), (3, 3, 9)],  # mixed: decode rows + prefill chunks
        [(0, 6, 7), (1, 17, 18), (2, 7, 8), (3, 9, 10)],  # decode only, contexts 7..18
        [(3, 10, 11), (0, 7, 8)],  # decode only, a subset in another order
        [(0, 8, 11), (3, 11, 12)],  # a 3-token chunk next to a decode row
        [(3, 12, 13)],
    ]
    for rows in schedule:
        outs = run_step(ours, cache, seqs, tables, rows)
        for (i, start, end), logits in zip(rows, outs, strict=True):
            torch.testing.assert_close(logits, expected[i][start:end], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def test_mimo_runs_qwen2_body_and_skips_mtp_weights(tmp_path):
    hf = make_checkpoint(tmp_path, "qwen2_tied", seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.mtp_layers.0.input_layernorm.weight"] = torch.ones(BASE["hidden_size"])
    tensors["model.mtp_layers.0.token_layernorm.weight"] = torch.ones(BASE["hidden_size"])
    save_file(tensors, tmp_path / "model.safetensors")

    model_config = ModelConfig.from_pretrained(tmp_path)
    assert model_config.architecture == "MiMoForCausalLM"
    assert model_config.num_nextn_predict_layers == 1
    ours = load_model(model_config, torch.float32, "cpu")
    tokens = random_tokens(12, seed=4)
    logits = ours.compute_logits(ours(torch.tensor(tokens), torch.arange(len(tokens))))
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_path, hf_smollm2):
    """The real checkpoint (30 layers, 9 heads / 3 kv heads, tied): plain forward, then the
    same tokens as chunked prefill + decode through a paged cache."""
    ours = load_ours(smollm2_path)
    tokens = random_tokens(24, seed=5)
    tokens = [t * 379 % ours.config.vocab_size for t in tokens]  # spread over the real vocab
    expected = hf_logits(hf_smollm2, tokens)
    with torch.no_grad():
        logits = ours.compute_logits(ours(torch.tensor(tokens), torch.arange(len(tokens))))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)

    cache = PagedCache(ours, num_blocks=8, block_size=4, seed=2)
    tables = [cache.allocate(len(tokens))]
    for start, end in [(0, 9), (9, 20), (20, 21), (21, 22), (22, 23), (23, 24)]:
        (logits,) = run_step(ours, cache, [tokens], tables, [(0, start, end)])
        torch.testing.assert_close(logits, expected[start:end], atol=ATOL, rtol=0)
