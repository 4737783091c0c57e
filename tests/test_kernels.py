"""Each Triton kernel against its pure-torch reference on random inputs, output poisoned first.

On CPU the kernels run under TRITON_INTERPRET=1 at small shapes (bf16 casts there truncate and
bf16 dots are upcast, so bf16 tolerances allow an ulp); with CUDA the same tests run on the GPU,
and the `gpu`-marked ones add real model shapes (`make test-gpu`).
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # before the kernels import triton.jit
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tinyserve.kernels.gemv_config as gemv_config  # noqa: E402
from tinyserve.kernels._common import is_interpreter, next_pow2  # noqa: E402
from tinyserve.kernels.decode_attention import (  # noqa: E402
    decode_attention,
    decode_attention_ref,
)
from tinyserve.kernels.gemv import SplitSum, gemv, gemv_ref  # noqa: E402
from tinyserve.kernels.gemv_config import (  # noqa: E402
    dot_config,
    gemv_method,
    silu_mul_epilogue,
    split_config,
    stream_config,
    stream_stages,
)
from tinyserve.kernels.mtp_input import mtp_input, mtp_input_ref  # noqa: E402
from tinyserve.kernels.prefill_attention import (  # noqa: E402
    prefill_attention,
    prefill_attention_ref,
)
from tinyserve.kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from tinyserve.kernels.rope_store_kv import rope_store_kv, rope_store_kv_ref  # noqa: E402
from tinyserve.kernels.rotary import rotary_embedding, rotary_embedding_ref  # noqa: E402
from tinyserve.kernels.sampling import (  # noqa: E402
    argmax,
    counter_uniform,
    sample_race,
    sample_race_ref,
)
from tinyserve.kernels.shared_prefix_attention import shared_prefix_rows  # noqa: E402
from tinyserve.kernels.silu_mul import silu_mul, silu_mul_ref  # noqa: E402
from tinyserve.kernels.spec_accept import accept_drafts, accept_drafts_ref  # noqa: E402
from tinyserve.kernels.spec_shift import spec_shift, spec_shift_ref  # noqa: E402

INTERP = is_interpreter()
DEVICE = "cpu" if INTERP else "cuda"
pytestmark = pytest.mark.skipif(not (INTERP or HAS_CUDA), reason="needs CUDA or the interpreter")
gpu = pytest.mark.skipif(not HAS_CUDA or INTERP, reason="needs CUDA (interpreter off)")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = [F32, BF16, F16]
# Relative L2 error bounds for whole-op outputs, and (rtol, atol) for elementwise ops.
REL = {F32: 1e-5, BF16: 1.6e-2, F16: 2e-3}
ELEM = {F32: (1e-5, 1e-5), BF16: (1.6e-2, 1e-2), F16: (2e-3, 1e-3)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randn(*shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def assert_rel(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < REL[dtype], f"relative error {err:.2e} >= {REL[dtype]:.0e}"


def assert_elem(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    rtol, atol = ELEM[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


def paged_cache(batch, context_lens, num_kv_heads, head_dim, block_size, dtype):
    """Random caches with blocks scattered in a shuffled pool; block 0 (the table padding), the
    unused blocks and the slots past each context hold NaN, so any invalid read shows."""
    per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    ids = torch.randperm(num_blocks - 1, device=DEVICE).int() + 1
    table = torch.zeros(batch, max(per_seq), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, (n, nb) in enumerate(zip(context_lens, per_seq, strict=True)):
        blocks = ids[start : start + nb]
        start += nb
        table[b, :nb] = blocks
        valid[blocks] = True
        valid[blocks[-1], n - (nb - 1) * block_size :] = False  # the tail of the last block
    k_cache[~valid] = float("nan")
    v_cache[~valid] = float("nan")
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, table, lens


# --------------------------------------------------------------------------- attention

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


# (Hq, Hkv, head_dim, block_size): decode rows, a prefill with a cached prefix, a fresh prompt.
PREFILL_CASES = [(4, 4, 64, 16), (8, 2, 128, 1), (8, 1, 64, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention_mixed_batch(dtype, case):
    num_heads, num_kv_heads, head_dim, block_size = case
    query_lens, lens = [1, 21, 5, 1], [9, 33, 5, 1]  # decode, extend, prompt, first token
    k_cache, v_cache, table, context_lens = paged_cache(
        4, lens, num_kv_heads, head_dim, block_size, dtype
    )
    cu = torch.tensor([0, 1, 22, 27, 28], dtype=torch.int32, device=DEVICE)
    q = randn(28, num_heads, head_dim, dtype=dtype)
    out = poisoned(q)
    prefill_attention(q, k_cache, v_cache, table, cu, context_lens, max(query_lens), 0.1, out)
    ref = prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 0.1)
    assert_rel(out, ref, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_prefill_attention_key_splits(dtype, num_splits):
    """Key splits merge to the one-pass result: splits that end inside the causal (masked) part,
    splits a row sees no key of, empty splits of short rows, and rows past the last sequence
    (zeroed)."""
    query_lens, lens = [1, 40, 3, 6], [70, 100, 3, 6]  # decode, extend, prompt, short prompt
    k_cache, v_cache, table, context_lens = paged_cache(4, lens, 2, 64, 16, dtype)
    cu = torch.tensor([0, 1, 41, 44, 50], dtype=torch.int32, device=DEVICE)
    q = randn(52, 8, 64, dtype=dtype)  # two rows past cu[-1]
    out = poisoned(q)
    prefill_attention(
        q,
        k_cache,
        v_cache,
        table,
        cu,
        context_lens,
        max(query_lens),
        0.1,
        out,
        num_splits=num_splits,
    )
    ref = prefill_attention_ref(q[:50], k_cache, v_cache, table, cu, context_lens, 0.1)
    assert_rel(out[:50], ref, dtype)
    assert torch.equal(out[50:], torch.zeros_like(out[50:]))


def test_prefill_num_splits_fills_the_sms_once_for_long_lone_tiles(monkeypatch):
    from tinyserve.kernels import prefill_attention as pa

    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    monkeypatch.setattr(pa, "shared_memory", lambda device: 232448)  # an H100's
    cuda = torch.device("cuda")
    # 64 decode rows + a 48-token chunk at 32k keys (qwen3-0.6b heads; 64 x 64 tiles of 32
    # queries, two programs an SM): 16 long programs, cut 10 ways (264 programs at most)
    assert pa.prefill_num_splits([1] * 64 + [48], [600] * 64 + [32768], 16, 8, cuda) == 10
    # a 448-token chunk at 32k: 112 long programs, fewer splits
    assert pa.prefill_num_splits([1] * 64 + [448], [600] * 64 + [32768], 16, 8, cuda) == 2
    # one chunk, llama-3.1-8b heads: the counts the H100 sweep found best for each tile
    assert pa.prefill_num_splits([128], [32768], 32, 8, cuda) == 4  # 64 x 64: 64 tiles
    assert pa.prefill_num_splits([256], [32768], 32, 8, cuda) == 2  # 128 x 128: 64 tiles
    assert pa.prefill_num_splits([512], [32768], 32, 8, cuda) == 1  # 128 tiles, one an SM
    # short contexts never split, nor a tile set that fills the GPU, nor the CPU
    assert pa.prefill_num_splits([48], [1500], 16, 8, cuda) == 1
    assert pa.prefill_num_splits([8192], [8192], 16, 8, cuda) == 1
    assert pa.prefill_num_splits([48], [32768], 16, 8, torch.device("cpu")) == 1


def test_prefill_tile_is_tall_only_for_one_long_chunk_that_fits():
    from tinyserve.kernels.prefill_attention import prefill_tile

    h100, small = 232448, 101376  # bytes of shared memory a program may opt into
    assert prefill_tile(1, 4096 * 2, torch.bfloat16, h100) == (128, 128, 8, 3)  # the lane's
    assert prefill_tile(1, 448 * 2, torch.bfloat16, h100) == (128, 128, 8, 3)
    assert prefill_tile(1, 895, torch.bfloat16, h100) == (64, 64, 4, 3)  # a short chunk
    assert prefill_tile(65, 8192, torch.bfloat16, h100) == (64, 64, 4, 3)  # decode rows too
    assert prefill_tile(1, 8192, torch.float32, h100) == (64, 64, 4, 2)  # no room: 2 stages
    assert prefill_tile(1, 8192, torch.bfloat16, small) == (64, 64, 4, 3)


def test_prefill_tiles_lists_every_tile_a_launch_can_take(monkeypatch):
    from tinyserve.kernels import prefill_attention as pa

    cuda = torch.device("cuda")
    monkeypatch.setattr(pa, "shared_memory", lambda device: 232448)
    assert pa.prefill_tiles(torch.bfloat16, cuda) == {(64, 64, 4, 3), (128, 128, 8, 3)}
    assert pa.prefill_tiles(torch.float32, cuda) == {(64, 64, 4, 2)}
    monkeypatch.setattr(pa, "shared_memory", lambda device: 101376)
    assert pa.prefill_tiles(torch.bfloat16, cuda) == {(64, 64, 4, 3)}


def test_attention_match_layer_references():
    """The kernels' oracles and the layers' torch path agree (same head mapping, same mask)."""
    from tinyserve.model.layers.attention import AttentionMetadata
    from tinyserve.model.layers.attention import decode_attention_ref as layer_decode
    from tinyserve.model.layers.attention import prefill_attention_ref as layer_prefill

    lens, query_lens = [7, 30], [1, 12]
    k_cache, v_cache, table, context_lens = paged_cache(2, lens, 2, 64, 16, F32)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    md = AttentionMetadata(
        slot_mapping=torch.zeros(13, dtype=torch.int64, device=DEVICE),
        block_tables=table,
        cu_seqlens_q=torch.tensor([0, 1, 13], dtype=torch.int32, device=DEVICE),
        context_lens=context_lens,
        query_lens_cpu=query_lens,
        context_lens_cpu=lens,
        max_context_len=max(lens),
        is_decode_only=False,
    )
    q = randn(13, 8, 64)
    out = prefill_attention(q, k_cache, v_cache, table, md.cu_seqlens_q, context_lens, 12, 0.1)
    assert_rel(out, layer_prefill(q, k_cache, v_cache, md, 0.1), F32)
    qd = randn(2, 8, 64)
    out = decode_attention(qd, k_cache, v_cache, table, context_lens, 0.1)
    assert_rel(out, layer_decode(qd, k_cache, v_cache, md, 0.1), F32)


def _layer_forward_recording_decode(monkeypatch, md, positions, k_cache, v_cache):
    """The Triton attention layer (8 query heads, 2 kv heads of 64) over random qkv at
    `positions` under metadata md: (output, qkv, keyword arguments of each decode-kernel call)."""
    from types import SimpleNamespace

    from tinyserve.model.layers import attention as layer

    rope = SimpleNamespace(
        positions=torch.tensor(positions, device=DEVICE), cos_sin_cache=randn(128, 64)
    )
    attn = layer.Attention(num_heads=8, head_dim=64, scale=0.1, num_kv_heads=2)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    calls, kernel = [], layer.decode_attention
    monkeypatch.setattr(
        layer, "decode_attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw)
    )
    qkv = randn(len(positions), (8 + 2 * 2) * 64)
    with layer.forward_context(md):
        out = attn._forward_triton(qkv, rope, None, None)
    return out, qkv, calls


def test_attention_layer_hands_the_step_split_plan_to_the_kernel(monkeypatch):
    """A decode step's split count, key tile and split floor (graph_shapes.decode_num_splits and
    decode_tiling, in the metadata) reach the Triton decode kernel through the layer, with the
    oracle's output."""

    from tinyserve.model.layers import attention as layer

    lens, block_size = [40, 70], 16
    k_cache, v_cache, table, context_lens = paged_cache(2, lens, 2, 64, block_size, F32)
    last = [n - 1 for n in lens]
    slots = [
        int(table[b, p // block_size]) * block_size + p % block_size for b, p in enumerate(last)
    ]
    md = layer.AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=table,
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
        context_lens=context_lens,
        query_lens_cpu=[1, 1],
        context_lens_cpu=lens,
        max_context_len=max(lens),
        is_decode_only=True,
        num_splits=4,
        decode_block_n=32,
        decode_min_split=64,
    )
    out, qkv, calls = _layer_forward_recording_decode(monkeypatch, md, last, k_cache, v_cache)
    assert [(c["num_splits"], c["block_n"]) for c in calls] == [(4, 32)]
    assert calls[0]["min_split_len"] == 64  # graph_shapes.decode_tiling's floor, too
    q = qkv[:, : 8 * 64].view(2, 8, 64)  # rotated in place by the layer
    assert_rel(out, decode_attention_ref(q, k_cache, v_cache, table, context_lens, 0.1), F32)


def test_mixed_step_hands_the_decode_rows_split_plan_to_the_kernel(monkeypatch):
    """A mixed step (decode rows, then one prompt chunk): the decode rows' split count, key
    tile and split floor reach the decode kernel, and the outputs are the oracle's."""

    from tinyserve.model.layers import attention as layer

    lens, block_size, chunk = [40, 70, 20], 16, 3
    k_cache, v_cache, table, context_lens = paged_cache(3, lens, 2, 64, block_size, F32)
    pos = [39, 69, *range(20 - chunk, 20)]
    rows = [0, 1] + [2] * chunk
    slots = [
        int(table[b, p // block_size]) * block_size + p % block_size for b, p in zip(rows, pos)
    ]
    cu = torch.tensor([0, 1, 2, 2 + chunk], dtype=torch.int32, device=DEVICE)
    md = layer.AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=table,
        cu_seqlens_q=cu,
        context_lens=context_lens,
        query_lens_cpu=[1, 1, chunk],
        context_lens_cpu=lens,
        max_context_len=0,
        is_decode_only=False,
        num_splits=4,
        decode_block_n=32,
        decode_min_split=64,
        chunk=(2, torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE)),
    )
    out, qkv, calls = _layer_forward_recording_decode(monkeypatch, md, pos, k_cache, v_cache)
    assert [(c["num_splits"], c["block_n"], c["min_split_len"]) for c in calls] == [(4, 32, 64)]
    q = qkv[:, : 8 * 64].view(2 + chunk, 8, 64)  # rotated in place by the layer
    assert_rel(out, prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 0.1), F32)


