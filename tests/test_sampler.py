"""tinyserve.sample.sampler: masks and penalties against per-row references, greedy,
logprobs, dtypes, logit bias, and the CUDA path (no sync, the CPU's randomness)."""

from __future__ import annotations

import pytest
import torch
from sampler_helpers import ref_keep, ref_penalties, rows_for

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
