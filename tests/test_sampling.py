"""Tests for tinyserve.sampling_params (parameter validation) and tinyserve.sample.sampler:
masks and penalties against per-row references, counter-based RNG (reproducibility,
distribution), greedy, logprobs, dtypes."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from tinyserve.sample.sampler import (
    SamplingRow,
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    counter_key,
    counter_uniform,
    sample,
)
from tinyserve.sampling_params import InvalidParameter, SamplingParams

# --------------------------------------------------------------------------- validation

BAD = [
    ("n", 0),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("temperature", -0.1),
    ("temperature", "0.7"),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -1),
    ("top_p", "1"),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_k", "5"),
    ("top_k", None),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", "0.1"),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", False),
    ("frequency_penalty", 3),
    ("frequency_penalty", -3),
    ("frequency_penalty", [0.1]),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("repetition_penalty", math.inf),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("max_tokens", "16"),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("min_tokens", None),
    ("min_tokens", 17),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
    ("logprobs", 1.0),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["a", 3]),
    ("stop", 5),
    ("stop", [None]),
    ("stop", {"a": 1}),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("stop_token_ids", "12"),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", True),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", None),
]


@pytest.mark.parametrize(("param", "value"), BAD)
def test_invalid_parameter_names_field(param, value):
    with pytest.raises(InvalidParameter) as exc:
        SamplingParams(**{param: value})
    assert isinstance(exc.value, ValueError)
    assert exc.value.param == param
    assert param in str(exc.value) and "must be" in str(exc.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidParameter) as exc:
        SamplingParams(min_tokens=20, max_tokens=10)
    assert exc.value.param == "min_tokens"
    SamplingParams(min_tokens=20, max_tokens=None)  # None: the engine resolves the limit


def test_long_values_are_truncated_in_message():
    with pytest.raises(InvalidParameter) as exc:
        SamplingParams(temperature="x" * 1000)
    assert len(str(exc.value)) < 120


def test_valid_params_normalized():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.is_greedy
    p = SamplingParams(temperature=0, top_k=-1, stop="###", stop_token_ids=(2, 3), seed=-7)
    assert p.is_greedy and isinstance(p.temperature, float)
    assert p.top_k == 0 and p.stop == ["###"] and p.stop_token_ids == [2, 3] and p.seed == -7
    edge = SamplingParams(
        top_p=1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-3,
        logprobs=20,
        max_tokens=None,
        stop=("a", "b"),
    )
    assert edge.stop == ["a", "b"] and edge.logprobs == 20 and isinstance(edge.top_p, float)
    assert SamplingParams(logprobs=0).logprobs == 0
    assert not SamplingParams(temperature=1e-4).is_greedy


# --------------------------------------------------------------------------- helpers


def rows_for(params, seeds=None, prompts=None, outputs=None):
    n = len(params)
    seeds = seeds if seeds is not None else list(range(n))
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return [
        SamplingRow(p, s, pr, o)
        for p, s, pr, o in zip(params, seeds, prompts, outputs, strict=True)
    ]


def ref_keep(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Straightforward per-row reference of the top-k -> top-p -> min-p kept set (float64)."""
    x = x.double().tolist()
    order = sorted(range(len(x)), key=lambda v: (-x[v], v))
    if top_k > 0:
        order = order[:top_k]

    def probs(ids):
        m = max(x[v] for v in ids)
        w = {v: math.exp(x[v] - m) for v in ids}
        s = sum(w.values())
        return {v: w[v] / s for v in ids}

    if top_p < 1:
        p, mass, kept = probs(order), 0.0, []
        for v in order:
            if mass >= top_p:
                break
            kept.append(v)
            mass += p[v]
        order = kept
    if min_p > 0:
        p = probs(order)
        p_max = max(p.values())
        order = [v for v in order if p[v] >= min_p * p_max]
    return set(order)


def ref_penalties(x: torch.Tensor, p: SamplingParams, prompt_ids, output_ids) -> torch.Tensor:
    x = x.double().clone()
    for v in set(prompt_ids) | set(output_ids):
        x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
    for v, c in Counter(output_ids).items():
        x[v] -= p.frequency_penalty * c + p.presence_penalty
    return x


FILTERS = [
    dict(top_k=5),
    dict(top_k=1),
    dict(top_k=1000),
    dict(top_p=0.5),
    dict(top_p=0.9),
    dict(top_p=1e-6),
    dict(min_p=0.1),
    dict(min_p=1.0),
    dict(top_k=10, top_p=0.7),
    dict(top_k=20, top_p=0.8, min_p=0.05),
    dict(top_p=0.95, min_p=0.3),
    dict(),
]