# --------------------------------------------------------------------------- small ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    x, weight = randn(7, 300, dtype=dtype, scale=3.0), randn(300, dtype=dtype)
    residual = randn(7, 300, dtype=dtype) if with_residual else None
    out = poisoned(x)
    res = rms_norm(x, weight, 1e-6, residual, out=out)
    ref = rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        assert_elem(res[1], ref[1], dtype)
        if not INTERP or dtype != BF16:  # the interpreter truncates bf16 casts
            assert torch.equal(res[1], ref[1])  # the residual stream is bit exact
        res, ref = res[0], ref[0]
    assert res is out
    assert_elem(out, ref, dtype)


def test_rms_norm_per_head_strided_in_place():
    """Qwen3 q-norm: (T, H, D) view of a packed qkv; residual updated in place."""
    qkv = randn(5, 6 * 64, dtype=BF16)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    weight = randn(64, dtype=BF16)
    assert_elem(rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6), BF16)
    x, residual = randn(3, 128, dtype=BF16), randn(3, 128, dtype=BF16)
    ones = torch.ones(128, dtype=BF16, device=DEVICE)
    expected = rms_norm_ref(x, ones, 1e-5, residual)
    out, res = rms_norm(x, ones, 1e-5, residual, out=x, residual_out=residual)
    assert out is x and res is residual
    assert_elem(x, expected[0], BF16)
    assert_elem(residual, expected[1], BF16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_first", [True, False])
def test_mtp_input(dtype, hidden_first):
    """cat[norm(hidden), norm(embed[ids])] with position-0 rows' embedding zeroed (its half
    all zero), the halves in either order, hidden a strided view, into a poisoned out."""
    n = 300  # not a power of two: masked columns
    hidden = randn(6, n + 20, dtype=dtype, scale=3.0)[:, :n]
    ids = torch.tensor([3, 0, 9, 3, 1, 7], device=DEVICE)
    positions = torch.tensor([5, 0, 17, 1, 0, 2], device=DEVICE)
    embed, hw, tw = randn(10, n, dtype=dtype), randn(n, dtype=dtype), randn(n, dtype=dtype)
    out = torch.full((6, 2 * n), float("nan"), dtype=dtype, device=DEVICE)
    res = mtp_input(hidden, ids, positions, embed, hw, tw, 1e-6, hidden_first, out=out)
    assert res is out
    assert_elem(
        out, mtp_input_ref(hidden, ids, positions, embed, hw, tw, 1e-6, hidden_first), dtype
    )
    token_half = out[:, n:] if hidden_first else out[:, :n]
    assert (token_half[positions == 0] == 0).all() and (token_half[positions != 0] != 0).any()


def test_mtp_input_rejects_bad_inputs():
    h, w = randn(2, 8, dtype=BF16), randn(8, dtype=BF16)
    ids = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        mtp_input(h, ids, ids, randn(4, 8), w, w, 1e-6)
    with pytest.raises(ValueError, match="ids, positions"):
        mtp_input(h, ids[:1], ids, randn(4, 8, dtype=BF16), w, w, 1e-6)


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_rms_norm_rows_per_program(rows):
    x, r, w = randn(13, 64, dtype=BF16), randn(13, 64, dtype=BF16), randn(64, dtype=BF16)
    out, res = rms_norm(x, w, 1e-6, r, block_m=rows, num_warps=2)
    ref, ref_res = rms_norm_ref(x, w, 1e-6, r)
    assert_elem(out, ref, BF16)
    assert_elem(res, ref_res, BF16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [True, False])
def test_rotary(dtype, inplace):
    qkv = randn(9, (8 + 2 * 2) * 64, dtype=dtype)
    q = qkv[:, : 8 * 64].view(9, 8, 64)
    k = qkv[:, 8 * 64 : 10 * 64].view(9, 2, 64)
    angles = torch.arange(40, device=DEVICE)[:, None] * torch.rand(32, device=DEVICE)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # (P, D) float32
    positions = torch.randint(0, 40, (9,), device=DEVICE)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)
    q_before = q.clone()
    v_before = qkv[:, 10 * 64 :].clone()
    q_out, k_out = rotary_embedding(positions, q, k, cache, inplace=inplace)
    assert (q_out is q) == inplace and (k_out is k) == inplace
    assert_elem(q_out, q_ref, dtype)
    assert_elem(k_out, k_ref, dtype)
    assert torch.equal(qkv[:, 10 * 64 :], v_before)  # v untouched
    q_only, none = rotary_embedding(positions, q_before, None, cache)  # no k
    assert none is None
    assert_elem(q_only, q_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 64), (6, 2, 128)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kv(dtype, num_heads, num_kv_heads, head_dim, qk_norm):
    """Fused q/k norm + rotary + KV store == the unfused ops; padded tokens (slot -1) store
    nothing, every other cache slot keeps its value."""
    tokens, block_size = 7, 16
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=2.0)
    positions = torch.tensor([0, 5, 17, 100, 3, 64, 9], device=DEVICE)
    cache = randn(128, head_dim)  # any float32 table: the kernel only looks it up
    slots = torch.tensor([3, 40, -1, 17, 63, 0, -1], device=DEVICE)
    norms = (randn(head_dim, dtype=dtype), randn(head_dim, dtype=dtype)) if qk_norm else (None,) * 2
    caches = [randn(4, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q_ref = rope_store_kv_ref(
        qkv.clone(), positions, cache, *ref_caches, slots, num_heads, *norms, eps=1e-6
    )
    q = rope_store_kv(qkv, positions, cache, *caches, slots.int(), num_heads, *norms, eps=1e-6)
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place
    # Relative to the norm: the interpreter truncates each of the 16-bit roundings.
    assert_rel(q, q_ref, dtype)
    assert_rel(caches[0], ref_caches[0], dtype)
    assert torch.equal(caches[1], ref_caches[1])  # v is copied, never rounded


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = randn(5, 2 * 1100, dtype=dtype, scale=3.0)  # I = 1100: two column blocks, one partial
    out = poisoned(x[:, :1100].contiguous())
    assert silu_mul(x, out) is out
    assert_elem(out, silu_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "method"),
    [
        (1, None),
        (2, None),
        (3, None),
        (3, "stream"),
        (16, None),
        (17, None),
        (32, "dot"),
        (48, "dot"),
    ],
)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("k", [1000, 100])
def test_gemv(dtype, m, method, out_dtype, k):
    """out_dtype float32: the accumulator itself (the LM head's logits), rounded only once. Odd
    sizes: a partial row tile, and K in 8 tiles (the last partial) or in one partial tile; 17
    rows pad x to the dot kernel's 32-row tile, 32 fill it."""
    n = 37
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype or dtype, device=DEVICE)
    assert gemv(x, w, out, method=method, block_k=128) is out
    assert_rel(out, gemv_ref(x.double(), w.double()), out_dtype or dtype)


