"""Paged attention over a KV cache, pure torch (the reference the Triton kernels must match).

The runner sets `AttentionMetadata` for one forward with `forward_context(metadata)`. Each
`Attention` stores this step's k/v at `slot_mapping` in its `k_cache`/`v_cache`
((num_blocks, block_size, Hkv, D) views assigned by the runner), then attends: a sequence's
query tokens are the LAST query_len positions of its context_len tokens (causal with offset).
With no cache assigned it is plain causal attention over the T tokens as one sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.kernels.decode_attention import MAX_TILE_ROWS, decode_attention
from tinyserve.kernels.prefill_attention import prefill_attention
from tinyserve.kernels.rope_store_kv import rope_store_kv
from tinyserve.model.layers import cascade


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # (B, max_blocks_per_seq) int32, padded with 0
    cu_seqlens_q: torch.Tensor  # (B+1,) int32: query offsets of each sequence in the T tokens
    context_lens: torch.Tensor  # (B,) int32: KV length of each sequence including this step
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    max_context_len: int
    is_decode_only: bool  # every sequence has exactly one query token
    # A speculative verify step where every sequence runs its last token and k drafts: k + 1
    # (else 0). The decode kernel attends such rows with split-K too (long contexts).
    verify_query_len: int = 0
    # Decode split-K count, a function of the padded batch size and the longest context
    # (graph_shapes.decode_num_splits), so that eager and CUDA-graph steps sum in the same order
    # (bit-identical outputs); None lets the kernel choose.
    num_splits: int | None = None
    decode_block_n: int | None = None  # its key tile (graph_shapes.decode_tiling); None: default
    decode_min_split: int = 0  # the floor of a row's split length (graph_shapes.decode_tiling)
    # Key splits of the prefill kernel in an eager step (kernels.prefill_attention.
    # prefill_num_splits): a long prompt's chunk beside short rows fills the GPU.
    prefill_num_splits: int = 1
    # A mixed graph's layout (graphs.DecodeGraphs, mixed): (d, cu) where rows [0, d) are decode
    # rows (the decode kernel) and the rest one prompt chunk (the prefill kernel; cu = [0, its
    # padded length]), so neither kernel's grid depends on the other's rows.
    chunk: tuple[int, torch.Tensor] | None = None
    decode_gather: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU path, set lazily
    # CPU decode path, set lazily (layers/cascade.py): rows grouped by the KV blocks they
    # share, and the gather of each row's own keys after them.
    shared_groups: list | None = None
    decode_cascade: tuple | None = None
    # CPU mixed steps, set lazily: the decode rows' own metadata, and the chunks' cascade plan.
    decode_rows: tuple | None = None
    prefill_cascade: tuple | None = None
    # Decode rows sharing leading KV blocks: (chunks, shared lengths) for the Triton kernel's
    # cascade path (kernels/decode_attention.py); the CPU path plans its own (`shared_groups`).
    shared_prefix: tuple[torch.Tensor, torch.Tensor] | None = None
    # Hybrid models (layers/gated_deltanet.py): each sequence's state slot (B,) int32, and
    # whether the slot holds its state so far (B,) bool (False: a first chunk, from zeros).
    state_slots: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # A verify step of a hybrid model: the state after each token goes to this slot (T,) int32
    # (-1: not kept); the sequences' own slots are only read.
    token_state_slots: torch.Tensor | None = None


_metadata: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata | None) -> Iterator[AttentionMetadata | None]:
    """Makes `metadata` the current one for the forwards run inside the block (nestable)."""
    global _metadata
    previous, _metadata = _metadata, metadata
    try:
        yield metadata
    finally:
        _metadata = previous


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v (T, Hkv, D) -> cache slots; every slot must be valid (>= 0)."""
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: q (B, Hq, D) -> (B, Hq, D). K/V are gathered through the
    block tables into a padded (B, L, Hkv, D) tensor; positions past a context length read the
    sequence's slot 0 (written, so finite: never-written memory may hold NaN and 0 * NaN would
    poison the sum) and are masked out of the softmax."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    slots, valid = _decode_gather(md, k_cache.shape[1])  # (B*L,), (B, 1, 1, L) bool
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    k = k.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # (B, Hkv, L, D)
    v = v.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    # GQA without repeating K/V: the G query heads of kv head h are its "query tokens". SDPA's
    # fused CPU kernel: ~2x faster than matmul-softmax-matmul.
    q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (B, Hkv, G, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _decode_gather(md: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots (B*L,) and the mask of valid keys (B, 1, 1, L) of a decode step;
    computed by the first layer and shared by the others (they read the same positions)."""
    if md.decode_gather is None:
        # max_context_len 0: unknown (a CUDA-graph-style replay), so the whole table width.
        num_blocks = -(-md.max_context_len // block_size) or md.block_tables.shape[1]
        first = torch.zeros_like(md.context_lens, dtype=torch.long)
        slots, valid = cascade.paged_slots(
            md.block_tables, first, md.context_lens, num_blocks * block_size, block_size
        )
        md.decode_gather = (slots, valid[:, None, None, :])
    return md.decode_gather


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    rows: list[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Any batch (prefill chunks and decode rows mixed): q (T, Hq, D) -> (T, Hq, D), one SDPA
    call per sequence (each of `rows`, default all) over its cached prefix + new tokens, into
    `out`. Host-side lengths only, no sync."""
    block_size = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    starts = [0, *accumulate(md.query_lens_cpu)]
    for i in range(len(md.query_lens_cpu)) if rows is None else rows:
        context_len, start, end = md.context_lens_cpu[i], starts[i], starts[i + 1]
        blocks = md.block_tables[i, : -(-context_len // block_size)]
        k = k_cache[blocks].flatten(0, 1)[:context_len]  # (L, Hkv, D)
        v = v_cache[blocks].flatten(0, 1)[:context_len]
        out[start:end] = causal_attention(q[start:end], k, v, scale)
    return out


def mixed_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """A CPU step with prompt chunks: rows of one query token that share KV blocks attend as
    a decode step's do (`cascade.decode`), chunks that share cached blocks as
    `cascade.prefill` (each group's shared keys read once, by all its queries in one call);
    the rest one SDPA call each, as `prefill_attention_ref`. Where prompts share a head (the
    shared-prefix workload) the followers' chunks and the decode rows beside them are most of a
    step, and one call per row spent more in gathers and dispatch than in attention."""
    if md.decode_rows is None:
        ones = [i for i, n in enumerate(md.query_lens_cpu) if n == 1]
        sub = None
        if len(ones) > 1:
            sub = AttentionMetadata(
                slot_mapping=md.slot_mapping[:0],
                block_tables=md.block_tables[ones],
                cu_seqlens_q=torch.arange(len(ones) + 1, dtype=torch.int32),
                context_lens=md.context_lens[ones],
                query_lens_cpu=[1] * len(ones),
                context_lens_cpu=[md.context_lens_cpu[i] for i in ones],
                max_context_len=max(md.context_lens_cpu[i] for i in ones),
                is_decode_only=True,
            )
        tok = md.cu_seqlens_q[ones].long()
        md.decode_rows = (ones, [i for i, n in enumerate(md.query_lens_cpu) if n > 1], sub, tok)
    ones, chunks, sub, tok = md.decode_rows
    out = torch.empty_like(q)
    rest = ones
    if sub is not None:
        o = cascade.decode(q.index_select(0, tok), k_cache, v_cache, sub, scale)
        if o is not None:
            out.index_copy_(0, tok, o)
            rest = []
    if len(chunks) > 1:
        chunks = cascade.prefill(q, k_cache, v_cache, md, chunks, scale, out)
    return prefill_attention_ref(q, k_cache, v_cache, md, scale, sorted(rest + chunks), out)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (Tq, Hq, D) are the last Tq positions of k, v (L, Hkv, D) -> (Tq, Hq, D)."""
    query_len, context_len = q.shape[0], k.shape[0]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
    if query_len == context_len:
        mask, is_causal = None, True  # lets SDPA pick its fused causal kernels
    else:
        # SDPA's is_causal aligns top-left; ours is bottom-right: query i sits at position
        # context_len - query_len + i and sees keys j <= that.
        rows = torch.arange(query_len, device=q.device)[:, None] + (context_len - query_len)
        mask, is_causal = torch.arange(context_len, device=q.device)[None, :] <= rows, False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
    )  # (1, Hq, Tq, D); fused kernels accumulate the softmax in float32
    return out.squeeze(0).transpose(0, 1)


class Attention(nn.Module):
    """Holds no weights: takes the packed qkv projection and returns the attention output."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "GQA needs num_heads % num_kv_heads == 0"
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        # Plain attributes, not buffers: the runner assigns views of its KV pool.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(
        self, qkv: torch.Tensor, rope, q_norm: nn.Module | None = None, k_norm=None
    ) -> torch.Tensor:
        """qkv (T, (Hq + 2 Hkv) D) -> (T, Hq, D): optional per-head RMSNorm of q and k (Qwen3),
        rotary at `rope.positions` (layers.rotary.BoundRotary), KV store, attention."""
        if qkv.is_cuda and self.k_cache is not None:
            return self._forward_triton(qkv, rope, q_norm, k_norm)
        sizes = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        q, k, v = qkv.view(qkv.shape[0], -1, self.head_dim).split(sizes, dim=1)  # (T, H*, D)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rope(q, k)
        if self.k_cache is None:
            return causal_attention(q, k, v, self.scale)
        md = _current_metadata()
        store_kv(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        args = (q, self.k_cache, self.v_cache, md, self.scale)
        if md.is_decode_only:  # rows sharing KV blocks: cascade; else the reference
            out = cascade.decode(*args)
            return decode_attention_ref(*args) if out is None else out
        return mixed_attention_cpu(*args)

    def _forward_triton(self, qkv, rope, q_norm, k_norm) -> torch.Tensor:
        md = _current_metadata()
        norms = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else ()
        q = rope_store_kv(
            qkv,
            rope.positions,
            rope.cos_sin_cache,
            self.k_cache,
            self.v_cache,
            md.slot_mapping,
            self.num_heads,
            *norms,
        )
        group = self.num_heads // self.num_kv_heads
        if md.chunk is not None:
            return self._decode_then_chunk(q, md)
        if md.is_decode_only or 0 < md.verify_query_len * group <= MAX_TILE_ROWS:
            return decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                md.block_tables,
                md.context_lens,
                self.scale,
                max_context_len=md.max_context_len or None,
                num_splits=md.num_splits,
                block_n=md.decode_block_n,
                min_split_len=md.decode_min_split,
                shared_chunks=md.shared_prefix[0] if md.shared_prefix else None,
                shared_lens=md.shared_prefix[1] if md.shared_prefix else None,
                query_len=md.verify_query_len or 1,
            )
        return prefill_attention(
            q,
            self.k_cache,
            self.v_cache,
            md.block_tables,
            md.cu_seqlens_q,
            md.context_lens,
            max(md.query_lens_cpu),
            self.scale,
            num_splits=md.prefill_num_splits,
        )

    def _decode_then_chunk(self, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """A mixed graph's attention: rows [0, d) by the decode kernel, the chunk after them by
        the prefill kernel (one sequence), each into its own rows of the output."""
        d, cu = md.chunk
        out = torch.empty_like(q)
        decode_attention(
            q[:d],
            self.k_cache,
            self.v_cache,
            md.block_tables[:d],
            md.context_lens[:d],
            self.scale,
            out[:d],
            num_splits=md.num_splits,
            block_n=md.decode_block_n,
            min_split_len=md.decode_min_split,
        )
        prefill_attention(
            q[d:],
            self.k_cache,
            self.v_cache,
            md.block_tables[d:],
            cu,
            md.context_lens[d:],
            q.shape[0] - d,
            self.scale,
            out[d:],
            num_splits=md.prefill_num_splits,
        )
        return out


def _current_metadata() -> AttentionMetadata:
    assert _metadata is not None, "KV cache assigned but no forward_context set"
    return _metadata
