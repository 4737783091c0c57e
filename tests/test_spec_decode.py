"""Speculative decoding end to end on a tiny random MiMo (CPU, fp32): verification is
lossless (greedy and seeded outputs equal speculation off, under chunking, preemption,
stops and forced acceptance), and the rejection rule samples the target distribution.
The n-gram, MTP, overlapped-loop and token-map specifics live in test_spec_*.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from spec_helpers import VOCAB, make_llm, prompts, run

from tinyserve import LLM, SamplingParams
from tinyserve.config import InvalidConfig
from tinyserve.kernels.spec_accept import accept_drafts_ref
from tinyserve.sample.sampler import SamplingRow, SamplingTensors, sample


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