@pytest.mark.parametrize(("n", "k"), [(100, 128), (90, 100)])
@pytest.mark.parametrize("m", [2, 20])
def test_gemv_balanced_rows(m, n, k):
    """The dot kernel over runs of 20 W rows in 32-row tiles (12 masked off): every run, the last
    one short at N = 90, K in whole or partial tiles; nothing written past a run's end."""
    x, w = randn(m, k, dtype=torch.float32), randn(n, k, dtype=torch.float32)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEVICE)
    assert gemv(x, w, out, method="dot", block_n=32, block_k=64, rows=20) is out
    assert_rel(out, gemv_ref(x.double(), w.double()), torch.float32)
    with pytest.raises(ValueError, match="rows must be 1..32"):
        gemv(x, w, method="dot", block_n=32, rows=33)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 20])
@pytest.mark.parametrize(("k", "rows"), [(1000, None), (100, 20), (128, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_silu_mul(dtype, m, k, rows, bias):
    """The dot kernel's gate_up epilogue: W = [gate; up] (74 x K) -> silu(gate) * up (M x 37),
    each factor rounded in dtype as the unfused projections and SiLU kernel are; programs of 16
    gate + 16 up rows in a 32-row tile, of 10 + 10 (20 rows: the rest masked off, the last run
    short), and of the whole tile (32 rows); K in partial or whole tiles."""
    n = 37
    x, w = randn(m, k, dtype=dtype), randn(2 * n, k, dtype=dtype, scale=3.0)
    b = randn(2 * n, dtype=dtype) if bias else None
    out = poisoned(torch.empty(m, n, dtype=dtype, device=DEVICE))
    got = gemv(x, w, out, bias=b, silu_mul=True, method="dot", block_n=32, block_k=64, rows=rows)
    assert got is out
    gate_up = gemv_ref(x.double(), w.double(), bias=None if b is None else b.double())
    assert_rel(out, silu_mul_ref(gate_up.to(dtype)).double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, 48])
@pytest.mark.parametrize(
    ("silu_mul", "bias", "out_dtype"),
    [
        (False, False, None),
        (False, True, torch.float32),
        (True, False, None),
        (True, True, None),
    ],
)
def test_gemv_tma(dtype, m, silu_mul, bias, out_dtype):
    """The tma kernel (tensor-descriptor loads): N = 37 in 16-column programs (the last one
    partial: its gate tile runs into the up rows, which must not reach y), K = 1000 in 64-wide
    steps (the last partial, zero-filled), x's rows padded to 16 / 64; with and without the
    SiLU epilogue and a bias, bf16 / fp16 / float32, float32 out (the LM head's)."""
    n, k = 37, 1000
    x = randn(m, k, dtype=dtype)
    w = randn(2 * n if silu_mul else n, k, dtype=dtype, scale=3.0 if silu_mul else 1.0)
    b = randn(w.shape[0], dtype=dtype) if bias else None
    out = poisoned(torch.empty(m, n, dtype=out_dtype or dtype, device=DEVICE))
    got = gemv(x, w, out, bias=b, silu_mul=silu_mul, method="tma", block_n=16, block_k=64)
    assert got is out
    ref = gemv_ref(x.double(), w.double(), bias=None if b is None else b.double())
    if silu_mul:
        ref = silu_mul_ref(ref.to(dtype)).double()
    assert_rel(out, ref, out_dtype or dtype)


def test_gemv_tma_rejects_unaligned_rows():
    x, w = randn(40, 100, dtype=torch.bfloat16), randn(8, 100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):  # 200-byte rows
        gemv(x, w, method="tma")


def test_gemv_silu_mul_rejects_bad_inputs():
    x, w = randn(3, 64), randn(8, 64)
    with pytest.raises(ValueError, match="dot and tma kernels' epilogue"):
        gemv(x, w, silu_mul=True, method="stream")
    with pytest.raises(ValueError, match="gate; up"):
        gemv(x, randn(7, 64), silu_mul=True, method="dot")
    with pytest.raises(ValueError, match="rows must be even"):
        gemv(x, w, silu_mul=True, method="dot", block_n=16, rows=5)
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, torch.empty(3, 8, device=DEVICE), silu_mul=True, method="dot")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "method"), [(1, "stream"), (3, "dot"), (20, "dot")])
def test_gemv_bias(dtype, m, method):
    """Both kernels add a bias (Qwen2 / MiMo qkv) in float32 before the one rounding."""
    n, k = 37, 300
    x, w, bias = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype), randn(n, dtype=dtype)
    out = poisoned(torch.empty(m, n, dtype=dtype, device=DEVICE))
    assert gemv(x, w, out, bias=bias, method=method, block_k=128) is out
    assert_rel(out, gemv_ref(x.double(), w.double(), bias=bias.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "k", "num_splits"), [(33, 1000, None), (100, 300, 3), (128, 1000, 1)]
)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_gemv_split(dtype, m, k, num_splits, out_dtype):
    """Split-K: float32 partials over whole K tiles (the last split ends in a partial tile at
    K = 300 and 1000), summed with the bias once; 33 rows pad x to 64, 100 to 128."""
    n = 37
    x, w, bias = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype), randn(n, dtype=dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype or dtype, device=DEVICE)
    assert gemv(x, w, out, bias=bias, method="split", block_k=128, num_splits=num_splits) is out
    assert_rel(out, gemv_ref(x.double(), w.double(), bias=bias.double()), out_dtype or dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_sums_in_the_norm_equal_the_reduce_kernels(dtype, bias):
    """A split-K product left unsummed (reduce=False) and normed with a residual gives the bits
    of the reduce kernel's sum normed after it, in place too (a decoder layer's o / down
    projection and the next norm); its reduce(residual) gives the bits of that sum + residual
    (the model's last add)."""
    m, n, k = 40, 300, 1000
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    product = gemv(x, w, bias=b, method="split", block_k=128, num_splits=3, reduce=False)
    assert isinstance(product, SplitSum)
    assert product.shape == (m, n) and product.partials.shape == (3, m, n)
    summed = gemv(x, w, bias=b, method="split", block_k=128, num_splits=3)
    assert torch.equal(product.reduce(), summed)
    residual, nw = randn(m, n, dtype=dtype, scale=2.0), randn(n, dtype=dtype)
    want, want_res = rms_norm(summed, nw, 1e-6, residual)
    got, got_res = rms_norm(product, nw, 1e-6, residual)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    assert torch.equal(product.reduce(residual), want_res)
    in_place = residual.clone()
    got, got_res = rms_norm(product, nw, 1e-6, in_place, residual_out=in_place)
    assert got_res is in_place and torch.equal(in_place, want_res) and torch.equal(got, want)


def test_split_k_sums_reject_bad_calls():
    x, w = randn(40, 256, dtype=BF16), randn(64, 256, dtype=BF16)
    product = gemv(x, w, method="split", reduce=False)
    with pytest.raises(ValueError, match="with a residual"):
        rms_norm(product, randn(64, dtype=BF16), 1e-6)
    with pytest.raises(ValueError, match="residual != x"):
        rms_norm(product, randn(64, dtype=BF16), 1e-6, randn(40, 64, dtype=F16))
    with pytest.raises(ValueError, match="reduce=False"):
        gemv(x, w, method="dot", reduce=False)
    with pytest.raises(ValueError, match="reduce=False"):
        gemv(x, w, torch.empty(40, 64, dtype=BF16), method="split", reduce=False)


def test_gated_down_projection_leaves_split_k_sums_to_the_next_norm(monkeypatch):
    """Where gate_up takes no SiLU epilogue (65-128 rows: cuBLAS) and the down projection runs
    split-K, `gated` hands the partials on unsummed, as `unreduced` does: the next norm sums
    them, with the reduce kernel's bits."""
    from tinyserve.model.layers.linear import Linear

    m, inter, hidden = 3, 256, 64
    down = Linear(inter, hidden).to(DEVICE, BF16)
    down.weight.data.copy_(randn(hidden, inter, dtype=BF16))
    monkeypatch.setattr(Linear, "_gemv_method", lambda self, x: "split")
    gate_up = randn(m, 2 * inter, dtype=BF16)
    product = down.gated(gate_up)
    assert isinstance(product, SplitSum)
    act = gemv_ref(gate_up, torch.eye(inter, dtype=BF16, device=DEVICE), gated=True)
    assert torch.equal(product.reduce(), gemv(act, down.weight, method="split"))
    assert_rel(product.reduce(), gemv_ref(act.double(), down.weight.double()), BF16)


def test_gemv_method_and_dot_config(monkeypatch):
    """One row streams; two rows stream only W with N <= K (attention out, down) and a 7-8B
    model's qkv (K >= 4096, N < WIDE_N); the rest up to 32 rows take the dot kernel, and above
    cuBLAS, but for wide W, a 7-8B model's attention and down projections. The dot tile is the
    widest that gives every other SM a program, with as many stages as shared memory holds (at
    most 5), or more where a program would not hold its SM alone."""
    monkeypatch.setattr(gemv_config, "_has_tma", lambda: False)  # an H100 or H200 differs below
    assert gemv_method(1, 151936, 1024) == gemv_method(2, 4096, 11008) == "stream"
    assert gemv_method(2, 6144, 4096) == "stream" and gemv_method(3, 6144, 4096) == "dot"
    assert gemv_method(4, 4096, 4096) == gemv_method(8, 22016, 4096) == "dot"  # o, gate_up
    assert gemv_method(4, 6144, 1024) == gemv_method(4, 3072, 2048) == "dot"
    assert gemv_method(2, 4096, 1024) == gemv_method(2, 22016, 4096) == "dot"  # small K, wide N
    assert gemv_method(2, 151936, 4096) == gemv_method(16, 4096, 11008) == "dot"
    assert gemv_method(32, 1024, 1024) == "dot" and gemv_method(33, 1024, 1024) is None
    # 33..64 rows: dot for wide W only (gate_up of 1B-8B models, LM heads).
    assert gemv_method(48, 22016, 4096) == gemv_method(64, 151936, 1024) == "dot"
    assert gemv_method(65, 151936, 1024) is None and gemv_method(48, 6144, 4096) is None
    # ...and for a 7-8B model's attention (K >= 4096): split-K for attention out (N <= K < 2N)
    # to 128 rows and the dot kernel for qkv at 49-64 rows, where cuBLAS slows.
    assert gemv_method(33, 4096, 4096) == gemv_method(128, 4096, 4096) == "split"
    assert gemv_method(49, 6144, 4096) == gemv_method(64, 6144, 4096) == "dot"
    assert gemv_method(64, 6144, 2048) is None and gemv_method(65, 6144, 4096) is None
    assert gemv_method(64, 1024, 1024) is None and gemv_method(129, 4096, 4096) is None
    # 33..128 rows: split-K for down projections (K > 2N); eh_proj (K = 2N) lost at 128.
    assert gemv_method(33, 1024, 3072) == gemv_method(128, 4096, 11008) == "split"
    assert gemv_method(64, 4096, 8192) is None and gemv_method(129, 4096, 11008) is None
    # On Hopper (132 SMs), a 7-8B gate_up (K >= 4096, WIDE_N <= N < HEAD_N) at 33-64 rows whose
    # 128-row tiles fill the last wave under 80% (MiMo's 22,016: 65%) takes the tma kernel,
    # with its SiLU epilogue; Llama-3.1-8B's 28,672 (85%), LM heads and small K do not.
    monkeypatch.setattr(gemv_config, "_has_tma", lambda: True)
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    assert gemv_method(33, 22016, 4096) == gemv_method(64, 22016, 4096) == "tma"
    assert silu_mul_epilogue(48, 22016, 4096) and gemv_method(64, 28672, 4096) == "dot"
    assert gemv_method(32, 22016, 4096) == gemv_method(48, 22016, 2048) == "dot"
    assert gemv_method(48, 151936, 4096) == "dot" and gemv_method(65, 22016, 4096) is None
    monkeypatch.setattr(gemv_config, "_has_tma", lambda: False)
    assert gemv_method(64, 22016, 4096) == "dot"
    monkeypatch.undo()  # the interpreter's 4 SMs again
    h100 = torch.device("cpu")  # the interpreter stands in for 4 SMs and an H100's 227 KB
    assert dot_config(2, 1024, 1024, torch.bfloat16, h100)[:2] == (128, 128)
    assert dot_config(2, 128, 1024, torch.bfloat16, h100)[:2] == (64, 128)
    assert dot_config(2, 16, 1024, torch.bfloat16, h100)[:2] == (32, 256)
    stages = {
        (m, dt): dot_config(m, 1024, 1024, dt, h100)[2]
        for m in (2, 32)
        for dt in (torch.bfloat16, torch.float32)
    }
    assert stages == {
        (2, torch.bfloat16): 5,
        (32, torch.bfloat16): 5,
        (2, torch.float32): 3,
        (32, torch.float32): 2,
    }
    # A card with 99 KB of shared memory (consumer Ada): float32 at 32 rows halves BLOCK_K.
    monkeypatch.setattr(gemv_config, "shared_memory", lambda device: 101376)
    assert dot_config(32, 1024, 1024, torch.float32, h100)[:3] == (128, 64, 2)
    assert dot_config(2, 1024, 1024, torch.bfloat16, h100)[:3] == (128, 128, 2)
    # Split-K: 64 x 128 tiles; K split so the grid fills an H100's 132 SMs once, at most 4 ways.
    monkeypatch.setattr(gemv_config, "shared_memory", lambda device: 232448)
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    assert split_config(128, 4096, 11008, torch.bfloat16, h100) == (64, 128, 4, 2)
    assert split_config(64, 2048, 8192, torch.bfloat16, h100) == (64, 128, 5, 4)
    assert split_config(64, 1024, 3072, torch.bfloat16, h100) == (64, 128, 5, 4)
    assert split_config(64, 8192, 28672, torch.bfloat16, h100)[3] == 1
    # Up to 32 rows, wide W whose 128-row tiles leave the last wave under 80% full: two programs
    # an SM, 84 rows each in 128-row tiles (MiMo's gate_up: 172 programs of 128, a second wave on
    # 40 SMs). At 33-64 rows, 64-wide tiles where they fill the last wave better (344 of 64).
    assert dot_config(2, 22016, 4096, torch.bfloat16, h100) == (128, 64, 5, 84, 8)
    assert dot_config(32, 22016, 4096, torch.bfloat16, h100) == (128, 64, 5, 84, 8)
    assert dot_config(16, 28672, 4096, torch.bfloat16, h100)[3] == 128  # 85% full
    assert dot_config(64, 22016, 4096, torch.bfloat16, h100) == (64, 128, 5, 64, 4)
    assert dot_config(64, 28672, 4096, torch.bfloat16, h100) == (128, 128, 4, 128, 4)  # a tie
    assert dot_config(64, 151936, 1024, torch.bfloat16, h100)[:4] == (128, 128, 4, 128)  # a head
    # Programs that would fit two to an SM hold more stages, so that one holds it alone (less
    # one stage: Triton's mma v2 pipeline keeps stages - 1 tiles): MiMo's attention out and
    # down at 16 rows, 128 programs of 32 x 256 (24 KB a stage); qkv, 96 of 64 x 128 (20 KB).
    for n, k, tile in (
        (4096, 4096, (32, 256, 6)),
        (4096, 11008, (32, 256, 6)),
        (6144, 4096, (64, 128, 7)),
    ):
        assert dot_config(16, n, k, torch.bfloat16, h100)[:3] == tile
        assert (tile[2] - 1) * (tile[0] + 16) * tile[1] * 2 > 232448 // 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("k", [1000, 100])
def test_gemv_norm_prologue(dtype, m, with_residual, k):
    """gemv(norm=...) == linear(rms_norm(x + residual)); x + residual lands in residual_out,
    written by one program while the others still read x and residual."""
    n = 37
    x, w, nw = randn(m, k, dtype=dtype, scale=3.0), randn(n, k, dtype=dtype), randn(k, dtype=dtype)
    bias = randn(n, dtype=dtype)
    res = randn(m, k, dtype=dtype) if with_residual else None
    res_out = poisoned(x) if with_residual else None
    out = poisoned(torch.empty(m, n, dtype=dtype, device=DEVICE))
    gemv(x, w, out, bias=bias, norm=(nw, 1e-6), residual=res, residual_out=res_out, block_k=128)
    ref = gemv_ref(
        x.double(),
        w.double(),
        bias=bias.double(),
        norm=(nw.double(), 1e-6),
        residual=None if res is None else res.double(),
    )
    assert_rel(out, ref, dtype)
    if with_residual and INTERP:  # the interpreter truncates fp32 -> bf16 casts
        assert_elem(res_out, x + res, dtype)
    elif with_residual:
        assert torch.equal(res_out, x + res)  # rounded exactly as the unfused add


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("block_k", [128, None])  # None: stream_config's tile
def test_gemv_gated_prologue(dtype, m, block_k):
    n, k = 37, 1000
    x, w = randn(m, 2 * k, dtype=dtype, scale=3.0), randn(n, k, dtype=dtype)
    out = poisoned(torch.empty(m, n, dtype=dtype, device=DEVICE))
    assert gemv(x, w, out, gated=True, block_k=block_k) is out
    act = gemv_ref(x, torch.eye(k, dtype=dtype, device=DEVICE), gated=True)  # silu*up in dtype
    assert_rel(out, gemv_ref(act.double(), w.double()), dtype)


def test_stream_config_gated_tiles():
    """Above one row, the gated prologue's tile is 8 W rows and 8K products a step: the single-
    row rule gave Qwen3-0.6B's down projection 4 x 4096 x 2, which spilled (20.1 vs 6.6 us on
    the H100). One row keeps at least 4 W rows a program, the norm prologue at least 8."""
    cpu = torch.device("cpu")
    for n, k in [(1024, 3072), (4096, 11008), (4096, 14336)]:
        for m in (2, 3, 4):
            block_n, block_k = stream_config(m, n, k, cpu, prologue=2)
            assert block_n == 8 and next_pow2(m) * block_n * block_k == 8192
        assert stream_config(1, n, k, cpu, prologue=2)[0] >= 4  # more for a large N
        assert stream_config(1, n, k, cpu, prologue=1)[0] >= 8


def test_stream_config_one_row_tiles(monkeypatch):
    """One row, H100 (132 SMs): the norm prologue takes K <= 1024 in one tile (fetched before
    the PDL wait); LM heads take 8 x 1024 tiles; a small N keeps 2 W rows a program, except
    under a prologue, where the down projection keeps its one 4 x 4096 tile."""
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    h100 = torch.device("cpu")
    assert stream_config(1, 6144, 1024, h100, prologue=1) == (8, 1024)  # Qwen3-0.6B gate_up
    assert stream_config(1, 3072, 2048, h100, prologue=1) == (8, 1024)  # Llama-3.2-1B: 2 tiles
    assert stream_config(1, 151936, 1024, h100) == (8, 1024)
    assert stream_config(1, 128256, 4096, h100) == (8, 1024)
    assert stream_config(1, 1024, 2048, h100) == (2, 2048)  # Qwen3-0.6B attention out
    assert stream_config(1, 1024, 3072, h100, prologue=2) == (4, 4096)  # its down


def test_stream_config_two_row_tiles(monkeypatch):
    """Two rows keep one row's 4K products a step, or at K >= 4096 take 16 x 512 tiles (N <= K:
    MiMo-7B's attention out and eh_proj) or 4 x 256 (its qkv); more rows 8K; the gated prologue
    keeps its 8-row tiles."""
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    h100 = torch.device("cpu")
    assert stream_config(2, 4096, 4096, h100) == stream_config(2, 4096, 8192, h100) == (16, 512)
    assert stream_config(2, 6144, 4096, h100) == (4, 256)  # MiMo-7B's qkv
    assert stream_config(2, 1024, 2048, h100) == (1, 2048)  # Qwen3-0.6B's attention out
    assert stream_config(4, 4096, 4096, h100) == (4, 512)
    assert stream_config(1, 4096, 4096, h100) == (4, 1024)
    assert stream_config(2, 4096, 11008, h100, prologue=2) == (8, 512)


def test_stream_stages_pipeline_long_loops(monkeypatch):
    """A stream program pipelines its W tiles (3 in flight) once it loops over 16 or more:
    MiMo-7B / Llama-3.1-8B gate_up at one row (16 x 256 tiles over K = 4096), gated down at two
    (8 x 512 over 11,008); short loops (attention out at one row: 4 tiles) fetch one at a time."""
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    h100 = torch.device("cpu")
    assert stream_config(1, 22016, 4096, h100) == (16, 256)
    bf16 = 2
    assert stream_stages(1, 4096, 16, 256, bf16, h100) == 3
    assert stream_stages(2, 11008, 8, 512, bf16, h100) == 3
    assert stream_stages(2, 4096, 16, 512, bf16, h100) == 3  # two rows at K >= 4096
    assert stream_stages(1, 4096, 4, 1024, bf16, h100) == 1  # 4 tiles
    assert stream_stages(1, 11008, 4, 1024, bf16, h100) == 1  # 11 tiles
    assert stream_stages(1, 8192, 4, 1024, bf16, h100) == 1  # 8 tiles
    assert stream_stages(2, 2048, 2, 1024, bf16, h100) == 1  # two rows, K < 4096
    # 3 float32 stages of 16 x 512 (141 KB) do not fit a 99 KB consumer card; bf16 (71 KB) do.
    monkeypatch.setattr(gemv_config, "shared_memory", lambda device: 101376)
    assert stream_stages(2, 4096, 16, 512, 4, h100) == 1
    assert stream_stages(2, 4096, 16, 512, bf16, h100) == 3


@pytest.mark.parametrize("num_stages", [None, 3])
def test_gemv_stream_pipelined_loop_matches_reference(num_stages):
    """The pipelined loop (forced at 3 stages, and the rule's choice) over 16+ K tiles, one and
    two rows, plain and gated: the reference's result."""
    torch.manual_seed(0)
    w = torch.randn(24, 1024, dtype=torch.float32, device=DEVICE)
    for m, gated in ((1, False), (2, False), (2, True)):
        x = torch.randn(m, 2048 if gated else 1024, dtype=torch.float32, device=DEVICE)
        y = gemv(x, w, gated=gated, method="stream", block_n=4, block_k=64, num_stages=num_stages)
        torch.testing.assert_close(y, gemv_ref(x, w, gated=gated), rtol=1e-5, atol=1e-4)


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=DEVICE)


