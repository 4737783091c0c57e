"""Cascade attention for the CPU path's decode steps: rows whose block tables start with the
same KV blocks (prefix-cache hits of one prompt head) attend those shared keys once per group,
each row attends the rest of its own keys, and the two parts merge by their log-sum-exps, as
the GPU decode kernel's shared-prefix path does. The result is `attention.decode_attention_ref`'s
to rounding; `decode` returns None where no two rows share a block (the caller then runs the
reference). Prompt chunks after shared blocks gained ~4% a step the same way (noisy host),
so prefill steps keep the reference.

SmolLM2-135M, 2 cores (AMX), bf16, 32 decode rows in 4 groups (`bench.py prefix --small`'s
workload), both paths timed on the same calls: 2.17-2.21 -> 1.86-2.02 ms a layer with 512
shared keys of ~600, 9.21 -> 4.09 ms with 2,048 of ~2,130 (BENCHMARKS.md, thirty-first
session)."""

from __future__ import annotations

import torch

# SDPA's fused CPU kernel, which also returns each query row's log-sum-exp (natural log, of
# the scaled scores); None on a torch without it: the reference runs instead.
_sdpa_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def shared_groups(md, block_size: int) -> list[tuple[list[int], torch.Tensor]]:
    """Groups of two or more sequences whose tables start with the same blocks: (sequence
    indices, the shared blocks' cache slots). A shared block ends before each sequence's first
    query position, so every query sees all of it and every sequence keeps keys of its own
    (its newest token's block is never shared). Computed by the first layer, kept in md."""
    if md.shared_groups is not None:
        return md.shared_groups
    tables, by_head, md.shared_groups = md.block_tables, {}, []
    if len(md.context_lens_cpu) != len(md.query_lens_cpu):
        return md.shared_groups  # no host lengths (MTP drafting chains): the reference
    cached = [c - q for q, c in zip(md.query_lens_cpu, md.context_lens_cpu, strict=True)]
    for i, (n, head) in enumerate(zip(cached, tables[:, 0].tolist(), strict=True)):
        if n >= block_size:
            by_head.setdefault(head, []).append(i)
    for rows in (rows for rows in by_head.values() if len(rows) > 1):
        t = tables[rows, : min(cached[i] for i in rows) // block_size]
        n = int((t == t[0]).all(0).long().cumprod(0).sum())  # leading blocks all rows share
        pos = torch.arange(n * block_size)
        slots = tables[rows[0], pos // block_size].long() * block_size + pos % block_size
        md.shared_groups.append((rows, slots))
    return md.shared_groups


def decode(q, k_cache, v_cache, md, scale: float) -> torch.Tensor | None:
    """One query token per sequence: q (B, Hq, D) -> (B, Hq, D), or None (no sharing)."""
    groups = shared_groups(md, k_cache.shape[1]) if _sdpa_lse is not None else []
    if not groups:
        return None
    batch, num_heads, head_dim = q.shape
    hkv = k_cache.shape[2]
    q = q.view(batch, hkv, num_heads // hkv, head_dim)  # (B, Hkv, G, D): G query "tokens"
    out, lse = _shared_parts(q, k_cache, v_cache, groups, scale)
    slots, mask = _own_keys(md, k_cache.shape[1], groups)
    k, v = (c.view(-1, hkv, head_dim).index_select(0, slots).view(batch, -1, hkv, head_dim)
            .transpose(1, 2) for c in (k_cache, v_cache))  # fmt: skip
    o, lo = _sdpa_lse(q, k, v, attn_mask=mask.to(q.dtype), scale=scale)[:2]
    top = torch.maximum(lse, lo)  # the two softmax-normalized parts, weighted by their sums
    w_shared, w_own = torch.exp(lse - top)[..., None], torch.exp(lo - top)[..., None]
    out = (out * w_shared + o.float() * w_own) / (w_shared + w_own)
    return out.to(q.dtype).reshape(batch, num_heads, head_dim)


def _shared_parts(q, k_cache, v_cache, groups, scale: float):
    """Each group's rows (q: (B, Hkv, G, D)) over its shared keys, read once: float32 outputs
    (B, Hkv, G, D) and log-sum-exps (B, Hkv, G); -inf (weight 0) outside groups."""
    _, hkv, g, head_dim = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    k_flat, v_flat = (c.view(-1, hkv, head_dim) for c in (k_cache, v_cache))
    for rows, slots in groups:
        k, v = (c.index_select(0, slots).transpose(0, 1)[None] for c in (k_flat, v_flat))
        qg = q[rows].transpose(0, 1).reshape(1, hkv, -1, head_dim)  # (1, Hkv, R*G, D)
        o, lo = _sdpa_lse(qg, k, v, scale=scale)[:2]
        out[rows] = o[0].view(hkv, len(rows), g, head_dim).transpose(0, 1).float()
        lse[rows] = lo[0].view(hkv, len(rows), g).transpose(0, 1)
    return out, lse


def _own_keys(md, block_size: int, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's own keys after each row's shared ones: flat slots (B*L,) and an additive
    mask (B, 1, 1, L) of 0 / -inf; padding reads the row's first own key (written, finite)."""
    if md.decode_cascade is None:
        ctx = torch.tensor(md.context_lens_cpu)
        first = torch.zeros(len(ctx), dtype=torch.long)
        for rows, slots in groups:
            first[rows] = len(slots)
        pos = first[:, None] + torch.arange(int((ctx - first).max()))[None, :]  # (B, L)
        valid = pos < ctx[:, None]
        pos = torch.where(valid, pos, first[:, None])
        slots = md.block_tables.long().gather(1, pos // block_size) * block_size
        mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))
        md.decode_cascade = ((slots + pos % block_size).flatten(), mask[:, None, None, :])
    return md.decode_cascade
