"""MTP drafts: the paged MTP head drafts what a from-scratch computation does, and the
verify-graph path (replayed eagerly on the CPU) gives the eager steps' outputs."""

from __future__ import annotations

import pytest
from spec_helpers import make_llm, prompts, reference_drafts, run, traced

from tinyserve import SamplingParams


@pytest.mark.parametrize("k,caching,budget", [(1, False, 8192), (3, True, 8192), (2, True, 8)])
def test_mtp_drafts_equal_a_from_scratch_computation(mimo_dir, k, caching, budget):
    """The paged MTP KV (chunked prefill, prefix hits keyed on the next token, rollback of
    rejected slots, chained lookahead) gives the same drafts as recomputing from scratch."""
    # The synchronous loop: the host holds each step's drafts (the overlapped loop keeps them on
    # the device; test_spec_overlap.py compares the two loops' acceptance).
    llm = make_llm(
        mimo_dir,
        speculative_method="mtp",
        num_speculative_tokens=k,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        async_scheduling=False,
    )
    engine = llm.engine
    for i, p in enumerate(prompts(4)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:
            if s.draft_ids:
                want = reference_drafts(engine.runner.model, s.token_ids, k)
                assert s.draft_ids == want[: len(s.draft_ids)]
                checked += 1
    assert checked > 20
    if caching:
        assert engine.pool.trie.num_hit_tokens > 0


def with_replayed_verify_graphs(llm):
    """The runner's graph path for MTP steps on the CPU: decode and verify DecodeGraphs with
    capture=False (their static-buffer forwards run eagerly), and the verify set's drafting
    run on the same static buffers after each replay, as the GPU's drafting graph is."""
    from tinyserve.runner.draft_graphs import DraftGraphs
    from tinyserve.runner.graphs import DecodeGraphs

    r = llm.engine.runner
    args = (r.model, r.config.max_num_seqs, r.max_blocks_per_seq, r.num_kv_blocks, r.block_size)
    r.graphs = DecodeGraphs(*args, capture=False)
    r.verify_graphs = DecodeGraphs(
        *args, query_len=r.config.num_speculative_tokens + 1, capture=False
    )
    r.draft_graphs = DraftGraphs(r.verify_graphs, r.drafter.draft_tokens, r.graphs.last_sampled)
    return llm


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize(("k", "force"), [(1, None), (3, None), (3, 2), (2, 0)])
def test_verify_graph_path_gives_the_eager_outputs(mimo_dir, reference, overlap, k, force):
    """MTP steps through the verify graphs and their drafting (padded to the graph sizes, the
    previous step's drafts shifted into the static inputs, the graph's own argmax as the
    greedy tokens): the eager steps' outputs, with acceptance free or forced."""
    kw = dict(
        speculative_method="mtp",
        num_speculative_tokens=k,
        spec_force_accept=force,
        async_scheduling=overlap,
        max_num_seqs=8,
    )
    want = reference if force is None else run(make_llm(mimo_dir, **kw), prompts())
    llm = with_replayed_verify_graphs(make_llm(mimo_dir, **kw))
    assert run(llm, prompts()) == want
    assert llm.engine.runner.verify_graphs.num_replays > 5  # 40 tokens, 3 a step when forced
    assert llm.engine.spec.stats.num_accepted_tokens > 0 or force == 0


@pytest.mark.parametrize("k", [1, 2])
def test_verify_graph_extras_are_aligned_and_apart_from_the_inputs(mimo_dir, k):
    """Each size's extra arrays (drafts, limits, shift entries) start 16-byte aligned (Triton
    specializes kernels on it: a misaligned view would compile a variant), after the size's
    inputs and inside the buffer, at the largest shift the step can carry."""
    llm = with_replayed_verify_graphs(
        make_llm(mimo_dir, speculative_method="mtp", num_speculative_tokens=k, max_num_seqs=7)
    )
    v = llm.engine.runner.verify_graphs
    q = k + 1
    for bs in v.sizes:
        sizes = [bs * q, bs] + [bs * q] * 6
        views = v.extra_views(bs, sizes)
        inputs_end = v.fields(bs)[-1].data_ptr() + 8  # the layout's last words
        assert all(t.data_ptr() % 16 == 0 for t in views)
        assert views[0].data_ptr() >= inputs_end - 8
        assert views[-1].data_ptr() + 8 * sizes[-1] <= v.buffer.data_ptr() + 8 * len(v.buffer)


def test_verify_graph_hidden_states_land_in_the_sets_one_buffer(mimo_dir):
    """Every verify replay (any size, any split count) leaves its hidden states in the set's
    `hidden` buffer, which the size's one drafting graph reads: the model writes them there."""
    llm = with_replayed_verify_graphs(
        make_llm(mimo_dir, speculative_method="mtp", num_speculative_tokens=1, max_num_seqs=8)
    )
    run(llm, prompts())
    v = llm.engine.runner.verify_graphs
    assert v.outputs  # replays ran
    for key, (hidden, _) in v.outputs.items():
        assert hidden.data_ptr() == v.hidden.data_ptr() and len(hidden) == key[0] * 2


@pytest.mark.parametrize("force", [None, 1])
def test_verify_graph_path_samples_seeded_rows_as_the_eager_steps(mimo_dir, force):
    """Seeded sampled rows through the verify graphs in the overlapped loop: sampled outside
    the graph (their RNG counters moved by the step in flight's shift entries, which come to
    the device with the graph's inputs), then drafted in the drafting graph. The eager steps'
    tokens, with acceptance free (then also plain decoding's) or forced."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True)
    ps = prompts(4, seed=1)
    kw = dict(
        speculative_method="mtp", num_speculative_tokens=2, max_num_seqs=8, spec_force_accept=force
    )
    want = run(make_llm(mimo_dir, **kw), ps, params)
    if force is None:
        assert want == run(make_llm(mimo_dir), ps, params)
    llm = with_replayed_verify_graphs(make_llm(mimo_dir, **kw))
    trace = traced(llm)
    assert run(llm, ps, params) == want
    assert trace["from_device"] > 5
    assert llm.engine.runner.verify_graphs.num_replays > 5
    assert (llm.engine.spec.stats.num_accepted_tokens > 0) == (force == 1)