def test_accept_drafts_per_segment():
    """Three sequences: 2 drafts both accepted, 3 drafts the first rejected, none; forced
    acceptance writes the accepted drafts into `sampled`."""
    sampled, draft_next = _long([5, 6, 7, 1, 2, 3, 4, 9]), _long([5, 6, -1, 8, 2, 3, -1, -1])
    starts = _long([0, 3, 7])
    assert accept_drafts(sampled, draft_next, starts, 4).tolist() == [2, 0, 0]
    assert accept_drafts_ref(sampled, draft_next, starts).tolist() == [2, 0, 0]
    for fn, args in ((accept_drafts, (starts, 4)), (accept_drafts_ref, (starts,))):
        forced = sampled.clone()
        assert fn(forced, draft_next, *args, force=1).tolist() == [1, 1, 0]
        assert forced.tolist() == [5, 6, 7, 8, 2, 3, 4, 9]


@pytest.mark.parametrize("force", [None, 1])
def test_accept_drafts_writes_the_last_verified_rows_and_tokens(force):
    """`last`: each segment's start plus its accepted count; `copies`: the step's tokens (forced
    drafts included), each up to its length; from the kernel and the ref."""
    sampled, draft_next = _long([5, 6, 7, 1, 2, 3, 4, 9]), _long([5, 6, -1, 8, 2, 3, -1, -1])
    starts = _long([0, 3, 7])
    want = [2, 3, 7] if force is None else [1, 4, 7]
    tokens = [5, 6, 7, 1, 2, 3, 4, 9] if force is None else [5, 6, 7, 8, 2, 3, 4, 9]
    for fn, args in ((accept_drafts, (starts, 4)), (accept_drafts_ref, (starts,))):
        last, a, b = _long([-9, -9, -9]), _long([-9] * 8), _long([-9] * 5)
        fn(sampled.clone(), draft_next, *args, force=force, last=last, copies=(a, b))
        assert last.tolist() == want
        assert a.tolist() == tokens and b.tolist() == tokens[:5]  # the step's tokens, forced


