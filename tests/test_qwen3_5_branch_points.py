"""The hybrid prefix cache's branch points at the sizes users report missing (tiny random
Qwen3.5, fp32, CPU, 16-token blocks): prompts sharing a prefix with distinct suffixes, sent one
after another. The second one recomputes the shared prefix privately and saves a checkpoint at
its end (the branch point), so the third resumes there: `num_cached_tokens` is the shared
prefix's whole blocks (with MTP a block's key also holds the token after it: one block fewer
when the prefix ends on a block), greedy tokens are transformers'. Short prefixes (64 tokens) and
long ones (1,000 + 400), step budgets 16 / 64 / unlimited, state budgets of 1 and many."""

from __future__ import annotations

import random

import pytest
from qwen3_5_helpers import add_mtp_weights, hf_greedy, make_checkpoint

from tinyserve import LLM, SamplingParams

pytest.importorskip("transformers")

MAX_NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("branch_points")
    hf = make_checkpoint(path, "lin_first_last_long", 11)
    add_mtp_weights(path, hf.model, 12)  # (engines without MTP leave them)
    return str(path), hf


@pytest.mark.parametrize(
    "prefix,suffix,budget,state_budget,mtp",
    [
        (64, 61, None, None, 0),
        (64, 61, 16, 1, 0),
        (64, 61, 64, None, 2),
        (1000, 400, 16, None, 0),
        (1000, 400, 64, 1, 0),
        (1000, 400, None, 1, 2),
    ],
)
def test_third_request_resumes_at_the_branch_point(
    model, prefix, suffix, budget, state_budget, mtp
):
    path, hf = model
    rng = random.Random(prefix + suffix)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(prefix)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(suffix)] for _ in range(3)]
    kw = dict(max_num_batched_tokens=budget, prefix_cache_state_budget=state_budget)
    if mtp:
        kw |= dict(speculative_method="mtp", num_speculative_tokens=mtp)
    llm = LLM(path, dtype="float32", device="cpu", enable_prefix_caching=True, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    llm.engine.check_invariants()
    assert [o.outputs[0].token_ids for o in got] == [
        hf_greedy(hf, p, MAX_NEW)[len(p) :] for p in prompts
    ]
    bs = llm.engine.pool.block_size
    assert bs == 16
    want = (prefix - (1 if mtp else 0)) // bs * bs  # the last shared block (key) end
    assert got[2].num_cached_tokens == want
