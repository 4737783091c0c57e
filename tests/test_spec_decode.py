"""Speculative decoding: lossless verification, KV rollback and commits, MTP drafts.

Tiny random MiMo-shaped models (CPU, fp32) keep these fast; the n-gram path also runs on the
real SmolLM2 in test_spec_smollm2.py.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from tinyserve import LLM, SamplingParams
from tinyserve.config import InvalidConfig
from tinyserve.core.sequence import PLACEHOLDER
from tinyserve.kernels.spec_accept import accept_drafts_ref
from tinyserve.model.layers.attention import forward_context
from tinyserve.sample.sampler import SamplingRow, SamplingTensors, sample
from tinyserve.spec.ngram import NgramProposer

VOCAB = 96
CONFIG = dict(
    architectures=["MiMoForCausalLM"],
    model_type="mimo",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    num_nextn_predict_layers=1,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


def make_llm(path, **kw):
    """The overlapped loop unless a test says otherwise (on the CPU it is off by default)."""
    kw = (
        dict(
            dtype="float32",
            device="cpu",
            load_format="dummy",
            seed=3,
            block_size=4,
            async_scheduling=True,
        )
        | kw
    )
    kw["num_kv_blocks"] = kw.get("num_kv_blocks") or 512  # not the 4 GiB CPU default per engine
    return LLM(path, **kw)


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(24)]
    # repeated spans make n-gram drafts hit; a shared head exercises the prefix trie
    return [base[:12] + base[: 5 + 3 * i] + [rng.randrange(VOCAB)] for i in range(n)]


def run(llm, ps, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(ps, params, use_tqdm=False)
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(mimo_dir):
    return run(make_llm(mimo_dir), prompts())


class Oracle:
    """Test-only proposer: drafts the reference continuation (100% acceptance)."""

    def __init__(self, k: int, conts: dict[tuple, list[int]]) -> None:
        self.k, self.conts = k, conts

    def propose(self, token_ids: list[int]) -> list[int]:
        for prompt, cont in self.conts.items():
            n = len(prompt)
            if tuple(token_ids[:n]) == prompt:
                done = len(token_ids) - n
                return cont[done : done + self.k]
        raise AssertionError("unknown sequence")


class RandomProposer:
    """Drafts the reference token with probability 1/2, else a random one: partial acceptance."""

    def __init__(self, k: int, oracle: Oracle, seed: int = 0) -> None:
        self.k, self.oracle, self.rng = k, oracle, random.Random(seed)

    def propose(self, token_ids: list[int]) -> list[int]:
        good = self.oracle.propose(token_ids)
        return [t if self.rng.random() < 0.5 else self.rng.randrange(VOCAB) for t in good]


# -- units ---------------------------------------------------------------------------------------


def test_ngram_proposer_takes_the_most_recent_match():
    p = NgramProposer(k=3, max_n=3, min_n=2)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]
    assert p.propose([5, 6, 7, 8]) == []  # no earlier occurrence
    assert p.propose([4, 4, 4, 4]) == [4]  # the most recent match, cut at the end
    assert p.propose([1]) == []


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs / probs.sum() * counts.sum()
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    # P(X > chi2) for X ~ chi-square(df): the regularized upper incomplete gamma function
    df = torch.tensor((keep.sum() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, torch.tensor(chi2 / 2, dtype=torch.float64)).item()


def test_rejection_sampling_matches_the_target_distribution():
    """20k verify rows, each drafting token 2 against a fixed target p: the emitted token is
    distributed as p (chi-square), the draft is accepted with probability p(2), and a rejected
    row emits from normalize(max(p - delta_2, 0))."""
    V, N, draft = 8, 20_000, 2
    logits = torch.tensor([1.0, 0.2, 0.6, -1.0, 0.0, 1.4, -0.5, 0.3])
    params = SamplingParams(temperature=0.8)
    # Row 2i verifies the draft (step 0), row 2i+1 is the bonus position (step 1).
    rows = [SamplingRow(params, seed, [], [], step=j) for seed in range(N) for j in (0, 1)]
    sampled = sample(logits.repeat(2 * N, 1), SamplingTensors.build(rows, V, "cpu")).token_ids
    draft_next = torch.tensor([draft, -1]).repeat(N)
    acc = accept_drafts_ref(sampled, draft_next, torch.arange(0, 2 * N, 2))
    first = sampled[0::2]  # the emitted token: the accepted draft, or the replacement
    assert torch.equal(acc == 1, first == draft)
    p = torch.softmax(logits / 0.8, -1).double().numpy()
    assert chi2_pvalue(np.bincount(first.numpy(), minlength=V), p) > 0.01
    assert abs(acc.double().mean().item() - p[draft]) < 4 * np.sqrt(p[draft] / N)
    residual = p.copy()
    residual[draft] = 0.0  # max(p - q, 0) with q = delta_draft
    rejected = first[acc == 0].numpy()
    assert chi2_pvalue(np.bincount(rejected, minlength=V), residual) > 0.01


def test_config_errors():
    with pytest.raises(InvalidConfig, match="speculative_method"):
        LLM(None, speculative_method="eagle")
    with pytest.raises(InvalidConfig, match="num_speculative_tokens"):
        LLM(None, speculative_method="ngram")
    with pytest.raises(InvalidConfig, match="spec_force_accept"):
        LLM(None, speculative_method="ngram", num_speculative_tokens=2, spec_force_accept=3)


# -- lossless end to end ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,k,caching,budget,blocks",
    [
        ("ngram", 3, True, 8192, None),
        ("ngram", 5, False, 16, None),
        ("mtp", 1, True, 8192, None),
        ("mtp", 2, False, 8192, None),
        ("mtp", 3, True, 16, None),
        ("mtp", 3, False, 64, None),
        ("mtp", 2, True, 64, 24),
        ("ngram", 3, True, 64, 24),
    ],
)
def test_greedy_identical_to_no_speculation(
    mimo_dir, reference, method, k, caching, budget, blocks
):
    llm = make_llm(
        mimo_dir,
        speculative_method=method,
        num_speculative_tokens=k,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        num_kv_blocks=blocks,
    )
    assert run(llm, prompts()) == reference
    assert llm.engine.spec.stats.num_draft_tokens > 0
    if blocks:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("caching", [True, False])
def test_oracle_accepts_everything_across_block_boundaries(mimo_dir, reference, caching):
    k = 9  # 10 tokens per step with block_size 4: each step crosses two or more boundaries
    llm = make_llm(
        mimo_dir,
        speculative_method="ngram",
        num_speculative_tokens=k,
        enable_prefix_caching=caching,
    )
    ps = prompts()
    llm.engine.spec.proposer = Oracle(k, {tuple(p): c for p, c in zip(ps, reference)})
    seen = []
    real_step = llm.engine.step

    def step():
        before = {s.seq_id: len(s.block_table) for s in llm.engine.scheduler.running}
        out = real_step()
        for s in llm.engine.scheduler.running:
            if s.seq_id in before and s.num_draft_tokens:
                seen.append(len(s.block_table) - before[s.seq_id])
        llm.engine.check_invariants()
        return out

    llm.engine.step = step
    assert run(llm, ps) == reference
    stats = llm.engine.spec.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert max(seen) >= 2  # a step's accepted tokens crossed two block boundaries


def test_random_proposer_partial_acceptance_with_sampling(mimo_dir):
    """Seeded sampling: the same tokens with and without speculation (per-position RNG)."""
    params = SamplingParams(
        temperature=0.9, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True, presence_penalty=0.5
    )
    ps = prompts(4, seed=1)
    ref = run(make_llm(mimo_dir), ps, params)
    llm = make_llm(mimo_dir, speculative_method="ngram", num_speculative_tokens=4)
    llm.engine.spec.proposer = RandomProposer(4, Oracle(4, {tuple(p): c for p, c in zip(ps, ref)}))
    assert run(llm, ps, params) == ref
    stats = llm.engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_stop_and_max_tokens_inside_accepted_drafts(mimo_dir, reference):
    """Accepted drafts past a stop token or max_tokens are dropped; the stop string logic runs
    per token."""
    ps = prompts()
    stop_tok = reference[0][7]
    params = SamplingParams(
        temperature=0, max_tokens=13, ignore_eos=True, stop_token_ids=[stop_tok]
    )
    want = run(make_llm(mimo_dir), ps, params)
    llm = make_llm(mimo_dir, speculative_method="ngram", num_speculative_tokens=6)
    llm.engine.spec.proposer = Oracle(6, {tuple(p): c for p, c in zip(ps, reference)})
    assert run(llm, ps, params) == want
    assert want[0][-1] == stop_tok and all(len(w) <= 13 for w in want)


def test_forced_acceptance_emits_the_drafts(mimo_dir):
    """Benchmark switch: exactly f drafts accepted per step (the outputs are the drafts')."""
    llm = make_llm(
        mimo_dir, speculative_method="mtp", num_speculative_tokens=3, spec_force_accept=2
    )
    got = run(llm, prompts(2))
    s = llm.engine.spec.stats
    assert s.num_accepted_tokens == 2 * s.num_drafts
    # f = 0: every step emits the target's own token, so the outputs are the model's
    zero = make_llm(
        mimo_dir, speculative_method="mtp", num_speculative_tokens=3, spec_force_accept=0
    )
    assert run(zero, prompts(2)) == run(make_llm(mimo_dir), prompts(2)) != got


# -- the verify-graph path on the CPU --------------------------------------------------------------


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


# -- the overlapped loop with MTP --------------------------------------------------------------


def traced(llm):
    """Record per sequence each verify's (drafted, accepted), count the launches that took a
    token from the step in flight, and check the invariants after every step."""
    engine = llm.engine
    trace = {"verifies": {}, "from_device": 0}
    real_launch, real_step = engine.runner.launch, engine.step
    for_seq = {}

    def launch(batch, rows, prev=None):
        trace["from_device"] += any(s.token_ids[-1] == PLACEHOLDER for s in batch.seqs)
        return real_launch(batch, rows, prev)

    def step():
        before = {
            s.seq_id: (s.num_draft_tokens, s.num_accepted_tokens)
            for r in engine.requests.values()
            for s in r.seqs
        }
        out = real_step()
        for r in engine.requests.values():
            for s in r.seqs:
                d0, a0 = before.get(s.seq_id, (0, 0))
                if s.num_draft_tokens > d0:
                    for_seq.setdefault(s.seq_id, []).append(
                        (s.num_draft_tokens - d0, s.num_accepted_tokens - a0)
                    )
        engine.check_invariants()
        return out

    engine.runner.launch, engine.step = launch, step
    trace["verifies"] = for_seq
    return trace


def check_mtp_drafts(llm, k: int) -> list[int]:
    """Compare each step's MTP drafts (read on the device side) with a from-scratch
    computation over the tokens that step confirmed, away from the length limits."""
    engine, real = llm.engine, llm.engine._post_process
    checked = [0]

    def post(step, deltas):
        seqs = [step.batch.seqs[i] for i in step.sampled]
        real(step, deltas)
        if not seqs:
            return  # a step of prompt chunks only: nothing sampled, nothing drafted
        for seq, drafts in zip(seqs, step.pending.drafts.tolist()):
            tokens = [t for t in seq.token_ids if t != PLACEHOLDER]
            if not seq.is_finished and len(tokens) + 3 * k < seq.num_prompt_tokens + seq.max_tokens:
                assert drafts == reference_drafts(engine.runner.model, tokens, k)
                checked[0] += 1

    engine._post_process = post
    return checked


@pytest.mark.parametrize(
    "k,caching,budget,blocks",
    [(1, True, 8192, None), (3, True, 16, None), (2, False, 64, None), (3, True, 64, 24)],
)
def test_overlapped_mtp_loop_equals_the_synchronous_one(
    mimo_dir, reference, k, caching, budget, blocks
):
    """Greedy MTP rows overlap: the next step takes its last token, its drafts and how far its
    positions move from the step in flight, on the device. Same tokens as without speculation
    and the same drafts as the synchronous loop (so the same acceptance), also under
    preemption."""
    kw = dict(
        speculative_method="mtp",
        num_speculative_tokens=k,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        num_kv_blocks=blocks,
    )
    sync, ov = make_llm(mimo_dir, async_scheduling=False, **kw), make_llm(mimo_dir, **kw)
    t_sync, t_ov = traced(sync), traced(ov)
    checked = check_mtp_drafts(ov, k)
    assert run(sync, prompts()) == run(ov, prompts()) == reference
    assert checked[0] > 50
    assert t_ov["from_device"] > 10 and t_sync["from_device"] == 0
    for seq_id, want in t_sync["verifies"].items():
        got = t_ov["verifies"][seq_id]
        # The overlapped loop drafts fewer near max_tokens (a step in flight may still accept
        # some): compare up to the first verify that differs in size.
        same = next(
            (i for i, (g, w) in enumerate(zip(got, want)) if g[0] != w[0]), min(len(got), len(want))
        )
        assert same > 3 and got[:same] == want[:same], seq_id
    if blocks:
        assert ov.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("f", [1, 3])
def test_overlapped_loop_moves_positions_by_the_accepted_drafts(mimo_dir, f):
    """Forced acceptance: every step accepts f drafts, so every next step's positions, slots and
    context lengths move on the device by f. The tokens equal the synchronous loop's until
    the last few, where the overlapped loop drafts less."""
    kw = dict(speculative_method="mtp", num_speculative_tokens=3, spec_force_accept=f)
    sync, ov = make_llm(mimo_dir, async_scheduling=False, **kw), make_llm(mimo_dir, **kw)
    t_ov, checked = traced(ov), check_mtp_drafts(ov, 3)
    want, got = run(sync, prompts()), run(ov, prompts())
    assert t_ov["from_device"] > 5 and checked[0] > 20
    for g, w in zip(got, want):
        assert len(g) == len(w) == GREEDY.max_tokens and g[:-8] == w[:-8]


def test_min_tokens_request_switches_the_mtp_loop_to_synchronous(mimo_dir, reference):
    """A min_tokens request (its stop mask reads the emitted count on the host) makes the
    engine drain the step in flight and run synchronously; greedy outputs do not change, and
    that request equals its output without speculation."""
    sampled = SamplingParams(temperature=0.8, seed=4, max_tokens=20, min_tokens=5)
    extra = [5, 6, 7, 8, 9]
    want = run(make_llm(mimo_dir), [extra], sampled)[0]
    llm = make_llm(mimo_dir, speculative_method="mtp", num_speculative_tokens=2)
    trace = traced(llm)
    engine = llm.engine
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, GREEDY)
    got: dict[str, list[int]] = {}
    for n in range(1000):
        if not engine.has_unfinished():
            break
        if n == 6:
            engine.add_request("s", extra, sampled)
        for d in engine.step():  # a drain and a step in one call: two outputs per request
            for o in d.outputs:
                got.setdefault(d.request_id, []).extend(o.token_ids)
    assert trace["from_device"] > 3
    assert [got[str(i)] for i in range(len(reference))] == reference
    assert got["s"] == want
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("force", [None, 2])
def test_seeded_sampling_overlaps_with_mtp(mimo_dir, force):
    """Seeded sampled rows stay in the overlapped loop: their RNG counter moves on the device
    by the accepted drafts. Without forcing, the tokens equal plain decoding's (lossless);
    forced to accept 2 of 3 drafts, every step moves the counter and the tokens equal the
    synchronous loop's but for the last few (the overlapped loop drafts less there)."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True)
    ps = prompts(4, seed=1)
    kw = dict(speculative_method="mtp", num_speculative_tokens=3, spec_force_accept=force)
    ov = make_llm(mimo_dir, **kw)
    trace = traced(ov)
    got = run(ov, ps, params)
    assert trace["from_device"] > 5
    want = run(make_llm(mimo_dir, async_scheduling=False, **kw), ps, params)
    if force is None:
        assert got == want == run(make_llm(mimo_dir), ps, params)
    else:
        assert all(g[:-8] == w[:-8] for g, w in zip(got, want))
        assert got != run(make_llm(mimo_dir), ps, params)  # the drafts' tokens, not plain ones


def test_abort_and_stop_while_an_mtp_step_is_in_flight(mimo_dir, reference):
    """An abort lands while the aborted row's verify step is in flight, and a stop token ends
    a row whose next step was already launched: the others' tokens never change, the stopped
    row ends at its stop token, and no block leaks."""
    stop = reference[2][9]
    llm = make_llm(mimo_dir, speculative_method="mtp", num_speculative_tokens=3)
    trace, engine = traced(llm), llm.engine
    stopping = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, stopping if i == 2 else GREEDY)
    got: dict[str, list[int]] = {}
    reasons = {}
    for n in range(1000):
        if not engine.has_unfinished():
            break
        if n == 8:
            assert engine._in_flight is not None
            engine.abort("0")
        for d in engine.step():
            for o in d.outputs:
                got.setdefault(d.request_id, []).extend(o.token_ids)
                reasons[d.request_id] = o.finish_reason or reasons.get(d.request_id)
    assert trace["from_device"] > 5
    assert reasons["0"] == "abort" and reference[0][: len(got["0"])] == got["0"]
    cut = reference[2].index(stop) + 1
    assert got["2"] == reference[2][:cut] and reasons["2"] == "stop"
    assert all(got[str(i)] == reference[i] for i in (1, 3, 4, 5))
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


# -- MTP drafts are exact -------------------------------------------------------------------------


def reference_drafts(
    model, tokens: list[int], k: int, allowed: list[int] | None = None
) -> list[int]:
    """MTP drafts for a sequence computed from scratch with plain causal attention (no paged KV):
    entry i pairs the target hidden h_i with token t_{i+1}; a chained entry pairs the previous
    entry's output with the draft it produced. `allowed`: the argmax over those ids only."""
    mtp = model.mtp
    with torch.inference_mode(), forward_context(None):
        attn = [m for m in model.modules() if hasattr(m, "k_cache")]
        saved = [(m.k_cache, m.v_cache) for m in attn]
        for m in attn:
            m.k_cache = m.v_cache = None
        try:
            n = len(tokens) - 1
            ids = torch.tensor(tokens)
            hidden = model(ids[:n], torch.arange(n))
            if mtp.layout.normed_hidden:
                hidden = model.model.norm(hidden)
            ts, drafts = tokens[1:], []
            for _ in range(k):
                out = mtp(torch.tensor(ts), hidden, torch.arange(len(ts)), target_hidden=False)
                logits = mtp.compute_logits(out[-1:])[0]
                if allowed is None:
                    drafts.append(int(logits.argmax()))
                else:
                    drafts.append(allowed[int(logits[allowed].argmax())])
                ts.append(drafts[-1])
                hidden = torch.cat([hidden, out[-1:]])
            return drafts
        finally:
            for m, (kc, vc) in zip(attn, saved):
                m.k_cache, m.v_cache = kc, vc


