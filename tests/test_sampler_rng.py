"""The sampler's counter-based RNG: the uint64 reference stream, uniformity, tokens
reproducible whatever the batch, and sampled distributions (chi-square) equal to the
target after temperature, penalties and filters."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from sampler_helpers import ref_keep, ref_penalties, rows_for

from tinyserve.sample.sampler import (
    SamplingRow,
    SamplingTensors,
    counter_key,
    counter_uniform,
    sample,
)
from tinyserve.sampling_params import SamplingParams


def _mix64_ref(z: int) -> int:
    m = (1 << 64) - 1
    z &= m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _uniform_ref(seed: int, step: int, v: int) -> float:
    g, m = 0x9E3779B97F4A7C15, (1 << 64) - 1
    key = _mix64_ref(_mix64_ref(seed + g) + (step + 1) * g)
    top = _mix64_ref((key + (v + 1) * g) & m) >> 41  # top 23 bits, unsigned
    signed = top - 2**23 if top >= 2**22 else top
    return (signed + 2**22 + 0.5) / 2**23


def test_counter_uniform_matches_uint64_reference():
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789]
    steps = [0, 7, 1, 1000, 3, 2**20]
    u = counter_uniform(counter_key(torch.tensor(seeds), torch.tensor(steps)), 16)
    for b, (s, k) in enumerate(zip(seeds, steps, strict=True)):
        assert u[b].tolist() == [_uniform_ref(s, k, v) for v in range(16)]


def test_counter_uniform_range_and_moments():
    keys = counter_key(torch.arange(64), torch.zeros(64, dtype=torch.int64))
    u = counter_uniform(keys, 4096).double()
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 3e-3 and abs(u.var() - 1 / 12) < 3e-3
    # Consecutive vocab indices and consecutive seeds are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]) < 0.01


def _step_logits(tag: int, step: int, V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(tag * 1000 + step)
    return torch.randn(V, generator=g) * 2


NEIGHBOURS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, top_p=0.5, logprobs=5, seed=1234),
    SamplingParams(top_k=3, min_p=0.2, presence_penalty=1.0, frequency_penalty=-0.5),
    SamplingParams(temperature=1.5, repetition_penalty=0.7),
]


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    ],
    ids=["plain", "filters", "penalties"],
)
def test_seeded_tokens_independent_of_batch(target):
    """Same seed => same tokens whatever the neighbours, their flags and the row position."""
    V, steps, seed = 300, 8, 1234

    def run(layout: list[int]) -> list[int]:  # layout: neighbour indices, -1 = the target
        outputs = {i: [] for i in range(len(layout))}
        for step in range(steps):
            params = [target if j < 0 else NEIGHBOURS[j] for j in layout]
            seeds = [seed if j < 0 else 99 + j for j in layout]
            prompts = [[1, 2, 3, 5, 8] for _ in layout]
            rows = rows_for(params, seeds, prompts, [outputs[i] for i in range(len(layout))])
            logits = torch.stack([_step_logits(j, step, V) for j in layout])
            ids = sample(logits, SamplingTensors.build(rows, V, "cpu")).token_ids.tolist()
            for i, tok in enumerate(ids):
                outputs[i].append(tok)
        return outputs[layout.index(-1)]

    alone = run([-1])
    assert len(set(alone)) > 1
    assert run([0, 1, -1, 2, 3]) == alone
    assert run([3, 2, 1, 0, 0, 1, -1]) == alone
    assert run([-1, 1]) == alone


def test_different_seeds_differ():
    V = 1000
    logits = torch.zeros(2, V)  # uniform: any two draws collide with probability 1 / V
    p = SamplingParams()
    tokens = []
    for step in range(5):
        rows = rows_for([p, p], seeds=[1, 2], outputs=[[0] * step, [0] * step])
        tokens.append(sample(logits, SamplingTensors.build(rows, V, "cpu")).token_ids.tolist())
    first, second = zip(*tokens, strict=True)
    assert first != second
    assert len(set(first)) > 1  # the step advances the stream


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x) = Q(df/2, x/2), via Q(a + 1, y) = Q(a, y) + y^a e^-y / Gamma(a + 1)."""
    y = x / 2
    a, q = (0.5, math.erfc(math.sqrt(y))) if df % 2 else (1.0, math.exp(-y))
    while a < df / 2:
        q += math.exp(a * math.log(y) - y - math.lgamma(a + 1))
        a += 1
    return q


def test_chi2_sf_known_values():
    for x, df in [(6.635, 1), (9.210, 2), (18.475, 7), (20.090, 8), (37.566, 20)]:
        assert chi2_sf(x, df) == pytest.approx(0.01, rel=2e-3)


def _chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    assert bool(torch.isin(tokens, support.nonzero().flatten()).all())
    counts = torch.bincount(tokens, minlength=len(probs)).double()[support]
    expected = probs.double()[support] * len(tokens)
    assert expected.min() >= 5
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(support.sum()) - 1)


N_DRAWS = 20_000


@pytest.mark.parametrize("vary", ["seeds", "steps"])
def test_distribution_temperature(vary):
    V = 9
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, 1.5, -1.0, 0.8, 0.3])
    p = SamplingParams(temperature=0.7)
    t = SamplingTensors.build(rows_for([p] * N_DRAWS, seeds=list(range(N_DRAWS))), V, "cpu")
    if vary == "steps":  # one seed, 20k consecutive steps
        keys = counter_key(torch.full((N_DRAWS,), 42), torch.arange(N_DRAWS))
        t = dataclasses.replace(t, rng_keys=keys)
    tokens = sample(logits.expand(N_DRAWS, V), t).token_ids
    assert _chi2_pvalue(tokens, torch.softmax(logits.double() / 0.7, -1)) > 0.01


def test_distribution_after_penalties_and_filters():
    V = 12
    logits = torch.tensor([2.0, 1.7, 1.5, 1.2, 1.0, 0.9, 0.5, 0.0, -0.5, -1.0, -2.0, 0.1])
    p = SamplingParams(
        temperature=1.2,
        top_k=9,
        top_p=0.93,
        min_p=0.15,
        repetition_penalty=1.5,
        frequency_penalty=0.3,
        presence_penalty=0.1,
    )
    prompt, output = [0, 7, 8], [1, 1, 3]
    rows = [SamplingRow(p, 1000 + i, prompt, output) for i in range(N_DRAWS)]
    t = SamplingTensors.build(rows, V, "cpu")
    x = ref_penalties(logits, p, prompt, output) / p.temperature
    keep = sorted(ref_keep(x, p.top_k, p.top_p, p.min_p))
    assert 3 <= len(keep) < V  # the filters matter but leave a real distribution
    probs = torch.zeros(V, dtype=torch.float64)
    probs[keep] = torch.softmax(x[keep], -1)
    tokens = sample(logits.expand(N_DRAWS, V), t).token_ids
    assert _chi2_pvalue(tokens, probs) > 0.01