def processed(logits, t):
    x = logits / t.temperature[:, None]
    x = apply_top_k_top_p(x, t) if (t.do_top_k or t.do_top_p) else x
    return apply_min_p(x, t) if t.do_min_p else x


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("integer_logits", [False, True], ids=["random", "ties"])
def test_filter_masks_match_reference(integer_logits):
    torch.manual_seed(0)
    V = 64
    params = [SamplingParams(temperature=0.5 + 0.25 * (i % 4), **f) for i, f in enumerate(FILTERS)]
    logits = torch.randn(len(params), V) * 3
    if integer_logits:  # many exact ties: the tie-break (lower index first) must match
        logits = logits.round()
    t = SamplingTensors.build(rows_for(params), V, "cpu")
    kept = torch.isfinite(processed(logits, t))
    for r, p in enumerate(params):
        want = ref_keep(logits[r] / p.temperature, p.top_k, p.top_p, p.min_p)
        got = set(kept[r].nonzero().flatten().tolist())
        assert got == want, (r, p)
        if 0 < p.top_k <= V:
            assert len(got) <= p.top_k


@pytest.mark.parametrize("filters", FILTERS[:-1], ids=str)
def test_sampling_never_returns_masked_token(filters):
    torch.manual_seed(1)
    V, N = 50, 2000
    p = SamplingParams(temperature=1.3, **filters)
    row_logits = torch.randn(V) * 2
    want = ref_keep(row_logits / p.temperature, p.top_k, p.top_p, p.min_p)
    t = SamplingTensors.build(rows_for([p] * N, seeds=list(range(N))), V, "cpu")
    got = set(sample(row_logits.expand(N, V), t).token_ids.tolist())
    assert got <= want
    if len(want) > 1:
        assert len(got) > 1  # it is actually sampling


# --------------------------------------------------------------------------- RNG


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


# --------------------------------------------------------------------------- distribution


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


# --------------------------------------------------------------------------- penalties, greedy


def test_penalties_match_reference():
    torch.manual_seed(2)
    V = 40
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=0.5),
        SamplingParams(presence_penalty=-1.5, frequency_penalty=1.0),
        SamplingParams(),  # no penalties: must stay untouched
        SamplingParams(repetition_penalty=2.0, presence_penalty=2.0, frequency_penalty=-2.0),
    ]
    prompts = [torch.randint(0, V, (12,)).tolist() for _ in params]
    outputs = [torch.randint(0, V, (9,)).tolist() for _ in params]
    logits = torch.randn(len(params), V) * 3
    t = SamplingTensors.build(rows_for(params, None, prompts, outputs), V, "cpu")
    got = apply_penalties(logits, t)
    for r, p in enumerate(params):
        want = ref_penalties(logits[r], p, prompts[r], outputs[r])
        torch.testing.assert_close(got[r].double(), want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[3], logits[3])


def test_frequency_presence_only_skip_prompt():
    V = 10
    p = SamplingParams(frequency_penalty=1.0)
    t = SamplingTensors.build([SamplingRow(p, 0, [5, 6], [1, 1, 2])], V, "cpu")
    assert t.prompt_mask is None  # prompt only matters for repetition_penalty
    x = apply_penalties(torch.zeros(1, V), t)[0]
    assert x.tolist() == [0, -2, -1, 0, 0, 0, 0, 0, 0, 0]


def test_greedy_is_argmax_of_penalized_logits():
    torch.manual_seed(3)
    V = 100
    params = [
        SamplingParams(temperature=0, top_k=3, top_p=0.1, min_p=0.9),  # filters are ignored
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0, repetition_penalty=3.0),
        SamplingParams(temperature=1e-6, frequency_penalty=2.0),
    ]
    prompts = [[], [], [int(v) for v in torch.randperm(V)[:50]], []]
    logits = torch.randn(len(params), V)
    outputs = [[], [], [], logits[3].topk(3).indices.tolist()]
    rows = rows_for(params, None, prompts, outputs)
    ids = sample(logits, SamplingTensors.build(rows, V, "cpu")).token_ids
    for r in (0, 2, 3):
        want = ref_penalties(logits[r], params[r], prompts[r], outputs[r]).argmax()
        assert ids[r] == want
    assert ids[2] != logits[2].argmax() or logits[2].argmax() not in prompts[2]
    assert ids[3] != logits[3].argmax()
    greedy_only = SamplingTensors.build([rows[0], rows[0]], V, "cpu")
    assert greedy_only.all_greedy
    assert torch.equal(sample(logits[:2], greedy_only).token_ids, logits[:2].argmax(-1))


# --------------------------------------------------------------------------- logprobs, dtypes