@pytest.mark.parametrize("k,caching,budget", [(1, False, 8192), (3, True, 8192), (2, True, 8)])
def test_mtp_drafts_equal_a_from_scratch_computation(mimo_dir, k, caching, budget):
    """The paged MTP KV (chunked prefill, prefix hits keyed on the next token, rollback of
    rejected slots, chained lookahead) gives the same drafts as recomputing from scratch."""
    # The synchronous loop: the host holds each step's drafts (the overlapped loop keeps them on
    # the device; the test below compares the two loops' acceptance).
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


# -- a draft token map ----------------------------------------------------------------------------


def write_map(tmp_path, ids, name: str = "map.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(ids))
    return str(path)


def test_token_map_drafts_only_its_ids_and_stays_lossless(mimo_dir, reference, tmp_path):
    """With a token map the MTP head drafts the argmax over the map's ids (a third of the
    vocabulary here, listed in reverse, so a wrong index-to-id mapping shows); verification
    is unchanged, so outputs equal speculation off."""
    hot = list(range(VOCAB - 1, -1, -3))
    token_map = write_map(tmp_path, hot)
    llm = make_llm(
        mimo_dir,
        speculative_method="mtp",
        num_speculative_tokens=2,
        speculative_token_map=token_map,
    )
    assert run(llm, prompts()) == reference
    assert llm.engine.spec.stats.num_draft_tokens > 0

    llm = make_llm(
        mimo_dir,
        speculative_method="mtp",
        num_speculative_tokens=3,
        speculative_token_map=token_map,
        async_scheduling=False,
    )
    engine = llm.engine
    for i, p in enumerate(prompts(3)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    drafted = []
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:
            if s.draft_ids:
                want = reference_drafts(engine.runner.model, s.token_ids, 3, allowed=hot)
                assert s.draft_ids == want[: len(s.draft_ids)]
                drafted += s.draft_ids
    assert len(drafted) > 10 and set(drafted) <= set(hot)


def test_token_map_with_chunks_and_preemption_is_lossless(mimo_dir, reference, tmp_path):
    """A map changes only which drafts the head proposes: chunked prefill (budget 16), KV
    pressure (preemption) and the prefix cache keep speculation-off's tokens."""
    llm = make_llm(
        mimo_dir,
        speculative_method="mtp",
        num_speculative_tokens=3,
        speculative_token_map=write_map(tmp_path, list(range(0, VOCAB, 2))),
        max_num_batched_tokens=16,
        num_kv_blocks=24,
    )
    assert run(llm, prompts()) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.spec.stats.num_draft_tokens > 0


def test_token_map_errors(mimo_dir, tmp_path):
    from tinyserve.spec.token_map import load_token_map

    with pytest.raises(InvalidConfig, match="speculative_token_map: applies to .*mtp"):
        LLM(
            None,
            speculative_method="ngram",
            num_speculative_tokens=2,
            speculative_token_map=write_map(tmp_path, [1]),
        )
    bad = {
        "missing.json": None,
        "text.json": "not json",
        "dict.json": {"ids": [1]},
        "empty.json": [],
        "range.json": [1, VOCAB],
        "negative.json": [-1],
        "bool.json": [True],
        "float.json": [1.5],
        "twice.json": [3, 4, 3],
    }
    for name, content in bad.items():
        if content is not None:
            (tmp_path / name).write_text(
                content if isinstance(content, str) else json.dumps(content)
            )
        with pytest.raises(InvalidConfig, match="speculative_token_map") as e:
            load_token_map(str(tmp_path / name), VOCAB)
        assert name in str(e.value)
    torch.save(torch.tensor([5, 2]), tmp_path / "sglang.pt")  # never unpickled: a pickle runs code
    with pytest.raises(InvalidConfig, match="pickled tensor is not loaded.*JSON list"):
        load_token_map(str(tmp_path / "sglang.pt"), VOCAB)
    assert load_token_map(write_map(tmp_path, [5, 2], "ok.json"), VOCAB).tolist() == [5, 2]
    with pytest.raises(InvalidConfig, match="not a token id"):  # checked before any weights load
        make_llm(
            mimo_dir,
            speculative_method="mtp",
            num_speculative_tokens=1,
            speculative_token_map=write_map(tmp_path, [VOCAB + 5]),
        )


# -- the real model ------------------------------------------------------------------------------

EDIT = (
    "Fix the typos in this text and repeat it in full.\n\nText: The quick brown fox jumpd over "
    "the lazy dog. It was a sunny day and the fox was very hapy. The dog did not care at all, "
    "it kept sleeping under the old oak tree near the river.\n\nFixed text:"
)


@pytest.mark.slow
def test_ngram_on_smollm2_is_lossless_and_served_with_metrics(smollm2_path, smollm2_llm):
    """Greedy n-gram speculation on an edit prompt: same tokens as plain decode, most drafts
    accepted, and the server exports the acceptance counters."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families
    from test_server import serving  # pytest puts tests/ on sys.path (no package)

    params = SamplingParams(temperature=0, max_tokens=48)
    ref = smollm2_llm.chat([{"role": "user", "content": EDIT}], params, use_tqdm=False)[0]
    llm = LLM(
        smollm2_path,
        dtype="float32",
        device="cpu",
        speculative_method="ngram",
        num_speculative_tokens=4,
        num_kv_blocks=256,
    )
    out = llm.chat([{"role": "user", "content": EDIT}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.num_accepted_tokens > out.num_draft_tokens / 3 > 0

    async def scrape():
        async with serving(llm.engine) as client:
            body = {
                "messages": [{"role": "user", "content": EDIT}],
                "max_tokens": 48,
                "temperature": 0,
                "stream": True,
            }
            r = await client.post("/v1/chat/completions", json=body)
            text = await r.text()
            return text, await (await client.get("/metrics")).text()

    stream, metrics = asyncio.run(scrape())
    pieces = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p["choices"])
    assert text == ref.outputs[0].text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    drafted = families["tinyserve:spec_decode_num_draft_tokens"].samples[0].value
    accepted = families["tinyserve:spec_decode_num_accepted_tokens"].samples[0].value
    assert drafted >= accepted > 0
    assert families["tinyserve:spec_decode_mean_accepted_length"].samples[0].value > 1


# -- building a token map ---------------------------------------------------------------------


def word_tokenizer_dir(tmp_path):
    """A word-level tokenizer: <eos> 0 (special), then a..e."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<eos>", "<unk>", "a", "b", "c", "d", "e"])}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tmp_path