def test_accept_drafts_reads_a_device_force():
    """force as a (1,) device tensor (what a CUDA graph replays): -1 accepts by the tokens, a
    count forces as the int does, into `out`."""
    sampled, draft_next = _long([5, 6, 7, 1, 2, 3, 4, 9]), _long([5, 6, -1, 8, 2, 3, -1, -1])
    starts = _long([0, 3, 7])
    for fn, args in ((accept_drafts, (starts, 4)), (accept_drafts_ref, (starts,))):
        out = _long([9, 9, 9])
        assert fn(sampled.clone(), draft_next, *args, force=_long([-1]), out=out) is out
        assert out.tolist() == [2, 0, 0]
        forced = sampled.clone()
        assert fn(forced, draft_next, *args, force=_long([1])).tolist() == [1, 1, 0]
        assert forced.tolist() == [5, 6, 7, 8, 2, 3, 4, 9]


@pytest.mark.parametrize("force", [None, 0, 1, 2])
def test_accept_drafts_matches_ref(force):
    """Random segments of 1..k+1 rows whose drafts match the target's tokens at random (a
    force of 1 once failed to compile on the GPU: Triton made it a constant)."""
    g = torch.Generator().manual_seed(1)
    k, lengths = 3, torch.randint(1, 5, (37,), generator=g)
    rows = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    sampled = torch.randint(0, 4, (rows,), generator=g)
    draft_next = torch.where(
        torch.rand(rows, generator=g) < 0.7, sampled, torch.randint(0, 4, (rows,), generator=g)
    )
    draft_next[starts + lengths - 1] = -1  # a segment's last row proposes nothing
    out, ref = sampled.clone().to(DEVICE), sampled.clone().to(DEVICE)
    dn, st = draft_next.to(DEVICE), starts.to(DEVICE)
    acc = accept_drafts(out, dn, st, k + 1, force)
    assert torch.equal(acc, accept_drafts_ref(ref, dn, st, force))
    assert torch.equal(out, ref)
    total = int(acc.sum())
    assert total < rows - 37  # some drafts rejected ...
    assert total > 0 or force == 0  # ... and some accepted