def test_logprobs_of_raw_distribution():
    torch.manual_seed(4)
    V = 80
    params = [
        SamplingParams(logprobs=3, temperature=0.5, top_k=5, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(),
        SamplingParams(temperature=0, logprobs=1),
    ]
    logits = torch.randn(len(params), V) * 2
    rows = rows_for(params, None, [[1, 2, 3]] * 4, [[4, 5]] * 4)
    res = sample(logits, SamplingTensors.build(rows, V, "cpu"))
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(res.logprobs.double(), ref.gather(1, res.token_ids[:, None])[:, 0])
    assert res.top_ids.shape == res.top_logprobs.shape == (4, 3)  # K = max asked
    assert res.top_logprobs.dtype == torch.float32 and res.top_ids.dtype == torch.int64
    assert bool((res.top_logprobs[:, :-1] >= res.top_logprobs[:, 1:]).all())
    torch.testing.assert_close(res.top_logprobs.double(), ref.gather(1, res.top_ids))
    assert torch.equal(res.top_ids, ref.topk(3, -1).indices)

    none = sample(logits, SamplingTensors.build(rows_for([SamplingParams()] * 4), V, "cpu"))
    assert none.logprobs is None and none.top_ids is None and none.top_logprobs is None


def test_bf16_logits_and_input_not_modified():
    torch.manual_seed(5)
    V = 128
    params = [
        SamplingParams(top_k=10, top_p=0.9, min_p=0.05, logprobs=2, presence_penalty=1.0),
        SamplingParams(temperature=0, repetition_penalty=1.2),
    ]
    rows = rows_for(params, None, [[7, 8], [9]], [[3], [4, 4]])
    t = SamplingTensors.build(rows, V, "cpu")
    logits = (torch.randn(2, V) * 4).to(torch.bfloat16)
    before = logits.clone()
    res = sample(logits, t)
    assert torch.equal(logits, before)
    assert res.token_ids.dtype == torch.int64 and res.logprobs.dtype == torch.float32
    ref = sample(logits.float(), t)
    assert torch.equal(res.token_ids, ref.token_ids)
    torch.testing.assert_close(res.top_logprobs, ref.top_logprobs)
    x = torch.randn(2, V)
    x_before = x.clone()
    sample(x, t)
    assert torch.equal(x, x_before)


def test_build_flags_and_top_k_clamp():
    V = 16
    t = SamplingTensors.build(rows_for([SamplingParams(temperature=0, top_k=3)]), V, "cpu")
    assert t.all_greedy and not (t.do_top_k or t.do_top_p or t.do_min_p)
    assert t.output_counts is None and t.num_logprobs is None
    t = SamplingTensors.build(rows_for([SamplingParams(top_k=1000)]), V, "cpu")
    assert not t.do_top_k and t.top_k.tolist() == [V]
    t = SamplingTensors.build(rows_for([SamplingParams(seed=2**70)], seeds=[2**70 + 5]), V, "cpu")
    want = counter_key(torch.tensor([5]), torch.tensor([0]))  # seeds wrap modulo 2**64
    assert torch.equal(t.rng_keys, want)


# --------------------------------------------------------------------------- device


@pytest.mark.gpu
def test_cuda_no_sync_and_same_randomness_as_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(6)
    V, B = 32_000, 64
    params = [
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05, logprobs=4),
        SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5),
        SamplingParams(temperature=1.1),
    ]
    params = [params[i % 3] for i in range(B)]
    prompts = [torch.randint(0, V, (100,)).tolist() for _ in range(B)]
    outputs = [torch.randint(0, V, (i,)).tolist() for i in range(B)]
    rows = rows_for(params, list(range(B)), prompts, outputs)
    t = SamplingTensors.build(rows, V, "cuda")
    logits = torch.randn(B, V, device="cuda") * 3
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = sample(logits, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    u_cpu = counter_uniform(t.rng_keys.cpu(), V)
    assert torch.equal(counter_uniform(t.rng_keys, V).cpu(), u_cpu)
    cpu = sample(logits.cpu(), SamplingTensors.build(rows, V, "cpu"))
    plain = [i for i in range(B) if i % 3 != 0]  # rows without top-p boundary rounding
    assert torch.equal(res.token_ids.cpu()[plain], cpu.token_ids[plain])


def test_logit_bias_shifts_logits_and_is_validated():
    V = 32
    logits = torch.randn(3, V)
    rows = [
        SamplingRow(SamplingParams(temperature=0, logit_bias={"5": 100, 7: -3.5}), 0, [1], []),
        SamplingRow(SamplingParams(temperature=0), 0, [1], []),
        SamplingRow(SamplingParams(temperature=1.0, logit_bias={9: 1e9}), 3, [1], [2]),
    ]
    assert rows[2].params.logit_bias == {9: 100.0}  # clamped to OpenAI's range
    res = sample(logits, SamplingTensors.build(rows, V, "cpu"))
    assert res.token_ids[0] == 5 and res.token_ids[1] == logits[1].argmax()
    assert res.token_ids[2] == 9
    for bad in ({"x": 1}, {-1: 1}, {1: float("nan")}, {1: "2"}, [1]):
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.param == "logit_bias"


def test_explicit_step_equals_output_length():
    """The engine passes `step` instead of copying output ids when no penalty needs them."""
    logits = torch.randn(2, 64)
    p = SamplingParams(temperature=1.0)
    full = SamplingRow(p, 7, [1, 2], [3, 4, 5])
    light = SamplingRow(p, 7, [], [], step=3)
    a = sample(logits, SamplingTensors.build([full, full], 64, "cpu")).token_ids
    b = sample(logits, SamplingTensors.build([light, light], 64, "cpu")).token_ids
    assert torch.equal(a, b)
    assert full.num_output_tokens == light.num_output_tokens == 3
