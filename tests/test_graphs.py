"""The CUDA-graph path on the CPU (graphs built with capture=False replay their static-buffer
forwards eagerly): decode, shared-prefix, prefill and mixed graphs give the eager steps'
outputs; and the graph shapes (padded sizes, split counts) a step takes."""

from __future__ import annotations

import random

import pytest
import torch
from overlap_helpers import VOCAB, make_llm, outputs, workload

from tinyserve import SamplingParams


def with_replayed_graphs(llm, shared_prefix: bool = False):
    """The runner's CUDA-graph path on the CPU: DecodeGraphs with capture=False replays its
    static-buffer forward eagerly (same packed inputs, in-graph gather and argmax)."""
    from tinyserve.runner.graphs import DecodeGraphs

    r = llm.engine.runner
    r.graphs = DecodeGraphs(
        r.model,
        r.config.max_num_seqs,
        r.max_blocks_per_seq,
        r.num_kv_blocks,
        r.block_size,
        capture=False,
        shared_prefix=shared_prefix,
        max_chunk=r.max_graph_chunk,
    )
    r.capture_prefill_graphs(capture=False)
    return llm


@pytest.mark.parametrize("greedy_only", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_graph_path_gives_the_eager_outputs(model_dir, greedy_only, overlap):
    """Decode steps through the graph path: inputs from one packed buffer, the previous step's
    tokens gathered inside the replay, greedy rows taking the replay's own argmax, others
    sampled from its logits; padded rows must not disturb real ones."""
    prompts, params = workload(1)
    if greedy_only:
        params = [
            SamplingParams(
                temperature=0,
                max_tokens=p.max_tokens,
                ignore_eos=p.ignore_eos,
                stop_token_ids=p.stop_token_ids,
            )
            for p in params
        ]
    want = outputs(make_llm(model_dir, async_scheduling=False), prompts, params)
    llm = with_replayed_graphs(make_llm(model_dir, async_scheduling=overlap, max_num_seqs=16))
    got = outputs(llm, prompts, params)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):
        for a, b in zip(g[2] or [], w[2] or []):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert llm.engine.runner.graphs.num_replays > 10


@pytest.mark.parametrize("overlap", [True, False])
def test_shared_prefix_graphs_give_the_eager_outputs(model_dir, overlap):
    """16 sequences on a 132-token common head decode through the shared-prefix graphs (their
    plan and inputs; the CPU attention itself reads every row's whole context)."""
    rng = random.Random(3)
    head = [rng.randrange(8, VOCAB) for _ in range(132)]
    prompts = [head + [rng.randrange(8, VOCAB) for _ in range(1 + i % 5)] for i in range(16)]
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=12 + i, ignore_eos=True)
        for i in range(16)
    ]
    want = outputs(make_llm(model_dir, async_scheduling=False), prompts, params)
    llm = with_replayed_graphs(
        make_llm(model_dir, async_scheduling=overlap, max_num_seqs=16), shared_prefix=True
    )
    assert outputs(llm, prompts, params) == want
    assert llm.engine.runner.graphs.num_shared_replays > 5


def test_one_logits_buffer_per_graph_set_and_no_untileable_cascades(model_dir, monkeypatch):
    """Every graph of a set writes its logits into one buffer (one per size would hold
    bs x V floats each); a model whose query heads per kv head exceed one shared-prefix tile
    gets no cascade graphs."""
    from tinyserve.kernels import shared_prefix_attention
    from tinyserve.runner.graphs import DecodeGraphs

    llm = with_replayed_graphs(make_llm(model_dir, max_num_seqs=16), shared_prefix=True)
    graphs = llm.engine.runner.graphs
    assert graphs.shared_sizes == [16]
    outputs(llm, *workload(1))
    assert len(graphs.outputs) >= 3
    assert all(lg.data_ptr() == graphs.logits.data_ptr() for _, lg in graphs.outputs.values())
    r = llm.engine.runner
    monkeypatch.setattr(shared_prefix_attention, "shared_prefix_rows", lambda heads, kv_heads: 0)
    untileable = DecodeGraphs(
        r.model,
        16,
        r.max_blocks_per_seq,
        r.num_kv_blocks,
        r.block_size,
        capture=False,
        shared_prefix=True,
    )
    assert untileable.shared_sizes == []


def test_a_step_s_rows_round_up_to_the_next_graph_size():
    from tinyserve.runner.graph_shapes import (
        graph_batch_sizes,
        mixed_batch_sizes,
        padded_size,
        round_up,
    )

    assert graph_batch_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    assert [padded_size(n, 40) for n in (1, 3, 9, 17, 33, 40)] == [1, 4, 16, 32, 40, 40]
    assert padded_size(41, 40) == 41  # past the largest graph: eager, unpadded
    assert [round_up(mixed_batch_sizes(40), n) for n in (5, 31, 33, 39)] == [8, 32, 39, 39]