@pytest.mark.parametrize("with_accepted", [True, False])
@pytest.mark.parametrize("part", ["both", "inputs", "drafts"])
def test_spec_shift_matches_ref(with_accepted, part):
    """Rows continuing an in-flight step (in a shuffled order, some with fewer drafts) get its
    tokens, and move by its accepted counts, as the torch version does."""
    g = torch.Generator().manual_seed(2)
    k, block_size, num_prev = 3, 4, 9
    accepted = torch.randint(0, k + 1, (num_prev,), generator=g)
    sampled = torch.randint(0, 1000, (num_prev * (k + 1),), generator=g)
    seg_dev = torch.arange(0, num_prev * (k + 1), k + 1)
    drafts = torch.randint(0, 1000, (num_prev, k), generator=g)
    follows = torch.randperm(num_prev, generator=g)[:7].tolist()  # this step's 7 rows
    nums = [1 + (k if i % 3 else i % k) for i in range(7)]  # tokens per row: 1 + drafts
    entries = [
        (sum(nums[:r]) + j, s, j, r, nums[r] - 1, sum(nums[:r]) + j)
        for r, s in enumerate(follows)
        for j in range(nums[r])
    ]
    shift = tuple(_long(list(col)) for col in zip(*entries))
    tokens = sum(nums)
    tables = torch.randperm(100, generator=g)[: 7 * 12].view(7, 12).to(torch.int32)
    ctx = torch.tensor([30 + 2 * r for r in range(7)], dtype=torch.int32)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx.tolist(), nums)])
    state = {
        "ids": torch.zeros(tokens, dtype=torch.long),
        "positions": positions,
        "slots": torch.full((tokens,), -7),
        "ctx": ctx,
        "tables": tables,
        "draft_next": torch.full((tokens,), -5),
    }
    outs = []
    for fn in (spec_shift, spec_shift_ref):
        st = {name: v.clone().to(DEVICE) for name, v in state.items()}
        inputs = tuple(st[n] for n in ("ids", "positions", "slots", "ctx", "tables"))
        prev = (
            accepted.to(DEVICE) if with_accepted else None,
            sampled.to(DEVICE),
            seg_dev.to(DEVICE),
            drafts.to(DEVICE),
        )
        fn(
            shift,
            prev,
            None if part == "drafts" else inputs,
            block_size,
            None if part == "inputs" else st["draft_next"],
        )
        outs.append(st)
    for name in state:
        assert torch.equal(outs[0][name], outs[1][name]), name
    if part != "drafts":
        assert not torch.equal(outs[0]["ids"], state["ids"].to(DEVICE))
        assert (outs[0]["slots"] >= 0).all()


