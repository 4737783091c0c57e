"""The reasoning budget and grammars after the reasoning (SamplingParams.reasoning), in the engine:
the spec's validation, the per-sequence state, and `LLM` runs on a tiny random Llama with
SmolLM2's tokenizer (`</think>` is three tokens there): the budget is exact (budget tokens, then
the end ids, then the answer), a natural end within the budget forces nothing, a JSON grammar
is inactive until the end and holds after it, with n = 2, n-gram drafts, the overlapped loop,
and MTP drafts on the device (a tiny random MiMo, every draft accepted)."""

from __future__ import annotations

import json
import shutil

import pytest
from spec_helpers import make_llm as make_mimo
from test_api_tools import TINY

from tinyserve import LLM, InvalidParameter, SamplingParams
from tinyserve.sample.reasoning import ReasoningState
from tinyserve.sampling_params import ReasoningParams
from tinyserve.sampling_params import StructuredOutputsParams as SO

PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
PET = {
    "type": "object",
    "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {"enum": [1, 22, 33]}},
    "required": ["pet", "age"],
    "additionalProperties": False,
}


# -- the spec and the state -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(end_ids=[]), "reasoning.end_ids"),
        (dict(end_ids=[1, -2]), "reasoning.end_ids"),
        (dict(end_ids=[1], budget=-1), "reasoning.budget"),
        (dict(end_ids=[1], budget=True), "reasoning.budget"),
        (dict(end_ids=[1], start_ids=[2]), "reasoning.start_ids"),  # it starts inside already
        (dict(end_ids=[1], starts_in_reasoning="yes"), "reasoning.starts_in_reasoning"),
    ],
)
def test_spec_is_validated(kw, param):
    with pytest.raises(InvalidParameter) as e:
        ReasoningParams(**kw)
    assert e.value.param == param


def test_spec_in_sampling_params():
    p = SamplingParams(reasoning={"end_ids": [5], "budget": 3})
    assert p.reasoning == ReasoningParams([5], 3)
    with pytest.raises(InvalidParameter, match="known fields"):
        SamplingParams(reasoning={"end_ids": [5], "budgets": 3})
    spec = dict(end_ids=[5], starts_in_reasoning=False, start_ids=[4])
    with pytest.raises(InvalidParameter) as e:  # the grammar's first tokens would be loose
        SamplingParams(reasoning=spec, structured_outputs=SO(json_object=True))
    assert e.value.param == "structured_outputs"


def walk(spec: ReasoningParams, tokens: list[int]) -> list[str]:
    r, phases = ReasoningState(spec), []
    for t in tokens:
        r.advance(t)
        phases.append("OTFE"[r.phase])
    return phases


def test_state_phases():
    spec = ReasoningParams([8, 9], budget=3)
    assert "".join(walk(spec, [1, 8, 9, 2])) == "TTEE"  # the end within the budget
    assert "".join(walk(spec, [1, 2, 3, 8, 9])) == "TTFFE"  # spent: 8, 9 forced
    assert "".join(walk(ReasoningParams([8, 9], budget=2), [8, 9, 2])) == "TEE"
    assert ReasoningState(ReasoningParams([8], budget=0)).forced_token == 8
    opens = ReasoningParams([8], budget=5, starts_in_reasoning=False, start_ids=[6, 7])
    assert "".join(walk(opens, [6, 7, 1, 8])) == "OTTE"
    assert "".join(walk(opens, [6, 1])) == "OE"  # no reasoning after all
    assert ReasoningState(ReasoningParams([8], starts_in_reasoning=False)).is_ended


def test_drafts_stay_within_the_budget_and_before_the_end():
    r = ReasoningState(ReasoningParams([8, 9], budget=5))
    r.advance(1)  # 4 left: this step emits at most 1 + 3 drafts
    assert r.trim_drafts([2, 3, 4, 5, 6]) == [2, 3, 4]
    assert r.trim_drafts([2, 8, 9, 4]) == [2, 8]  # the draft completing the end is cut
    r.advance(8)
    assert r.trim_drafts([9, 4]) == []  # 9 would complete it right away
    for t in (2, 3, 4):
        r.advance(t)
    assert r.forced_token == 8 and r.trim_drafts([8, 9]) == []


# -- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_path):
    path = tmp_path_factory.mktemp("tiny-reasoning")
    (path / "config.json").write_text(json.dumps(TINY))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{smollm2_path}/{name}", path / name)
    return str(path)


def make_llm(path: str, **kw) -> LLM:
    kw = dict(dtype="float32", device="cpu", load_format="dummy", seed=0, num_kv_blocks=256) | kw
    return LLM(path, **kw)


@pytest.fixture(scope="module")
def llm(tiny_path):
    return make_llm(tiny_path)


@pytest.fixture(scope="module")
def end_ids(llm):
    ids = llm.engine.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(ids) == 3
    return ids


def generate(llm, params: SamplingParams, prompt=PROMPT) -> list[list[int]]:
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.engine.check_invariants()
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    return [o.token_ids for o in sorted(out.outputs, key=lambda o: o.index)]


