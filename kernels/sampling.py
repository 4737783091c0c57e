"""Fused exponential-race sampling: token = argmax_v (x_v - log(-log u_v)), or argmax_v x_v.

`sample_race(x (B, V) float32 processed logits, keys (B,) int64, is_greedy (B,) bool | None)`
-> (B,) int64. u_v is tinyserve.sampling.counter_uniform's stream bit for bit (splitmix64 of
key + (v + 1) * golden, top 23 bits), so seeded draws equal the torch sampler's; ties go to the
lowest index, as torch.argmax. Pass 1 reduces vocab chunks, pass 2 picks the best chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, next_pow2, pdl, pdl_sync

# splitmix64 constants (uint64 literals); jit code reads globals only as tl.constexpr objects.
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MUL1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MUL2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _counter_uniform(key, v):
    """u in (0, 1) float32 for uint64 `key` and int vocab index `v` (any shape)."""
    z = key + (v.to(tl.uint64) + 1) * _GOLDEN
    z = (z ^ (z >> 30)) * _MUL1  # uint64: logical shifts, wrapping products
    z = (z ^ (z >> 27)) * _MUL2
    z = z ^ (z >> 31)
    s = (z.to(tl.int64, bitcast=True) >> 41).to(tl.float32)  # signed top 23 bits
    return (s + 4194304.5) * 1.1920928955078125e-07  # (s + 2**22 + 0.5) / 2**23, exact


# The chunk count follows the batch, so it is no constexpr: as one, each new batch size of an
# eager step would compile both kernels again mid-run (~0.2 s each). `chunk` stays specialized
# (always a multiple of BLOCK_V: one variant): its loads then know their alignment.
@triton.jit
def _race_chunk_kernel(
    x_ptr, keys_ptr, greedy_ptr, best_ptr, best_idx_ptr, V, chunk, stride_x,
    BLOCK_V: tl.constexpr, HAS_GREEDY: tl.constexpr, SAMPLED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    key = tl.load(keys_ptr + b).to(tl.uint64, bitcast=True)  # argmax: a placeholder
    is_sampled = True
    if HAS_GREEDY:
        is_sampled = tl.load(greedy_ptr + b) == 0
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    start = c * chunk
    end = tl.minimum(start + chunk, V)
    for v0 in range(start, end, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        mask = v < end
        x = tl.load(x_ptr + b * stride_x + v, mask=mask, other=float("-inf"))
        if SAMPLED:  # constexpr: a plain argmax compiles without the noise
            if is_sampled:
                x = x - tl.log(-tl.log(_counter_uniform(key, v)))
        x = tl.where(mask, x, float("-inf"))
        # Lane-wise running max; strict > keeps the earliest v of each lane on ties.
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, v, best_idx)
    top = tl.max(best, 0)
    # Lowest index among the lanes holding the max (torch.argmax's tie rule); -inf rows -> start.
    idx = tl.min(tl.where(best == top, best_idx, V), 0)
    idx = tl.where(top == float("-inf"), start, idx)
    num_chunks = tl.num_programs(1)
    tl.store(best_ptr + b * num_chunks + c, top)
    tl.store(best_idx_ptr + b * num_chunks + c, idx)


@triton.jit(do_not_specialize=["num_chunks"])
def _race_pick_kernel(best_ptr, best_idx_ptr, ids_ptr, out_ptr, num_chunks,
                      BLOCK_C: tl.constexpr, HAS_IDS: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """BLOCK_C covers the most chunks the vocabulary can take (a tile each), whatever the batch.
    HAS_IDS: column v stands for token ids[v] (a draft head's token map)."""
    pdl_sync(USE_PDL)
    b = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    best = tl.load(best_ptr + b * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    top = tl.max(best, 0)
    first = tl.min(tl.where(best == top, c, BLOCK_C), 0)  # chunks are in vocab order
    idx = tl.load(best_idx_ptr + b * num_chunks + first).to(tl.int64)
    if HAS_IDS:
        idx = tl.load(ids_ptr + idx).to(tl.int64)
    tl.store(out_ptr + b, idx)


def sample_race(
    x: torch.Tensor,
    keys: torch.Tensor,
    is_greedy: torch.Tensor | None = None,
    *,
    num_chunks: int | None = None,
) -> torch.Tensor:
    """x (B, V) float32 -> token ids (B,) int64; rows with is_greedy take argmax(x)."""
    check(x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1, "x (B, V) float32")
    batch, vocab = x.shape
    check(keys.shape == (batch,) and keys.dtype == torch.int64, "keys must be (B,) int64")
    check(keys.is_contiguous(), "keys must be contiguous")
    check(vocab < 2**31, "vocab too large")
    if is_greedy is not None:
        check(is_greedy.shape == (batch,) and is_greedy.dtype == torch.bool, "is_greedy (B,)")
        check(is_greedy.is_contiguous(), "is_greedy must be contiguous")
    check(len({t.device for t in (x, keys, is_greedy) if t is not None}) == 1, "one device")
    greedy = is_greedy.view(torch.uint8) if is_greedy is not None else keys
    out = torch.empty(batch, dtype=torch.int64, device=x.device)
    return _race(x, keys, greedy, out, num_chunks, has_greedy=is_greedy is not None)


def argmax(x: torch.Tensor, out: torch.Tensor | None = None, ids: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x (B, V) float32 -> (B,) int64 ids of each row's maximum, into `out` if given: the first
    on ties (torch.argmax's rule); NaN never wins (torch's would); with `ids` (V,) int64, the
    maximum v's ids[v] (a draft head's token map, without a gather kernel). The race without
    the noise, in chunks of two tiles (`_race`): 1.5-3x faster than torch.argmax at a 152k
    vocabulary, 1-128 rows (docs/benchmark-log.md)."""
    check(x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1, "x (B, V) float32")
    check(x.shape[1] < 2**31, "vocab too large")
    if out is None:
        out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    check(out.shape == x.shape[:1] and out.dtype == torch.int64 and out.is_contiguous(),
          "out must be (B,) int64, contiguous")
    check(out.device == x.device, "x and out on one device")
    if ids is not None:
        check(ids.shape == x.shape[1:] and ids.dtype == torch.int64 and ids.is_contiguous(),
              "ids must be (V,) int64, contiguous")
        check(ids.device == x.device, "x and ids on one device")
    return _race(x, out, out, out, None, all_greedy=True, ids=ids)


def _race(x, keys, greedy, out, num_chunks: int | None, has_greedy: bool = False,
          all_greedy: bool = False, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Pass 1: the best (value, id) of each vocab chunk; pass 2: the best chunk's id, into out.
    By default chunks of two tiles, at any batch: a program's loop waits on each tile's load,
    so ~2 programs an SM over the batch (chunks of 30 tiles at 64 rows of 151,680) leave the
    memory idle: two-tile chunks are 1.1-1.9x faster at 1-128 rows.
    all_greedy: a plain argmax (keys and greedy are placeholders, loaded but unused)."""
    batch, vocab = x.shape
    if batch == 0:
        return out
    block_v = min(1024, next_pow2(vocab))
    tiles = triton.cdiv(vocab, block_v)  # the most chunks: one tile each
    if num_chunks is None:
        num_chunks = triton.cdiv(tiles, 2)
    num_chunks = max(1, min(num_chunks, tiles))
    chunk = triton.cdiv(triton.cdiv(vocab, num_chunks), block_v) * block_v
    num_chunks = triton.cdiv(vocab, chunk)
    best = torch.empty(batch, num_chunks, dtype=torch.float32, device=x.device)
    best_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=x.device)
    _race_chunk_kernel[(batch, num_chunks)](
        x, keys, greedy, best, best_idx, vocab, chunk, x.stride(0),
        BLOCK_V=block_v, HAS_GREEDY=has_greedy, SAMPLED=not all_greedy,
        num_warps=4, **pdl(x.device),
    )
    _race_pick_kernel[(batch,)](
        best, best_idx, out if ids is None else ids, out, num_chunks, BLOCK_C=next_pow2(tiles),
        HAS_IDS=ids is not None, num_warps=1, **pdl(x.device),
    )
    return out


def counter_uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The Triton stream as a (B, V) tensor, to check it against tinyserve.sampling's."""
    out = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32, device=keys.device)
    _uniform_kernel[(keys.shape[0],)](keys, out, vocab_size, BLOCK_V=1024)
    return out