def test_gemv_prologue_rejects_bad_inputs():
    x, w, nw = randn(1, 64), randn(8, 64), randn(64)
    with pytest.raises(ValueError, match="residual_out"):
        gemv(x, w, norm=(nw, 1e-6), residual=randn(1, 64))
    with pytest.raises(ValueError, match="alias"):
        res = randn(1, 64)
        gemv(x, w, norm=(nw, 1e-6), residual=res, residual_out=res)
    with pytest.raises(ValueError, match="gated"):
        gemv(x, w, gated=True)
    with pytest.raises(ValueError, match="norm prologue"):
        gemv(x, w, residual=randn(1, 64))
    with pytest.raises(ValueError, match="dot"):
        gemv(x, w, norm=(nw, 1e-6), method="dot")
    with pytest.raises(ValueError, match="float32"):
        gemv(x.half(), w.half(), torch.empty(1, 8, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, torch.empty(1, 9, device=DEVICE))


# --------------------------------------------------------------------------- sampling


def test_counter_uniform_stream_is_the_samplers():
    from tinyserve.sample.sampler import counter_key
    from tinyserve.sample.sampler import counter_uniform as torch_uniform

    seeds = torch.tensor([0, -1, 2**62 + 12345, -(2**63), 77], device=DEVICE)
    keys = counter_key(seeds, torch.tensor([0, 1, 5, 1000, 3], device=DEVICE))
    assert torch.equal(counter_uniform(keys, 3001), torch_uniform(keys, 3001))


@pytest.mark.parametrize("num_chunks", [None, 1, 3])
def test_sample_race_matches_reference(num_chunks):
    from tinyserve.sample.sampler import counter_key

    keys = counter_key(
        torch.randint(-(2**62), 2**62, (6,), device=DEVICE), torch.arange(6, device=DEVICE)
    )
    x = randn(6, 3000, scale=4.0)
    x[1, 100:] = float("-inf")  # top-k style mask
    x[2, :] = 0.0  # all ties: the race alone decides
    greedy = torch.tensor([False, True, False, False, True, False], device=DEVICE)
    x[4, 2000] = x[4, 17] = x[4].max() + 1  # greedy tie: the lower index wins
    ids = sample_race(x, keys, greedy, num_chunks=num_chunks)
    assert torch.equal(ids, sample_race_ref(x, keys, greedy))
    assert ids[4] == 17
    assert torch.equal(sample_race(x, keys, num_chunks=num_chunks), sample_race_ref(x, keys))


@pytest.mark.parametrize(
    ("batch", "vocab"), [(1, 5000), (5, 3001), (3, 37), (64, 2048), (40, 7001)]
)
def test_argmax(batch, vocab):
    """torch.argmax's ids, ties to the lowest index across chunk boundaries, into out."""
    x = randn(batch, vocab, scale=4.0)
    x[0, vocab // 2] = x[0, vocab - 1] = x[0, 3] = x[0].max() + 1  # ties in different chunks
    if batch > 1:
        x[1, :] = -1.0  # all equal: id 0
        x[1, 5:] = float("-inf")
    if batch > 2:
        x[2, :] = float("-inf")  # nothing allowed: id 0, as torch
    out = torch.full((batch,), -7, dtype=torch.int64, device=DEVICE)
    assert argmax(x, out) is out
    assert torch.equal(out, x.argmax(-1))
    assert out[0] == 3
    assert torch.equal(argmax(x[:, : vocab // 2]), x[:, : vocab // 2].argmax(-1))  # strided rows


def test_argmax_through_a_token_map():
    """With `ids` (a draft head's token map) the maximum's mapped id, ties as without."""
    x = randn(5, 3000, scale=4.0)
    x[0, 2500] = x[0, 7] = x[0].max() + 1  # a tie across chunks: column 7 wins
    ids = torch.randperm(50000, device=DEVICE)[:3000]
    out = torch.full((5,), -7, dtype=torch.int64, device=DEVICE)
    assert argmax(x, out, ids) is out
    assert torch.equal(out, ids[x.argmax(-1)]) and out[0] == ids[7]
    with pytest.raises(ValueError, match="ids must be"):
        argmax(x, ids=ids[:10])


def test_race_takes_chunks_of_two_tiles_at_any_batch(monkeypatch):
    """The argmax and the sampler split each row's vocabulary into chunks of two 1,024-wide
    tiles whatever the batch (H200: 64 rows of 151,680, argmax 28.9 -> 13.7 us against ~2
    programs an SM), unless a chunk count is asked for."""
    from tinyserve.kernels import sampling as kernel

    grids, chunk_kernel = [], kernel._race_chunk_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return chunk_kernel[grid]

    monkeypatch.setattr(kernel, "_race_chunk_kernel", Spy())
    vocab = 7001  # 7 tiles: 4 chunks, the last of one tile
    for batch in (1, 40):
        x = randn(batch, vocab, scale=4.0)
        keys = torch.arange(batch, dtype=torch.int64, device=DEVICE)
        assert torch.equal(argmax(x), x.argmax(-1))
        assert torch.equal(sample_race(x, keys), sample_race_ref(x, keys))
        assert torch.equal(sample_race(x, keys, num_chunks=2), sample_race_ref(x, keys))
        assert grids[-3:] == [(batch, 4), (batch, 4), (batch, 2)]


def test_race_compiles_once_per_vocab_whatever_the_batch(monkeypatch):
    """The race kernels' compile-time arguments do not depend on the batch: an eager step of a
    new size must not compile (~0.2 s each on the H100 host; bench.py prefix's first set ran
    six such compiles, TTFT 1.32 s against 0.58 s once compiled)."""
    from tinyserve.kernels import sampling as kernel

    seen = {}

    class Spy:  # records each launch's constexprs (upper-case kwargs), then launches
        def __init__(self, name):
            self.fn, self.name = getattr(kernel, name), name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                constexprs = tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper()))
                seen.setdefault(self.name, set()).add(constexprs)
                return self.fn[grid](*args, **kwargs)

            return launch

    for name in ("_race_chunk_kernel", "_race_pick_kernel"):
        monkeypatch.setattr(kernel, name, Spy(name))
    vocab = 5000
    for batch in (1, 2, 3, 5, 9, 17, 40, 100, 300):
        x = randn(batch, vocab, scale=4.0)
        assert torch.equal(argmax(x), x.argmax(-1))
    assert {k: len(v) for k, v in seen.items()} == {"_race_chunk_kernel": 1, "_race_pick_kernel": 1}


def test_argmax_rejects_bad_inputs():
    with pytest.raises(ValueError, match="float32"):
        argmax(randn(2, 10, dtype=BF16))
    with pytest.raises(ValueError, match="out must be"):
        argmax(randn(2, 10), torch.empty(3, dtype=torch.int64, device=DEVICE))


def test_sample_race_equals_sampler_tokens():
    """Processed logits + keys from SamplingTensors: the torch sampler's tokens exactly."""
    from tinyserve.sample.sampler import SamplingRow, SamplingTensors, sample
    from tinyserve.sampling_params import SamplingParams

    temps = [0.0, 0.7, 1.0, 1.3, 0.0, 0.9]
    rows = [
        SamplingRow(
            SamplingParams(temperature=t, seed=i), seed=i, prompt_ids=[1], output_ids=[2] * i
        )
        for i, t in enumerate(temps)
    ]
    tensors = SamplingTensors.build(rows, 2000, DEVICE)
    logits = randn(6, 2000, scale=3.0)
    processed = logits / tensors.temperature[:, None]
    ids = sample_race(processed, tensors.rng_keys, tensors.is_greedy)
    assert torch.equal(ids, sample(logits, tensors).token_ids)


@gpu
def test_sampler_on_gpu_draws_the_cpu_samplers_tokens(monkeypatch):
    """`sample` on CUDA takes the fused race; the CPU takes the torch ops. Same processed
    logits and keys (filters, greedy rows, seeds): the same tokens."""
    from tinyserve.kernels import sampling as kernel
    from tinyserve.sample.sampler import SamplingRow, SamplingTensors, sample
    from tinyserve.sampling_params import SamplingParams

    calls, fused = [], kernel.sample_race
    monkeypatch.setattr(kernel, "sample_race", lambda *a, **k: calls.append(1) or fused(*a, **k))

    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=50, seed=2),
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=3),
    ] * 8
    rows = [
        SamplingRow(p, seed=i, prompt_ids=[1], output_ids=[2] * i) for i, p in enumerate(params)
    ]
    logits = torch.randn(len(rows), 4099, generator=torch.Generator().manual_seed(0)) * 3
    got = sample(logits.cuda(), SamplingTensors.build(rows, 4099, "cuda")).token_ids
    assert calls == [1], "sampled rows on CUDA take the fused kernel"
    want = sample(logits, SamplingTensors.build(rows, 4099, "cpu")).token_ids
    assert calls == [1] and torch.equal(got.cpu(), want)


@gpu
@pytest.mark.gpu
def test_greedy_takes_the_kernel_at_any_batch(monkeypatch):
    """tinyserve.sample.sampler.greedy on CUDA: the Triton argmax at every row count (measured
    faster than torch's reduction from 1 to 256 rows on the H200), with torch's ids."""
    from tinyserve.kernels import sampling as kernel
    from tinyserve.sample.sampler import greedy

    calls, fused = [], kernel.argmax
    monkeypatch.setattr(kernel, "argmax", lambda *a, **k: calls.append(1) or fused(*a, **k))
    for rows, expected_calls in ((1, 1), (32, 2), (33, 3), (64, 4), (128, 5)):
        x = randn(rows, 151936, scale=4.0)
        assert torch.equal(greedy(x), x.argmax(-1))
        assert len(calls) == expected_calls, rows


# --------------------------------------------------------------------------- launchers


