"""tinyserve.sampling_params: every invalid field raises InvalidParameter naming it; valid
values are normalized."""

from __future__ import annotations

import math

import pytest

from tinyserve.sampling_params import InvalidParameter, SamplingParams

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
    ("temperature", 10**400),  # past float's range: InvalidParameter, not OverflowError
    ("top_p", -(10**400)),
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
