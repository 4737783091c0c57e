"""The paged decode-attention kernel (split-K over the context, verify rows, shared-prefix
cascade) and the runner's shared-prefix plans, against the torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    BF16,
    DEVICE,
    DTYPES,
    F32,
    assert_rel,
    gpu,
    needs_triton,
    paged_cache,
    poisoned,
    randn,
)

from tinyserve.kernels.decode_attention import decode_attention, decode_attention_ref
from tinyserve.kernels.prefill_attention import prefill_attention_ref
from tinyserve.kernels.shared_prefix_attention import shared_prefix_rows

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]


# (Hq, Hkv, head_dim, block_size, num_splits): GQA 1/4/8, head dims 64/128, blocks 1/16/32.
DECODE_CASES = [(4, 4, 64, 16, 1), (8, 2, 128, 1, 3), (8, 1, 64, 32, 2), (16, 2, 64, 16, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention(dtype, case):
    num_heads, num_kv_heads, head_dim, block_size, num_splits = case
    lens = [1, 37, 19]  # odd lengths; a split can be empty for the short one
    k_cache, v_cache, table, context_lens = paged_cache(
        3, lens, num_kv_heads, head_dim, block_size, dtype
    )
    q = randn(3, num_heads, head_dim, dtype=dtype)
    out = poisoned(q)
    decode_attention(q, k_cache, v_cache, table, context_lens, 0.125, out, num_splits=num_splits)
    assert_rel(out, decode_attention_ref(q, k_cache, v_cache, table, context_lens, 0.125), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("query_len", [2, 4])
def test_decode_attention_verify_rows(dtype, case, query_len):
    """A speculative verify step through the decode kernel: each sequence's last query_len
    positions attend causally (the prefill oracle); one row's context is query_len itself, and
    with 3 splits of 16-key tiles some rows see no key of the last split."""
    num_heads, num_kv_heads, head_dim, block_size, num_splits = case
    lens = [query_len, 37, 19 + query_len]
    k_cache, v_cache, table, context_lens = paged_cache(
        3, lens, num_kv_heads, head_dim, block_size, dtype
    )
    q = randn(3 * query_len, num_heads, head_dim, dtype=dtype)
    cu = torch.arange(0, 3 * query_len + 1, query_len, dtype=torch.int32, device=DEVICE)
    out = poisoned(q)
    decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        context_lens,
        0.125,
        out,
        num_splits=num_splits,
        query_len=query_len,
    )
    want = prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 0.125)
    assert_rel(out, want, dtype)


@pytest.mark.parametrize("query_len", [1, 2])
@pytest.mark.parametrize("min_split_len", [0, 64])
def test_decode_attention_long_row_beside_short_ones(query_len, min_split_len):
    """A long row beside short ones in 16 splits: with a 64-key floor on the split length the
    long row uses 5 splits and each short row only its first (the empty ones write no partial
    output, only an lse of -inf, and the merge skips them); without it every row is cut in 16."""
    lens = [3 + query_len, 300, 9, query_len]
    k_cache, v_cache, table, context_lens = paged_cache(4, lens, 2, 64, 16, F32)
    q = randn(4 * query_len, 4, 64)
    cu = torch.arange(0, 4 * query_len + 1, query_len, dtype=torch.int32, device=DEVICE)
    want = prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 0.125)
    out = poisoned(q)
    decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        context_lens,
        0.125,
        out,
        num_splits=16,
        min_split_len=min_split_len,
        query_len=query_len,
    )
    assert_rel(out, want, F32)
    with pytest.raises(ValueError, match="multiple of the key tile"):
        decode_attention(
            q,
            k_cache,
            v_cache,
            table,
            context_lens,
            0.125,
            num_splits=16,
            min_split_len=24,
            query_len=query_len,
        )


@pytest.mark.parametrize("min_split_len", [0, 64])
def test_decode_attention_split_floor_leaves_short_rows_one_split(monkeypatch, min_split_len):
    """Which splits hold keys, seen in the partial outputs (allocated NaN here): with a 64-key
    floor the 300-key row writes 5 of its 16 splits and the 9-key row 1; without it 10 and 1.
    Empty splits write no partial output, and the merge does not read them (the output has
    no NaN)."""
    parts = []
    empty = torch.empty

    def poisoned_empty(*shape, **kw):
        t = empty(*shape, **kw)
        if len(shape) == 4 and kw.get("dtype") == torch.float32:  # part (T, Hq, S, D)
            t.fill_(float("nan"))
            parts.append(t)
        return t

    lens = [9, 300]
    k_cache, v_cache, table, context_lens = paged_cache(2, lens, 2, 64, 16, F32)
    q = randn(2, 4, 64)
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    # 16-key tiles on both devices (the GPU's default is 64: 5 splits hold keys either way)
    out = decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        context_lens,
        0.125,
        num_splits=16,
        block_n=16,
        min_split_len=min_split_len,
    )
    monkeypatch.undo()
    assert_rel(out, decode_attention_ref(q, k_cache, v_cache, table, context_lens, 0.125), F32)
    (part,) = parts
    written = (~part.isnan()).all(-1).all(1).sum(-1).tolist()  # splits written, per row
    assert written == ([1, 5] if min_split_len else [1, 10])


def shared_prefix_case(num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Six rows: rows 0, 1, 3 share their first 2 blocks (two chunks of one group), rows 2, 4
    their first block, row 5 nothing; plus an unused chunk. Returns the inputs and the chunks."""
    lens = [
        4 * block_size + 6,
        2 * block_size + 5,
        3 * block_size + 2,
        4 * block_size,
        block_size + 3,
        7,
    ]
    k_cache, v_cache, table, context_lens = paged_cache(
        6, lens, num_kv_heads, head_dim, block_size, dtype
    )
    table[1, :2] = table[3, :2] = table[0, :2]
    table[4, :1] = table[2, :1]
    r = shared_prefix_rows(num_heads, num_kv_heads)
    chunks = torch.full((4, 1 + r), -1, dtype=torch.int32, device=DEVICE)
    for c, (leader, rows) in enumerate([(0, [0, 1]), (0, [3]), (2, [4, 2])]):
        chunks[c, 0] = leader
        chunks[c, 1 : 1 + len(rows)] = torch.tensor(rows)
    skip = torch.tensor([2, 2, 1, 2, 1, 0], dtype=torch.int32, device=DEVICE) * block_size
    return k_cache, v_cache, table, context_lens, chunks, skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_attention_shared_prefix(dtype, case):
    num_heads, num_kv_heads, head_dim, block_size, num_splits = case
    k_cache, v_cache, table, lens, chunks, skip = shared_prefix_case(
        num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    q = randn(6, num_heads, head_dim, dtype=dtype)
    ref = decode_attention_ref(q, k_cache, v_cache, table, lens, 0.125)
    for shared_splits in (1, 3):
        out = poisoned(q)
        decode_attention(
            q,
            k_cache,
            v_cache,
            table,
            lens,
            0.125,
            out,
            num_splits=num_splits,
            shared_chunks=chunks,
            shared_lens=skip,
            shared_splits=shared_splits,
        )
        assert_rel(out, ref, dtype)


def test_decode_attention_shared_prefix_reads_only_the_leaders_prefix():
    """The members' own copies of the prefix blocks are never read: poisoning them changes
    nothing (the kernel reads the leader's table for the shared part)."""
    k_cache, v_cache, table, lens, chunks, skip = shared_prefix_case(4, 2, 64, 16, F32)
    q = randn(6, 4, 64)
    ref = decode_attention_ref(q, k_cache, v_cache, table, lens, 0.125)
    members = table.clone()
    spare = k_cache.shape[0] - 1  # unused, NaN-filled blocks (see paged_cache)
    unused = [b for b in range(spare, 0, -1) if b not in set(table.flatten().tolist())]
    fresh = torch.tensor(unused[:3], dtype=torch.int32, device=DEVICE)
    members[1, :2] = members[3, :2] = fresh[:2]
    members[4, :1] = fresh[2:]
    out = poisoned(q)
    decode_attention(
        q,
        k_cache,
        v_cache,
        members,
        lens,
        0.125,
        out,
        num_splits=2,
        shared_chunks=chunks,
        shared_lens=skip,
    )
    assert_rel(out, ref, F32)


def test_plan_shared_prefixes_groups_rows_by_their_first_block():
    import numpy as np

    from tinyserve.runner.graphs import plan_shared_prefixes

    bs = 16
    tables = np.array(
        [
            [7, 8, 9, 10, 30],  # leader of group 7: 3 blocks shared by all its members
            [5, 40, 0, 0, 0],  # group 5: one block in common only (< 128 tokens): not kept
            [7, 8, 9, 11, 0],
            [5, 41, 0, 0, 0],
            [3, 50, 0, 0, 0],  # alone
            [7, 8, 9, 10, 12],  # 4 blocks in common with the leader: the group takes the fewest
            [7, 8, 9, 10, 0],  # its 4th block is the one it writes now: not shared
        ],
        dtype=np.int32,
    )
    ctx = np.array([5 * bs, 30, 4 * bs - 3, 20, 20, 5 * bs, 3 * bs + 1], dtype=np.int32)
    chunks, lens = plan_shared_prefixes(
        tables, ctx, bs, rows_per_chunk=3, max_chunks=8, min_tokens=3 * bs
    )
    assert lens.tolist() == [48, 0, 48, 0, 0, 48, 48]
    assert chunks.tolist() == [[0, 0, 2, 5], [0, 6, -1, -1]]
    # no room for the group's two chunks: nothing to share
    assert plan_shared_prefixes(tables, ctx, bs, 3, max_chunks=1, min_tokens=3 * bs) is None
    # a fourth block in common: the plan shares 3, row 6 would need its written block
    tables[6, 3], ctx[6] = 99, 6 * bs
    assert plan_shared_prefixes(tables, ctx, bs, 3, 8, 3 * bs)[1].tolist()[6] == 48
    # too little saved against the step's reads: no plan
    assert plan_shared_prefixes(tables, ctx * 100, bs, 3, 8, 3 * bs) is None


def test_plan_shared_prefixes_sees_past_a_common_header():
    """Every row starts with the same block (a chat template's header), then two system prompts
    of 4 blocks each: two groups sharing 5 blocks, not one group sharing 1 (which would fall
    under the minimum and share nothing)."""
    import numpy as np

    from tinyserve.runner.graphs import plan_shared_prefixes

    header, a, b = [3], [10, 11, 12, 13], [20, 21, 22, 23]
    tables = np.array([header + (a if i % 2 else b) + [100 + i] for i in range(8)], np.int32)
    ctx = np.full(8, 5 * 16 + 4, dtype=np.int32)
    chunks, lens = plan_shared_prefixes(
        tables, ctx, 16, rows_per_chunk=4, max_chunks=4, min_tokens=64
    )
    assert lens.tolist() == [80] * 8
    assert sorted(c[1:].tolist() for c in chunks) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_a_plan_of_pool_tables_gives_the_plain_attention():
    """Tables of a real block pool with prefix-cache hits (two prompts each shared by three
    sequences), planned and attended by the cascade kernel = the reference."""
    import numpy as np

    from tinyserve.core.block_pool import BlockPool
    from tinyserve.core.sequence import Sequence
    from tinyserve.runner.graphs import plan_shared_prefixes
    from tinyserve.sampling_params import SamplingParams

    bs, heads, kv_heads, dim = 4, 4, 2, 16
    pool = BlockPool(64, bs, enable_prefix_caching=True)
    systems = [list(range(100, 113)), list(range(200, 211))]
    seqs = []
    for i in range(6):
        ids = systems[i % 2] + [300 + i] * (1 + i)
        seq = Sequence(i, str(i), 0, ids, len(ids), SamplingParams(), 0, 16, 1 << 20)
        pool.match_prefix(seq)
        pool.may_append(seq, seq.num_tokens - seq.num_kv_computed)
        seq.num_kv_computed = seq.num_tokens
        pool.commit(seq)
        seqs.append(seq)
    width = max(len(s.block_table) for s in seqs)
    tables = np.zeros((6, width), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.block_table
    ctx = np.array([s.num_tokens for s in seqs], dtype=np.int32)
    r = shared_prefix_rows(heads, kv_heads)
    chunks, lens = plan_shared_prefixes(tables, ctx, bs, r, max_chunks=3, min_tokens=bs)
    assert lens.tolist() == [12, 8, 12, 8, 12, 8]  # whole blocks only
    shape = (64, bs, kv_heads, dim)
    k_cache, v_cache, q = randn(*shape), randn(*shape), randn(6, heads, dim)
    table_t = torch.from_numpy(tables).to(DEVICE)
    lens_t = torch.from_numpy(ctx).to(DEVICE)
    out = poisoned(q)
    decode_attention(
        q,
        k_cache,
        v_cache,
        table_t,
        lens_t,
        0.2,
        out,
        shared_chunks=torch.from_numpy(chunks).to(DEVICE),
        shared_lens=torch.from_numpy(lens).to(DEVICE),
    )
    assert_rel(out, decode_attention_ref(q, k_cache, v_cache, table_t, lens_t, 0.2), F32)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("num_heads", "block_size"), [(32, 16), (16, 16), (32, 32), (8, 1)])
def test_decode_attention_gpu(num_heads, block_size):
    lens = [4096, 1, 17, 2500, 777, 4000, 129, 3333] * 4  # 32 sequences, llama-8b / qwen3 GQA
    k_cache, v_cache, table, context_lens = paged_cache(32, lens, 8, 128, block_size, BF16)
    q = randn(32, num_heads, 128, dtype=BF16)
    ref = decode_attention_ref(q, k_cache, v_cache, table, context_lens, 128**-0.5)
    for splits in (None, 1, 7):
        out = poisoned(q)
        decode_attention(
            q, k_cache, v_cache, table, context_lens, 128**-0.5, out, num_splits=splits
        )
        assert_rel(out, ref, BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_heads", [16, 32])
def test_shared_prefix_decode_attention_gpu(num_heads):
    """64 rows in 4 groups of 16 sharing 2,048 tokens (qwen3-0.6b / llama-8b GQA), planned."""
    import numpy as np

    from tinyserve.runner.graphs import plan_shared_prefixes

    lens = [2048 + 1 + (37 * i) % 300 for i in range(64)]
    k_cache, v_cache, table, context_lens = paged_cache(64, lens, 8, 128, 16, BF16)
    for i in range(64):
        table[i, :128] = table[i % 4, :128]
    q = randn(64, num_heads, 128, dtype=BF16)
    ref = decode_attention_ref(q, k_cache, v_cache, table, context_lens, 128**-0.5)
    chunks, skip = plan_shared_prefixes(
        table.cpu().numpy(), np.array(lens), 16, shared_prefix_rows(num_heads, 8), 32
    )
    assert skip.tolist() == [2048] * 64
    for splits in (1, 2):
        out = poisoned(q)
        decode_attention(
            q,
            k_cache,
            v_cache,
            table,
            context_lens,
            128**-0.5,
            out,
            num_splits=splits,
            shared_chunks=torch.from_numpy(chunks).cuda(),
            shared_lens=torch.from_numpy(skip).cuda(),
        )
        assert_rel(out, ref, BF16)