def greedy(max_tokens=30, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def free(llm):
    """The greedy output without a reasoning spec."""
    [ids] = generate(llm, greedy())
    return ids


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_budget_is_exact(llm, end_ids, free, budget):
    [ids] = generate(llm, greedy(reasoning=ReasoningParams(end_ids, budget)))
    assert end_ids not in [free[i : i + 3] for i in range(len(free))]  # never ends by itself
    assert ids[:budget] == free[:budget]  # the reasoning, untouched
    assert ids[budget : budget + 3] == end_ids  # then exactly the end, forced
    assert len(ids) == 30  # then the answer


def test_budget_not_hit_when_the_reasoning_ends(llm, free):
    end = free[3:5]  # the model writes these two tokens (across two steps) at 3 and 4
    assert end not in [free[i : i + 2] for i in range(3)]
    for budget in (5, 20, None):  # 5: the end's last token is the budget's last
        [ids] = generate(llm, greedy(reasoning=ReasoningParams(end, budget)))
        assert ids == free


def answer_of(llm, ids: list[int], end_ids: list[int]) -> dict:
    at = next(i for i in range(len(ids)) if ids[i : i + len(end_ids)] == end_ids)
    text = llm.engine.tokenizer.decode(ids[at + len(end_ids) :])
    answer = json.loads(text)
    assert set(answer) == {"pet", "age"} and answer["pet"] in ("cat", "dog")
    return answer


def test_grammar_applies_after_the_reasoning(llm, end_ids, free):
    so = SO(json=PET, disable_any_whitespace=True)
    forced_end = greedy(60, reasoning=ReasoningParams(end_ids, 6), structured_outputs=so)
    [ids] = generate(llm, forced_end)
    assert ids[:6] == free[:6] and ids[6:9] == end_ids  # no mask on the reasoning
    answer_of(llm, ids, end_ids)
    natural = greedy(60, reasoning=ReasoningParams(free[3:5], 20), structured_outputs=so)
    [ids] = generate(llm, natural)
    assert ids[:5] == free[:5]
    answer_of(llm, ids, free[3:5])


def test_n2_sampled_and_ngram_drafts(tiny_path, llm, end_ids, free):
    reasoning = ReasoningParams(end_ids, 6)
    sampled = SamplingParams(n=2, seed=1, max_tokens=14, ignore_eos=True, reasoning=reasoning)
    outs = generate(llm, sampled)
    assert outs[0] != outs[1]
    for ids in outs:
        assert ids[6:9] == end_ids and len(ids) == 14
    # The greedy output repeats tokens (n-gram drafts hit): the same tokens with drafts.
    ngram = make_llm(tiny_path, speculative_method="ngram", num_speculative_tokens=3)
    so = SO(json=PET, disable_any_whitespace=True)
    budget = 17  # inside the run of one repeated token, which the drafts propose
    params = greedy(26, reasoning=ReasoningParams(end_ids, budget))
    [ids] = generate(ngram, params)
    assert ids == generate(llm, params)[0]
    assert ids[:budget] == free[:budget] and ids[budget : budget + 3] == end_ids
    assert ngram.engine.spec.stats.num_draft_tokens > 0
    params = greedy(40, reasoning=ReasoningParams(end_ids, budget), structured_outputs=so)
    assert generate(ngram, params) == generate(llm, params)


def launches(llm) -> list[bool]:
    """Record whether each launch of `llm`'s engine was overlapped."""
    engine, seen = llm.engine, []
    real = engine._launch

    def launch(batch, overlap):
        seen.append(overlap)
        return real(batch, overlap)

    engine._launch = launch
    return seen


def test_overlapped_loop_leaves_for_the_forced_end(tiny_path, llm, end_ids):
    ov = make_llm(tiny_path, async_scheduling=True)
    seen = launches(ov)
    reasoning = ReasoningParams(end_ids, 5)
    params = [
        greedy(30, reasoning=ReasoningParams(end_ids, 12)),
        SamplingParams(n=2, seed=3, max_tokens=30, ignore_eos=True, reasoning=reasoning),
        greedy(30, reasoning=ReasoningParams(end_ids, 1)),  # sync from the start
    ]
    prompts = [PROMPT, PROMPT + "x", PROMPT + "y"]
    got = ov.generate(prompts, params, use_tqdm=False)
    ov.engine.check_invariants()
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in got] == [
        [o.token_ids for o in r.outputs] for r in want
    ]
    for r, budget in zip(got, (12, 5, 1)):
        for o in r.outputs:
            assert o.token_ids[budget : budget + 3] == end_ids
    assert True in seen and False in seen  # overlapped, and left it for the forcing
    seen.clear()
    ov.generate([PROMPT], greedy(30, reasoning=ReasoningParams(end_ids, 20)), use_tqdm=False)
    assert seen[-4:] == [True] * 4  # back to overlapping once the reasoning ended


@pytest.mark.parametrize("budget", [2, 9])
def test_mtp_drafts_on_the_device(mimo_dir, budget):
    """Every draft accepted (spec_force_accept): each overlapped step emits 4 tokens, so the
    loop must leave early enough for the budget to stay exact."""
    kw = dict(speculative_method="mtp", num_speculative_tokens=3, spec_force_accept=3)
    end = [90, 91]
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, reasoning=ReasoningParams(end, budget)
    )
    prompt = list(range(3, 20))
    sync = make_mimo(mimo_dir, async_scheduling=False, **kw)
    ov = make_mimo(mimo_dir, **kw)
    seen = launches(ov)
    [a] = generate(sync, params, prompt)
    [b] = generate(ov, params, prompt)
    assert a == b and a[budget : budget + 2] == end and len(a) == 24
    assert end not in [a[i : i + 2] for i in range(budget)]
    assert True in seen or budget < 8