@triton.jit
def _uniform_kernel(keys_ptr, out_ptr, V, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    key = tl.load(keys_ptr + b).to(tl.uint64, bitcast=True)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        tl.store(out_ptr + b * V + v, _counter_uniform(key, v), mask=v < V)


def sample_race_ref(
    x: torch.Tensor, keys: torch.Tensor, is_greedy: torch.Tensor | None = None
) -> torch.Tensor:
    """tinyserve.sampling.sample's last stage, op for op (its stream re-derived here)."""
    golden, mul1, mul2 = (c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                              0x94D049BB133111EB))
    z = keys[:, None] + (torch.arange(x.shape[1], device=x.device) + 1) * golden  # (B, V) int64
    z ^= (z >> 30) & ((1 << 34) - 1)  # logical shifts of the unsigned value
    z *= mul1
    z ^= (z >> 27) & ((1 << 37) - 1)
    z *= mul2
    z ^= (z >> 31) & ((1 << 33) - 1)
    u = (z >> 41).to(torch.float32).add_(2.0**22 + 0.5).mul_(2.0**-23)
    token_ids = (x - u.log_().neg_().log_()).argmax(dim=-1)
    if is_greedy is not None:
        token_ids = torch.where(is_greedy, x.argmax(dim=-1), token_ids)
    return token_ids
