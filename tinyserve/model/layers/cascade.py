"""Cascade attention: the plan both paths share (`plan_shared_prefixes`: the GPU decode kernel's
chunks, graphs.py) and the CPU path's steps, where rows whose block tables start with the same
KV blocks (prefix-cache hits of one prompt head) attend those shared keys once per group, each
row attends the rest of its own keys, and the two parts merge by their log-sum-exps, as the GPU
decode kernel's shared-prefix path does. `decode` (decode steps, and a mixed step's decode
rows) matches `attention.decode_attention_ref` to rounding, `prefill` (a mixed step's prompt
chunks: each group's queries in one call) `attention.prefill_attention_ref`; rows in no group
are left to those references. On a 2-core CPU a layer runs 1.1-2.2x faster for decode rows and
1.3-2.4x for mixed steps, more the longer the shared keys (docs/benchmark-log.md)."""

from __future__ import annotations

import numpy as np
import torch

# SDPA's fused CPU kernel, which also returns each query row's log-sum-exp (natural log, of
# the scaled scores); None on a torch without it: the reference runs instead.
_sdpa_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def plan_shared_prefixes(
    tables: np.ndarray,
    ctx: np.ndarray,
    block_size: int,
    rows_per_chunk: int,
    max_chunks: int,
    min_tokens: int = 128,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Cascade plan of a decode step. Rows whose first ceil(min_tokens / block_size) physical
    blocks are the same form a group (so a header common to every prompt, such as a chat
    template's, does not merge groups that share far more); its shared length is the fewest
    leading blocks any member has in common with the group's first row (its leader), never the
    block this step writes. Returns (chunks (C, 1 + R): leader row then up to R =
    rows_per_chunk members, -1 padded, C <= max_chunks; shared tokens per row (B,)), both int32,
    or None where sharing would skip less than an eighth of the step's KV reads."""
    b, width = tables.shape
    need = max(1, -(-min_tokens // block_size))  # blocks every member shares at least
    full = np.minimum((ctx - 1) // block_size, width)  # blocks before the one written now
    cand = np.flatnonzero(full >= need)
    if len(cand) < 2:
        return None
    _, group, counts = np.unique(
        tables[cand, :need], axis=0, return_inverse=True, return_counts=True
    )
    if counts.max() < 2:
        return None  # nothing shared (the common case without prefix-cache hits)
    order = np.argsort(group.reshape(-1), kind="stable")
    rows, first = cand[order], group.reshape(-1)[order]
    starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1]])
    sizes = np.diff(np.r_[starts, len(rows)])
    leaders = rows[np.repeat(starts, sizes)]  # per sorted row: its group's leader
    same = np.logical_and.accumulate(tables[rows] == tables[leaders], axis=1)
    common = np.minimum(same.sum(1), np.minimum(full[rows], full[leaders]))
    shared = np.minimum.reduceat(common, starts)  # blocks, per group (>= need)
    keep = sizes >= 2
    saved = int(((sizes - 1) * shared)[keep].sum()) * block_size
    if 8 * saved < int(ctx.sum()):
        return None
    lens = np.zeros(b, dtype=np.int32)
    chunks = []
    for g in np.flatnonzero(keep):
        members = rows[starts[g] : starts[g] + sizes[g]]
        if len(chunks) + -(-len(members) // rows_per_chunk) > max_chunks:
            continue  # no room: these rows attend their whole context themselves
        lens[members] = shared[g] * block_size
        for i in range(0, len(members), rows_per_chunk):
            part = members[i : i + rows_per_chunk]
            chunks.append([members[0], *part] + [-1] * (rows_per_chunk - len(part)))
    if not chunks:
        return None
    return np.array(chunks, dtype=np.int32), lens


def shared_groups(md, block_size: int) -> list[tuple[list[int], torch.Tensor]]:
    """The decode step's cascade plan (`plan_shared_prefixes`, the GPU kernel's, grouping by a
    first shared block, one chunk a group) as (rows, the shared blocks' cache slots) per group.
    Computed by the first layer, kept in md; [] without host context lengths (MTP drafting
    chains) or where sharing saves too little."""
    if md.shared_groups is None:
        md.shared_groups, tables, ctx = [], md.block_tables, md.context_lens_cpu
        batch = tables.shape[0]
        plan = None
        if len(ctx) == batch:
            plan = plan_shared_prefixes(
                tables.numpy(), np.array(ctx), block_size, batch, batch, min_tokens=block_size
            )
        for chunk in plan[0] if plan is not None else ():
            rows = [int(r) for r in chunk[1:] if r >= 0]
            n = torch.tensor([int(plan[1][rows[0]])])  # the group's shared keys: 0 .. n - 1
            slots = paged_slots(tables[rows[:1]], torch.zeros_like(n), n, int(n), block_size)[0]
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
    slots, mask = _own_keys(md, k_cache.shape[1], groups, q.dtype)
    k, v = (
        c.view(-1, hkv, head_dim)
        .index_select(0, slots)
        .view(batch, -1, hkv, head_dim)
        .transpose(1, 2)
        for c in (k_cache, v_cache)
    )
    o, lo = _sdpa_lse(q, k, v, attn_mask=mask, scale=scale)[:2]
    top = torch.maximum(lse, lo)  # the two softmax-normalized parts, weighted by their sums
    w_shared, w_own = torch.exp(lse - top)[..., None], torch.exp(lo - top)[..., None]
    out = (out * w_shared + o.float() * w_own) / (w_shared + w_own)
    return out.to(q.dtype).reshape(batch, num_heads, head_dim)


def prefill(q, k_cache, v_cache, md, rows: list[int], scale: float, out: torch.Tensor) -> list[int]:
    """Prompt chunks `rows` (of several query tokens; q (T, Hq, D) holds every row's) whose
    cached blocks start alike (`plan_shared_prefixes` on the blocks before each chunk): each
    group's queries attend its shared keys in one call, read once; each chunk its own keys after
    them (causal); the parts merge by their log-sum-exps into `out`. Returns the rows left for
    the caller (in no group). The plan is computed by the first layer, kept in md."""
    if md.prefill_cascade is None:
        g = q.shape[1] // k_cache.shape[2]
        md.prefill_cascade = _prefill_plan(md, k_cache.shape[1], rows, g, q.dtype) or ()
    plan = md.prefill_cascade
    if not plan:
        return rows
    groups, (members, width), tok, own_slots, mask, out_tok, keep, rest = plan
    num_tokens, num_heads, head_dim = q.shape
    hkv = k_cache.shape[2]
    g = num_heads // hkv
    # (Hkv, M, Tmax * G, D): each chunk's query tokens (padded), its G heads per kv head as
    # rows; kv heads outermost, so that a group (consecutive members) is a view.
    # (index_select and index_copy_ below: advanced indexing took ~5x as long on the CPU)
    qp = q.view(num_tokens, hkv, g, head_dim).index_select(0, tok)
    qp = qp.view(members, width, hkv, g, head_dim).permute(2, 0, 1, 3, 4)
    qp = qp.reshape(hkv, members, width * g, head_dim)
    k_flat, v_flat = (c.view(-1, hkv, head_dim) for c in (k_cache, v_cache))
    o_sh = torch.empty_like(qp)
    lse_sh = torch.empty(qp.shape[:3])
    for (lo, hi), slots in groups:
        k, v = (c.index_select(0, slots).transpose(0, 1)[None] for c in (k_flat, v_flat))
        qg = qp[:, lo:hi].reshape(1, hkv, -1, head_dim)
        o, lse = _sdpa_lse(qg, k, v, scale=scale)[:2]
        o_sh[:, lo:hi] = o.view(hkv, hi - lo, width * g, head_dim)
        lse_sh[:, lo:hi] = lse.view(hkv, hi - lo, width * g)
    k, v = (
        c.index_select(0, own_slots).view(members, -1, hkv, head_dim).transpose(1, 2)
        for c in (k_flat, v_flat)
    )
    o, lse = _sdpa_lse(qp.transpose(0, 1), k, v, attn_mask=mask, scale=scale)[:2]
    # The two softmax-normalized parts weighted by their sums: the own part's weight is
    # sigmoid(lse_own - lse_shared). lerp takes it in q's dtype, computes in float32 and rounds
    # once; one pass where a float32 merge made five over the (M, Hkv, Tmax x G, D) outputs.
    weight = torch.sigmoid(lse - lse_sh.transpose(0, 1))[..., None].to(q.dtype)
    merged = torch.lerp(o_sh.transpose(0, 1), o, weight)
    merged = merged.view(members, hkv, width, g, head_dim).transpose(1, 2)
    merged = merged.reshape(members * width, num_heads, head_dim)
    out.index_copy_(0, out_tok, merged if keep is None else merged.index_select(0, keep))
    return rest


def _prefill_plan(md, block_size: int, rows: list[int], g: int, dtype: torch.dtype):
    """`prefill`'s step plan, or None where no two chunks share a cached block: groups (member
    positions, the shared keys' slots), (M, Tmax), each member's query tokens (M x Tmax,
    clamped), its own keys' slots and additive causal mask (M, 1, Tmax * G, L), the valid query
    tokens' indices in the step and in the padded layout (None: all), the rows in no group."""
    if _sdpa_lse is None:
        return None
    ql = np.array(md.query_lens_cpu)[rows]
    ctx = np.array(md.context_lens_cpu)[rows]
    tables = md.block_tables[rows]
    # A chunk's cached blocks are those before its first token (`ctx - ql + 1` as the plan's
    # context: its blocks before the one that token is in).
    plan = plan_shared_prefixes(
        tables.numpy(), ctx - ql + 1, block_size, len(rows), len(rows), min_tokens=block_size
    )
    if plan is None:
        return None
    chunks, shared = plan
    members = [int(r) for c in chunks for r in c[1:] if r >= 0]
    starts = np.asarray(md.cu_seqlens_q[:-1])[rows]
    groups, at = [], 0
    for chunk in chunks:
        size, n = int((chunk[1:] >= 0).sum()), int(shared[chunk[1]])
        zero = torch.zeros(1, dtype=torch.long)
        slots = paged_slots(tables[chunk[1:2]], zero, torch.tensor([n]), n, block_size)[0]
        groups.append(((at, at + size), slots))
        at += size
    t = torch.from_numpy(ql[members]).long()
    c = torch.from_numpy(ctx[members]).long()
    first = torch.from_numpy(shared[members]).long()
    width, length = int(t.max()), int((c - first).max())
    steps = torch.arange(width)
    valid_q = steps[None, :] < t[:, None]  # (M, Tmax)
    tok = torch.from_numpy(starts[members]).long()[:, None] + torch.minimum(steps, t[:, None] - 1)
    own_slots, valid_k = paged_slots(tables[members], first, c, length, block_size)
    # query token i of a chunk sits at position ctx - t + i; own key j at position first + j
    seen = (
        first[:, None, None] + torch.arange(length)[None, None, :]
        <= (c - t)[:, None, None] + steps[None, :, None]
    )
    allowed = seen & valid_k[:, None, :] & valid_q[:, :, None]
    allowed[:, :, 0] |= ~valid_q  # padded query tokens read key 0: finite, then dropped
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    mask = mask[:, :, None, :].expand(-1, -1, g, -1).reshape(len(members), 1, width * g, length)
    keep = valid_q.flatten().nonzero().squeeze(1)
    out_tok = tok.flatten()[keep]
    if len(keep) == tok.numel():
        keep = None  # every chunk is Tmax long: no padded query token to drop
    grouped = set(members)
    rest = [r for i, r in enumerate(rows) if i not in grouped]
    return groups, tok.shape, tok.flatten(), own_slots, mask, out_tok, keep, rest


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


def _own_keys(md, block_size: int, groups, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's own keys after each row's shared ones: flat slots (B*L,) and an additive
    mask (B, 1, 1, L) of 0 / -inf in q's dtype."""
    if md.decode_cascade is None:
        ctx = torch.tensor(md.context_lens_cpu)
        first = torch.zeros(len(ctx), dtype=torch.long)
        for rows, slots in groups:
            first[rows] = len(slots)
        slots, valid = paged_slots(
            md.block_tables, first, ctx, int((ctx - first).max()), block_size
        )
        mask = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))
        md.decode_cascade = (slots, mask[:, None, None, :])
    return md.decode_cascade


def paged_slots(tables, first, ctx, length: int, block_size: int):
    """Flat cache slots (B*L,) of each row's keys first .. first + L - 1 through its block table,
    and which are valid (B, L): before ctx. Invalid ones read the row's key `first` (written, so
    finite: never-written memory may hold NaN, and 0 * NaN would poison the sum)."""
    pos = first[:, None] + torch.arange(length, device=tables.device)[None, :]  # (B, L)
    valid = pos < ctx[:, None]
    pos = torch.where(valid, pos, first[:, None])
    slots = tables.long().gather(1, pos // block_size) * block_size + pos % block_size
    return slots.flatten(), valid