def test_decode_split_count_follows_the_longest_context(monkeypatch):
    """A decode step's split count: the padded batch's GPU-filling count, cut to a power of two
    of at most KEYS_PER_SPLIT keys per split for its longest context, and to one split (no merge
    pass) up to twice that; batch 1 on a 132-SM card fills with 32 splits of an 8-kv-head
    model; LONG_SPLITS (each split at least LONG_MIN_SPLIT keys) where the longest context
    would leave a split over LONG_SPLIT_KEYS keys. Splits the context cut take the short key
    tile, GPU-filling and long ones the default."""
    from tinyserve.kernels import decode_attention
    from tinyserve.runner import graph_shapes
    from tinyserve.runner.graph_shapes import (
        KEYS_PER_SPLIT,
        LONG_MIN_SPLIT,
        LONG_ONE_SPLIT_KEYS,
        LONG_SPLIT_KEYS,
        LONG_SPLITS,
        ONE_SPLIT_KEYS,
        SHORT_SPLIT_BLOCK_N,
        decode_num_splits,
        decode_tiling,
    )

    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    graph_shapes._full_num_splits.cache_clear()  # computed with the real SM count elsewhere
    cuda = torch.device("cuda")

    def splits(batch, ctx):
        return decode_num_splits(batch, 256, 8, 40960, cuda, ctx)

    def block_n(batch, num_splits):
        return decode_tiling(batch, 256, 8, 40960, cuda, num_splits)[0]

    assert splits(1, None) == 32
    keys = KEYS_PER_SPLIT
    assert [splits(1, c) for c in (1, keys, 2 * keys, 2 * keys + 1, 4 * keys, 9 * keys, 40960)] == [
        1,
        1,
        1,
        4,
        4,
        16,
        32,
    ]
    assert [block_n(1, s) for s in (1, 4, 16, 32)] == [None] + [SHORT_SPLIT_BLOCK_N] * 2 + [None]
    assert splits(3, 4 * keys) == splits(4, 4 * keys) == 4  # padded size
    # Batch 48 (384 programs on 132 SMs) fills the last wave with 2 splits, but their merge
    # costs more than the fill saves: one split up to ONE_SPLIT_KEYS keys wherever one split
    # gives every SM a program (batch 16's 128 do not), and up to LONG_ONE_SPLIT_KEYS where its
    # last round of resident programs gives every SM at least two: batches 48 (384 programs)
    # and 112 (896 = 528 + 368), not 80 (640 = 528 + 112) or 144 (1152 = 2 x 528 + 96).
    assert [splits(48, c) for c in (None, 200, ONE_SPLIT_KEYS, ONE_SPLIT_KEYS + 1)] == [2, 1, 1, 1]
    assert [splits(b, LONG_ONE_SPLIT_KEYS) for b in (48, 80, 112, 144)] == [1, 2, 1, 2]
    assert [splits(b, ONE_SPLIT_KEYS) for b in (48, 80, 112, 144)] == [1, 1, 1, 1]
    assert [splits(b, ONE_SPLIT_KEYS + 1) for b in (80, 144)] == [2, 2]
    assert splits(48, LONG_ONE_SPLIT_KEYS + 1) == 2
    assert splits(16, 200) == 2
    assert splits(64, None) == splits(64, LONG_SPLIT_KEYS) == 1
    # A longer context (one long row beside short ones) takes LONG_SPLITS, the default tile.
    assert splits(64, LONG_SPLIT_KEYS + 1) == splits(64, 40960) == LONG_SPLITS
    assert splits(1, 40960) == 32  # batch 1 fills the GPU with 32 splits already
    assert block_n(64, 1) is None and block_n(64, LONG_SPLITS) is None
    # ... each at least LONG_MIN_SPLIT keys long (short rows use one); other counts no floor.
    assert decode_tiling(64, 256, 8, 40960, cuda, LONG_SPLITS)[1] == LONG_MIN_SPLIT
    assert decode_tiling(64, 256, 8, 40960, cuda, 1)[1] == 0
    assert decode_tiling(1, 256, 8, 40960, cuda, 32)[1] == 0  # batch 1's GPU-filling count
    assert decode_num_splits(1, 256, 8, 40960, torch.device("cpu"), 4096) == 1
    assert decode_tiling(1, 256, 8, 40960, torch.device("cpu"), 4) == (None, 0)
    graph_shapes._full_num_splits.cache_clear()