def test_build_token_map_takes_specials_the_most_frequent_then_the_lowest_ids(tmp_path):
    from tinyserve.model.tokenizer import Tokenizer
    from tinyserve.spec.token_map import build_token_map

    tok = Tokenizer.from_pretrained(word_tokenizer_dir(tmp_path))
    lines = ["c c c b\n", "d b e\n", "c\n"]  # c 4, b 2, d 1, e 1 (tie: the lower id first)
    assert build_token_map(tok, lines, 4) == [0, 4, 3, 5]
    # the text used 5 ids: the lowest unused ones fill up, to the vocabulary's 7 at most
    assert build_token_map(tok, lines, 99, batch=2) == [0, 4, 3, 5, 6, 1, 2]
    assert build_token_map(tok, lines, 1) == [0]
    assert build_token_map(tok, [], 3) == [0, 1, 2]  # no text: the lowest ids


def test_token_map_command_writes_a_map_the_engine_reads(tmp_path):
    from click.testing import CliRunner

    from tinyserve.cli import main
    from tinyserve.spec.token_map import load_token_map

    model = word_tokenizer_dir(tmp_path)
    (tmp_path / "corpus.txt").write_text("a b a\nb a e\n")
    out = tmp_path / "map.json"
    args = [
        "token-map",
        "--model",
        str(model),
        "--size",
        "3",
        "--out",
        str(out),
        str(tmp_path / "corpus.txt"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert load_token_map(str(out), 7).tolist() == [0, 2, 3]
    bad = CliRunner().invoke(main, ["token-map", "--model", str(tmp_path / "none"), str(out)])
    assert bad.exit_code != 0 and "cannot load the tokenizer" in bad.output


@pytest.mark.parametrize(
    ("method", "k", "max_len"),
    [
        ("mtp", 1, None),
        ("mtp", 3, None),
        ("ngram", 2, None),
        ("mtp", 3, 8),
        ("mtp", 3, 4),
        (None, 0, None),  # an enforce_eager engine's (no speculation: decode rows beside a chunk)
    ],
)
def test_warm_up_steps_write_only_the_scratch_block(mimo_dir, reference, method, k, max_len):
    """Start-up's eager warm-up steps (`warmup.run_eager_steps`; on the GPU they compile the
    kernel variants eager steps take) run the real launch path on sequences of the scratch
    block: every other KV block stays as it was, the pool is untouched, and outputs after them
    are the engine's usual ones. Short context limits take the steps that fit (8 tokens: chunks
    of up to 4), none where a row and its drafts do not fit (4 tokens with k = 3)."""
    from tinyserve.runner.warmup import run_eager_steps

    spec = dict(speculative_method=method, num_speculative_tokens=k) if method else {}
    llm = make_llm(mimo_dir, max_num_seqs=40, max_model_len=max_len, **spec)
    runner = llm.engine.runner
    free = runner.num_kv_blocks
    assert not runner.kv_cache.any()
    run_eager_steps(runner)
    assert not runner.kv_cache[:, :, :-1].any()  # the pool's blocks: never written
    assert runner.kv_cache[:, :, -1].any() == (max_len != 4)  # the scratch block: steps ran
    assert llm.engine.scheduler.pool.num_free_blocks == free
    if max_len is None:
        assert run(llm, prompts()) == reference
