"""Prefix caching and chunked prefill end to end on SmolLM2 (fp32, CPU): outputs never change."""

from __future__ import annotations

import pytest

from tinyserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant. Answer briefly and precisely, cite no sources, and never "
    "invent facts. If a question is ambiguous, say so and pick the most likely reading. "
)
QUESTIONS = ["What is 2 + 2?", "Name a color.", "Why do cats purr?", "Spell 'tree'."]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_llm):
    tok = smollm2_llm.tokenizer
    return [tok.encode(SYSTEM * 3 + q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(smollm2_path, prompts):
    llm = LLM(smollm2_path, dtype="float32", device="cpu", enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "caching,budget,blocks",
    [
        (True, 16, None),
        (True, 64, None),
        (True, 512, None),
        (True, 8192, None),
        (False, 16, None),
        (True, 64, 12),
        (False, 64, 12),
    ],
)
def test_greedy_identical_with_cache_budgets_and_preemption(
    smollm2_path, prompts, reference, caching, budget, blocks
):
    llm = LLM(
        smollm2_path,
        dtype="float32",
        device="cpu",
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        num_kv_blocks=blocks,
    )
    # twice: the second round runs on prefix hits when caching is on
    for round_ in range(2):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference, (round_, budget)
    if caching and not blocks:
        # every full block of each prompt, except the block holding its last token
        assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 16 * 16 for p in prompts]
    if blocks:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_invariants()


def test_second_chat_turn_reuses_first_turn_prompt_and_answer(smollm2_llm):
    tok = smollm2_llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=40)
    turn1 = [{"role": "user", "content": "Write one sentence about the sea."}]
    first = smollm2_llm.chat(turn1, params, use_tqdm=False)[0]
    answer = first.outputs[0]
    turn2 = turn1 + [
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": "Now one about the sky."},
    ]
    second = smollm2_llm.chat(turn2, params, use_tqdm=False)[0]
    covered = len(first.prompt_token_ids) + len(answer.token_ids)
    # every full block of turn 1 (prompt + answer, minus the never-computed last token) hits
    assert second.num_cached_tokens >= covered - 16, (second.num_cached_tokens, covered)
    ids2 = tok.encode(tok.apply_chat_template(turn2), add_special_tokens=False)
    assert ids2[: covered - 1] == first.prompt_token_ids + answer.token_ids[:-1]


def test_cache_salt_prevents_sharing(smollm2_llm, prompts):
    engine = smollm2_llm.engine
    results = {}
    for rid, salt in [("s1", "tenant-a"), ("s2", "tenant-b"), ("s3", "tenant-a")]:
        engine.add_request(rid, prompts[0] + [11, 12], GREEDY, cache_salt=salt)
        while engine.has_unfinished():
            for d in engine.step():
                if d.finished:
                    results[rid] = d.num_cached_tokens
    assert results["s1"] == 0 and results["s2"] == 0 and results["s3"] > 100
    engine.check_invariants()
