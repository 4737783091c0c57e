"""The runner's CUDA graph sets: the ones it captures at start-up (decode, the speculative verify
step and its MTP drafting, prompt chunks alone and beside decode rows), and the one set that runs
a step (`graphs_for`; None: the step runs eagerly). Every function takes the ModelRunner
(duck-typed, as warmup.py does) and sets or reads its `graphs`, `verify_graphs`,
`draft_graphs`, `prefill_graphs` and `mixed_graphs`."""

from __future__ import annotations

from tinyserve.runner.draft_graphs import DraftGraphs
from tinyserve.runner.graph_shapes import prefill_graph_lengths
from tinyserve.runner.graphs import DecodeGraphs
from tinyserve.runner.step_inputs import HostInputs


def capture_graphs(runner) -> None:
    """Every graph set of a CUDA runner without `enforce_eager`, captured."""
    config, is_hybrid = runner.config, runner.is_hybrid
    args = (
        runner.model,
        config.max_num_seqs,
        runner.max_blocks_per_seq,
        runner.num_kv_blocks,
        runner.block_size,
    )
    runner.graphs = DecodeGraphs(
        *args,
        # (cascade decode graphs with state inputs are not tried on a GPU yet)
        shared_prefix=config.enable_prefix_caching and not is_hybrid,
        max_chunk=max_graph_chunk(runner),
        state_scratch=runner.state_scratch if is_hybrid else None,
    )
    capture_prefill_graphs(runner, capture=True)
    # The verify step: last token + k drafts (hybrid models: with per-token states)
    if config.speculative_method is not None:
        q = config.num_speculative_tokens + 1
        runner.verify_graphs = DecodeGraphs(
            *args,
            query_len=q,
            pool=runner.graphs.pool,
            state_scratch=runner.state_scratch if is_hybrid else None,
        )
        if runner.drafter is not None:  # the MTP head's drafts after a verify replay, too
            runner.draft_graphs = DraftGraphs(
                runner.verify_graphs, runner.drafter.draft_tokens, runner.graphs.last_sampled
            )


def max_graph_chunk(runner) -> int:
    """The longest prompt chunk with graphs (0: none; not with MTP, whose drafting reads every
    row's inputs, nor for hybrid models yet)."""
    lengths = prefill_graph_lengths(runner.config.max_num_batched_tokens)
    return 0 if runner.mtp is not None or runner.is_hybrid or not lengths else lengths[-1]


def capture_prefill_graphs(runner, capture: bool) -> None:
    """Prompt-chunk graphs: one sequence's chunk, and a chunk beside decode rows (a long prompt
    chunked while others decode). Launched kernel by kernel such a forward is host-bound: a
    32-token prompt of a 0.6B model waits 15-21 ms for ~1.2 ms of GPU work."""
    if not max_graph_chunk(runner):
        return
    config = runner.config
    pool = runner.graphs.pool if capture else None
    args = (runner.model, 1, runner.max_blocks_per_seq, runner.num_kv_blocks, runner.block_size)
    for q in reversed(prefill_graph_lengths(config.max_num_batched_tokens)):
        g = DecodeGraphs(*args, query_len=q, pool=pool, capture=capture, prefill=True)
        pool = g.pool if capture else None
        runner.prefill_graphs[q] = g
        if config.max_num_seqs > 1:
            g = DecodeGraphs(
                runner.model,
                config.max_num_seqs,
                *args[2:],
                query_len=q,
                pool=pool,
                capture=capture,
                mixed=True,
                share=runner.graphs,
            )
            pool = g.pool if capture else None
            runner.mixed_graphs[q] = g
    runner.prefill_graphs = dict(sorted(runner.prefill_graphs.items()))  # shortest first
    runner.mixed_graphs = dict(sorted(runner.mixed_graphs.items()))
    if capture:
        runner.graphs.pool = pool


def graphs_for(runner, h: HostInputs) -> DecodeGraphs | None:
    """The graph set that runs this step, or None (eager): decode-only batches, and verify
    steps where every row runs k drafts."""
    graphs = runner.graphs
    # Prompt logprobs read the hidden state of every scored position: eager.
    if graphs is None or h.prompt_idx or not graphs.can_run(len(h.q_lens)):
        return None
    if all(n == 1 for n in h.q_lens):
        return graphs
    # Padding tokens sit after a prompt chunk: their positions must stay inside the table.
    limit = runner.max_blocks_per_seq * runner.block_size
    if len(h.q_lens) == 1 and not h.dst and not h.spec:  # one prompt chunk
        q = next((q for q in runner.prefill_graphs if q >= h.q_lens[0]), None)
        if q is not None and h.ctx_lens[0] + q - h.q_lens[0] <= limit:
            return runner.prefill_graphs[q]
    d = len(h.q_lens) - 1  # decode rows, then one chunk that is the last row
    if runner.mixed_graphs and d and h.q_lens[d] > 1 and not h.spec and d == h.q_lens.count(1):
        q = next((q for q in runner.mixed_graphs if q >= h.q_lens[d]), None)
        # The decode rows all sample (logits rows 0..d-1: the first d of an ascending list).
        samples = len(h.logits_idx) >= d and h.logits_idx[d - 1] == d - 1
        if q is not None and samples and h.ctx_lens[d] + q - h.q_lens[d] <= limit:
            return runner.mixed_graphs[q]
    v = runner.verify_graphs
    if v is not None and len(set(h.q_lens)) == 1 and h.q_lens[0] == v.query_len:
        if len(h.logits_idx) == len(h.input_ids) and not h.dst:
            return v
    return None