def test_launchers_reject_bad_inputs():
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.float64"):  # value appended
        rms_norm(randn(2, 8).double(), randn(8).double(), 1e-6)
    q = randn(2, 4, 64)
    k_cache, v_cache, table, lens = paged_cache(2, [3, 5], 2, 64, 16, F32)
    with pytest.raises(ValueError, match="int32"):
        decode_attention(q, k_cache, v_cache, table.long(), lens, 0.1)
    with pytest.raises(ValueError, match="dtypes"):
        decode_attention(q.to(BF16), k_cache, v_cache, table, lens, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(randn(2, 3, 64), k_cache, v_cache, table, lens, 0.1)
    skip = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    chunks = torch.full((1, 1 + shared_prefix_rows(4, 2)), -1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="shared_chunks must be"):
        decode_attention(
            q, k_cache, v_cache, table, lens, 0.1, shared_chunks=chunks[:, 1:], shared_lens=skip
        )
    with pytest.raises(ValueError, match="shared_lens"):
        decode_attention(q, k_cache, v_cache, table, lens, 0.1, shared_chunks=chunks)
    with pytest.raises(ValueError, match="Hq / Hkv <= 64"):  # 128 query heads on one kv head
        mqa_cache = k_cache[:, :, :1].contiguous()
        decode_attention(
            randn(2, 128, 64),
            mqa_cache,
            mqa_cache,
            table,
            lens,
            0.1,
            shared_chunks=chunks,
            shared_lens=skip,
        )
    with pytest.raises(ValueError, match="1..64 rows"):
        gemv(randn(65, 64), randn(64, 64))  # K <= 2N: no split-K, and too many rows for dot
    with pytest.raises(ValueError, match="1..128 rows"):
        gemv(randn(129, 64), randn(8, 64), method="split")
    with pytest.raises(ValueError, match="stream is for"):
        gemv(randn(17, 64), randn(8, 64), method="stream")
    with pytest.raises(ValueError, match="method"):
        gemv(randn(2, 64), randn(8, 64), method="splitk")
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(randn(8, 4).t())
    with pytest.raises(ValueError, match="float32"):
        sample_race(randn(2, 8, dtype=BF16), torch.zeros(2, dtype=torch.int64, device=DEVICE))


# --------------------------------------------------------------------------- real shapes (GPU)


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


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_prefill_attention_gpu(dtype):
    query_lens, lens = [1, 512, 37, 1000, 1, 300], [2000, 1024, 37, 3000, 5, 300]
    k_cache, v_cache, table, context_lens = paged_cache(6, lens, 8, 128, 16, dtype)
    cu = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    q = randn(sum(query_lens), 32, 128, dtype=dtype)
    out = poisoned(q)
    prefill_attention(q, k_cache, v_cache, table, cu, context_lens, 1000, 128**-0.5, out)
    assert_rel(
        out, prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 128**-0.5), dtype
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [
        (151936, 1024),
        (1024, 2048),
        (1024, 3072),
        (6144, 4096),
        (4096, 4096),
        (22016, 4096),
        (4096, 14336),
    ],
)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 17, 32])
def test_gemv_gpu(shape, m):
    """Real shapes, each row count's tuned method and tile (pipelined stream loops included:
    gate_up at one row, every two-row W at K >= 4096)."""
    n, k = shape
    x, w = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16) * 0.05
    ref = gemv_ref(x.float(), w.float())
    for method in (None, "stream") if 1 < m <= 16 else (None,):
        out = torch.full((m, n), float("nan"), dtype=BF16, device=DEVICE)
        gemv(x, w, out, method=method)
        assert_rel(out, ref, BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_gated_gpu(m):
    """MiMo-7B's down projection with the gated prologue (22 pipelined tiles at two rows)."""
    x, w = randn(m, 2 * 11008, dtype=BF16), randn(4096, 11008, dtype=BF16) * 0.05
    out = torch.full((m, 4096), float("nan"), dtype=BF16, device=DEVICE)
    gemv(x, w, out, gated=True)
    assert_rel(out, gemv_ref(x.float(), w.float(), gated=True), BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(22016, 4096), (28672, 4096), (6144, 1024)])
@pytest.mark.parametrize("m", [3, 4, 16, 32, 64])
def test_gemv_silu_mul_gpu(shape, m):
    """gate_up with the SiLU epilogue at MiMo-7B / Llama-3.1-8B / Qwen3-0.6B shapes, in each row
    count's dot tiles (balanced runs of 84 gate + 84 up rows for MiMo to 32 rows)."""
    n, k = shape
    if not gemv_config.silu_mul_epilogue(m, n, k):
        pytest.skip("not the dot kernel here")
    x, w = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16) * 0.05
    out = gemv(x, w, silu_mul=True, method="dot")
    assert_rel(out, silu_mul_ref(gemv_ref(x.float(), w.float()).to(BF16)).float(), BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "m", "method"),
    [
        (s, m, "split")
        for s in [(1024, 3072), (2048, 8192), (4096, 11008), (4096, 14336)]
        for m in (33, 64, 100, 128)
    ]
    + [
        (s, m, "dot")
        for s in [(151936, 1024), (28672, 4096), (22016, 4096), (16384, 2048)]
        for m in (33, 64)
    ]
    + [((4096, 4096), m, "split") for m in (33, 48, 64, 96, 128)]
    + [((6144, 4096), 64, "dot")],
)
def test_gemv_many_rows_gpu(shape, m, method):
    """Above 32 rows: down projections (to 128 rows) take split-K, wide W (LM heads, gate_up; to
    64 rows) the dot kernel, or on Hopper the tma kernel where `_tma_pays` (MiMo-7B's gate_up);
    a 7-8B model's attention out split-K (to 128 rows) and its qkv the dot kernel above 48 rows."""
    n, k = shape
    x, w = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16) * 0.05
    out = torch.full((m, n), float("nan"), dtype=BF16, device=DEVICE)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert gemv_method(m, n, k) == ("tma" if hopper and (n, k) == (22016, 4096) else method)
    gemv(x, w, out)
    assert_rel(out, gemv_ref(x.float(), w.float()), BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("block_m", "block_n", "num_warps"), [(64, 64, 4), (128, 128, 8)])
def test_prefill_attention_gpu_configs(block_m, block_n, num_warps):
    lens = [900, 1500, 129]  # query lengths 1, 700, 129: decode, extend, fresh
    k_cache, v_cache, table, context_lens = paged_cache(3, lens, 8, 128, 16, BF16)
    cu = torch.tensor([0, 1, 701, 830], dtype=torch.int32, device=DEVICE)
    q = randn(830, 32, 128, dtype=BF16)
    out = poisoned(q)
    prefill_attention(
        q,
        k_cache,
        v_cache,
        table,
        cu,
        context_lens,
        700,
        0.1,
        out,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
    )
    assert_rel(out, prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 0.1), BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "chunk"), [(16, 48), (16, 448), (32, 48), (32, 128)])
def test_prefill_attention_key_splits_gpu(heads, chunk):
    """64 decode rows beside a chunk of a 32k-token prompt, with the split count the engine
    picks (query groups of 2, qwen3-0.6b, and 4, llama-3.1-8b: 10, 2, 7 and 3 splits)."""
    from tinyserve.kernels.prefill_attention import prefill_num_splits

    query_lens, lens = [1] * 64 + [chunk], [600] * 64 + [32768]
    k_cache, v_cache, table, context_lens = paged_cache(65, lens, 8, 128, 16, BF16)
    cu = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    q = randn(sum(query_lens), heads, 128, dtype=BF16)
    splits = prefill_num_splits(query_lens, lens, heads, 8, q.device)
    assert splits > 1
    out = poisoned(q)
    prefill_attention(
        q, k_cache, v_cache, table, cu, context_lens, chunk, 128**-0.5, out, num_splits=splits
    )
    ref = prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 128**-0.5)
    assert_rel(out, ref, BF16)


@gpu
@pytest.mark.gpu
def test_small_ops_gpu_real_shapes():
    x, r, w = randn(64, 4096, dtype=BF16), randn(64, 4096, dtype=BF16), randn(4096, dtype=BF16)
    out, res = rms_norm(x, w, 1e-5, r)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, r)
    assert torch.equal(res, ref_res)
    assert_elem(out, ref, BF16)
    g = randn(64, 2 * 14336, dtype=BF16, scale=3.0)
    assert_elem(silu_mul(g), silu_mul_ref(g), BF16)
    keys = torch.randint(-(2**62), 2**62, (64,), device=DEVICE)
    logits = randn(64, 151936, scale=3.0)
    assert torch.equal(sample_race(logits, keys), sample_race_ref(logits, keys))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [64, 128])
def test_prefill_attention_reads_nothing_for_zero_contexts_gpu(block_m):
    """A CUDA graph's warm-up runs on zeroed buffers: context lengths 0 under long queries
    must read no table entry before the row (an illegal address before the guard, seen with
    128-row tiles)."""
    lens = [2304, 128, 1500]
    k_cache, v_cache, table, _ = paged_cache(3, lens, 8, 128, 16, BF16)
    cu = torch.tensor([0, 256, 384, 1084], dtype=torch.int32, device=DEVICE)
    q = randn(1084, 16, 128, dtype=BF16)
    zero = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    prefill_attention(
        q, k_cache, v_cache, table, cu, zero, 700, 128**-0.5, block_m=block_m, block_n=32
    )
    torch.cuda.synchronize()  # an illegal address would raise here