@pytest.mark.parametrize("greedy_only", [True, False])
def test_prefill_graphs_give_the_eager_outputs(model_dir, greedy_only):
    """One prompt at a time: each prompt chunk runs as a one-sequence prefill graph padded to
    16 / 32 / 64 tokens (the padding after the chunk must not touch its KV or its logits), also
    past a prefix-cache hit (the chunk starts mid-sequence) and in 16-token chunks."""
    prompts, params = workload(2)
    if greedy_only:
        params = [
            SamplingParams(
                temperature=0,
                max_tokens=p.max_tokens,
                ignore_eos=p.ignore_eos,
                stop_token_ids=p.stop_token_ids,
            )
            for p in params
        ]
    prompts = prompts[:6] + [prompts[0] + prompts[1]]  # the last one hits prompt 0's blocks
    for budget in (8192, 16):
        eager = make_llm(model_dir, max_num_batched_tokens=budget)
        llm = with_replayed_graphs(make_llm(model_dir, max_num_batched_tokens=budget))
        for prompt, p in zip(prompts, params):
            got, want = outputs(llm, [prompt], [p]), outputs(eager, [prompt], [p])
            assert got[0][:2] == want[0][:2]
            for a, b in zip(got[0][2] or [], want[0][2] or []):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
        replays = sum(g.num_replays for g in llm.engine.runner.prefill_graphs.values())
        assert replays >= len(prompts)
        assert llm.engine.runner.prefill_graphs[16].num_replays > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_graphs_give_the_eager_outputs(model_dir, overlap):
    """A long prompt chunked beside decoding sequences runs as mixed graphs (decode rows padded
    to 1 / 2 / 4 / 7, the chunk to 16 / 32 tokens): the decode rows' tokens gathered from the
    step before, the padding touching no one's KV, the chunk's last token sampled."""
    rng = random.Random(4)
    prompts = [[rng.randrange(8, VOCAB) for _ in range(n)] for n in (5, 3, 6, 4, 2, 160)]
    params = [
        SamplingParams(
            temperature=0 if i % 2 else 0.8, seed=i, max_tokens=40 - 5 * i, ignore_eos=True
        )
        for i in range(6)
    ]
    kw = dict(max_num_batched_tokens=32, max_num_seqs=8, async_scheduling=overlap)
    want = outputs(make_llm(model_dir, **kw), prompts, params)
    llm = with_replayed_graphs(make_llm(model_dir, **kw))
    assert outputs(llm, prompts, params) == want
    mixed = llm.engine.runner.mixed_graphs
    assert sorted(mixed) == [16, 32] and mixed[32].sizes == [1, 2, 4, 7]
    assert mixed[32].num_replays >= 4 and mixed[16].num_replays >= 1
    decode = llm.engine.runner.graphs  # one logits buffer for all (V floats a row each)
    assert all(g.logits is decode.logits and g.buffer is decode.buffer for g in mixed.values())


def recorded_mixed_keys(llm) -> list[tuple[int, int]]:
    """Filled with the split counts (decode rows', chunk's) of each mixed-graph step run."""
    used = []
    for g in llm.engine.runner.mixed_graphs.values():
        run = g._run
        g._run = lambda *key, run=run: (used.append(key[2]), run(*key))[1]
    return used


def test_mixed_graphs_take_a_long_decode_row_s_split_count(model_dir, monkeypatch):
    """A decode row whose context would take a long row's split count (decode_num_splits; here
    a stand-in: 4 splits past 100 keys, since the CPU has none) decodes while another prompt is
    chunked: those mixed steps replay the graphs of that count, the others the GPU-filling one,
    with the eager steps' outputs."""
    from tinyserve.runner import graph_shapes

    monkeypatch.setattr(
        graph_shapes,
        "decode_num_splits",
        lambda n, m, h, length, dev, ctx=None: 4 if ctx and ctx > 100 else 1,
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(8, VOCAB) for _ in range(n)] for n in (5, 3, 130, 160)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(max_num_batched_tokens=32, max_num_seqs=8)
    want = outputs(make_llm(model_dir, **kw), prompts, [params] * 4)
    llm = with_replayed_graphs(make_llm(model_dir, **kw))
    for g in llm.engine.runner.mixed_graphs.values():
        assert {key[2][0] for key in g.keys(4)} == {1, 4}
    used = recorded_mixed_keys(llm)
    assert outputs(llm, prompts, [params] * 4) == want
    decode_splits = {decode for decode, _ in used}
    assert 4 in decode_splits and 1 in decode_splits, used


def test_mixed_graphs_split_the_chunk_s_keys_by_the_chunk_alone(model_dir, monkeypatch):
    """A mixed graph's chunk runs its own attention kernel beside the decode rows', so its key
    splits follow the padded chunk alone (a stand-in rule here: 8 splits for a lone chunk past
    100 keys, 1 for anything counted with decode rows): the late chunks of the long prompt
    replay the split graphs, with the eager steps' outputs."""
    from tinyserve.runner import graphs

    monkeypatch.setattr(
        graphs,
        "prefill_num_splits",
        lambda q, c, *a, **kw: graphs.MIXED_SPLITS if len(q) == 1 and c[0] > 100 else 1,
    )
    rng = random.Random(6)
    prompts = [[rng.randrange(8, VOCAB) for _ in range(n)] for n in (5, 3, 200)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(max_num_batched_tokens=32, max_num_seqs=8)
    want = outputs(make_llm(model_dir, **kw), prompts, [params] * 3)
    llm = with_replayed_graphs(make_llm(model_dir, **kw))
    used = recorded_mixed_keys(llm)
    assert outputs(llm, prompts, [params] * 3) == want
    chunk_splits = {chunk for _, chunk in used}
    assert graphs.MIXED_SPLITS in chunk_splits and 1 in chunk_splits, used
