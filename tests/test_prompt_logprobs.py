"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' full forward over the
prompt on a tiny random Llama: any chunking, either step loop, n > 1, warm or cold prefix cache,
preemption, batches mixed with ordinary requests (whose tokens do not change), MTP engines."""

from __future__ import annotations

import json

import pytest
import torch
from test_models import hf_logits, make_checkpoint, random_tokens

from tinyserve import LLM, InvalidParameter, SamplingParams

PROMPT = random_tokens(50, seed=3)
ATOL = 1e-4  # fp32, ours vs transformers (test_models.py's tolerance)
MIMO = dict(  # a tiny MiMo: Qwen2 with one MTP layer
    architectures=["MiMoForCausalLM"],
    model_type="mimo",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_nextn_predict_layers=1,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    torch_dtype="float32",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_prompt_logprobs")
    return str(path), make_checkpoint(path, "llama", seed=7)


def make_llm(path: str, **kw) -> LLM:
    kw = dict(dtype="float32", device="cpu", seed=0, block_size=4, num_kv_blocks=128) | kw
    return LLM(path, **kw)


def reference(hf, prompt: list[int], k: int) -> list[dict[int, float] | None]:
    """log_softmax of transformers' logits over the whole prompt; entry i scores token i with
    the logits of position i - 1, then the top k."""
    lp = torch.log_softmax(hf_logits(hf, prompt), dim=-1)  # (T, V)
    out: list[dict[int, float] | None] = [None]
    for i in range(1, len(prompt)):
        entry = {prompt[i]: lp[i - 1, prompt[i]].item()}
        if k:
            top = lp[i - 1].topk(k)
            entry.update(zip(top.indices.tolist(), top.values.tolist()))
        out.append(entry)
    return out


def assert_close(got, want, atol: float = ATOL) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for i, (g, w) in enumerate(zip(got[1:], want[1:]), 1):
        assert next(iter(g)) == next(iter(w)), i  # the scored token first
        assert g.keys() == w.keys(), i
        assert all(abs(g[t] - w[t]) <= atol for t in g), (i, g, w)


def params(**kw) -> SamplingParams:
    return SamplingParams(**(dict(temperature=0, max_tokens=4, ignore_eos=True) | kw))


@pytest.mark.parametrize(
    "budget,max_num_seqs,overlap",
    [(8192, 256, False), (16, 256, False), (16, 256, True), (8192, 4, True), (7, 2, False)],
)
def test_matches_transformers(tiny, budget, max_num_seqs, overlap):
    """Any token budget (a 50-token prompt in chunks of 16 or 7), the logits in slices of
    max_num_seqs rows, either step loop: equal to the full forward's log_softmax."""
    path, hf = tiny
    llm = make_llm(
        path,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        async_scheduling=overlap,
    )
    out = llm.generate([PROMPT], params(prompt_logprobs=3), use_tqdm=False)[0]
    assert_close(out.prompt_logprobs, reference(hf, PROMPT, 3))
    assert all(3 <= len(e) <= 4 for e in out.prompt_logprobs[1:])  # the token + the top 3
    plain = llm.generate([PROMPT], params(), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    llm.engine.check_invariants()


def test_chunked_equals_unchunked(tiny):
    path, _ = tiny
    p = params(prompt_logprobs=5)
    whole = make_llm(path).generate([PROMPT], p, use_tqdm=False)[0]
    chunked = make_llm(path, max_num_batched_tokens=16).generate([PROMPT], p, use_tqdm=False)[0]
    assert_close(chunked.prompt_logprobs, whole.prompt_logprobs, atol=1e-5)
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids


def test_zero_gives_the_prompt_tokens_only(tiny):
    path, hf = tiny
    out = make_llm(path).generate([PROMPT], params(prompt_logprobs=0), use_tqdm=False)[0]
    got = out.prompt_logprobs
    assert len(got) == len(PROMPT) and got[0] is None
    assert [list(e) for e in got[1:]] == [[t] for t in PROMPT[1:]]
    assert_close(got, reference(hf, PROMPT, 0))


def test_one_token_prompt(tiny):
    path, _ = tiny
    out = make_llm(path).generate([PROMPT[:1]], params(prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("overlap", [False, True])
def test_n2_delivered_once_with_the_first_tokens(tiny, overlap):
    path, hf = tiny
    llm = make_llm(path, max_num_batched_tokens=16, async_scheduling=overlap)
    engine = llm.engine
    p = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=5, prompt_logprobs=2)
    engine.add_request("r", PROMPT, p)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    with_tokens = [d for d in deltas if any(o.token_ids for o in d.outputs)]
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is with_tokens[0]
    assert_close(carrying[0].prompt_logprobs, reference(hf, PROMPT, 2))
    engine.check_invariants()
    # The merged form (LLM.generate) keeps it; both completions ran.
    got = llm.generate([PROMPT], p, use_tqdm=False)[0]
    assert_close(got.prompt_logprobs, carrying[0].prompt_logprobs, atol=1e-5)
    assert [len(o.token_ids) for o in got.outputs] == [5, 5]


def test_warm_cache_equals_cold(tiny):
    """A request with prompt_logprobs takes no prefix hit (a cached block has no logits) but
    commits its blocks for others."""
    path, _ = tiny
    llm = make_llm(path, max_num_batched_tokens=16)
    p = params(prompt_logprobs=3)
    cold = llm.generate([PROMPT], p, use_tqdm=False)[0]
    plain = llm.generate([PROMPT], params(), use_tqdm=False)[0]
    assert plain.num_cached_tokens >= 40  # hit the blocks the first request committed
    warm = llm.generate([PROMPT], p, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0
    assert_close(warm.prompt_logprobs, cold.prompt_logprobs, atol=1e-6)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids == plain.outputs[0].token_ids
    # n = 2: the second completion may hit what the first commits; the logprobs do not change
    # (but for float noise: its rows share the steps).
    both = llm.generate([PROMPT], params(n=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert_close(both.prompt_logprobs, cold.prompt_logprobs, atol=1e-5)
    llm.engine.check_invariants()


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_batch_keeps_ordinary_tokens(tiny, overlap):
    """Prompt-logprob rows beside decode rows and sampled rows in one step: the ordinary
    requests get the tokens they get alone; the scored ones get their reference."""
    path, hf = tiny
    llm = make_llm(path, max_num_batched_tokens=24, async_scheduling=overlap)
    ordinary = [random_tokens(5 + 7 * i, seed=10 + i) for i in range(4)]
    scored = [PROMPT, random_tokens(33, seed=20)]
    alone = [llm.generate([q], params(max_tokens=8), use_tqdm=False)[0] for q in ordinary]
    prompts = [ordinary[0], scored[0], ordinary[1], ordinary[2], scored[1], ordinary[3]]
    ps = [params(max_tokens=8, prompt_logprobs=4 if q in scored else None) for q in prompts]
    outs = llm.generate(prompts, ps, use_tqdm=False)
    by_prompt = {tuple(q): o for q, o in zip(prompts, outs)}
    for q, a in zip(ordinary, alone):
        got = by_prompt[tuple(q)]
        assert got.prompt_logprobs is None
        assert got.outputs[0].token_ids == a.outputs[0].token_ids
    for q in scored:
        assert_close(by_prompt[tuple(q)].prompt_logprobs, reference(hf, q, 4))
    llm.engine.check_invariants()


def test_preemption_recomputes_the_same(tiny):
    path, hf = tiny
    # 40 blocks of 4 tokens: three 50-token prompts cannot all be held at once.
    llm = make_llm(path, num_kv_blocks=40, max_num_batched_tokens=16)
    prompts = [PROMPT, random_tokens(48, seed=4), random_tokens(45, seed=5)]
    outs = llm.generate(prompts, params(max_tokens=8, prompt_logprobs=1), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for q, o in zip(prompts, outs):
        assert_close(o.prompt_logprobs, reference(hf, q, 1))
    llm.engine.check_invariants()


def test_mtp_engine(tmp_path):
    """With an MTP head (drafts, the overlapped speculative loop) the scores and the greedy
    tokens are the plain engine's (a tiny MiMo with dummy weights)."""
    (tmp_path / "config.json").write_text(json.dumps(MIMO))
    kw = dict(load_format="dummy", seed=3, async_scheduling=True, max_num_batched_tokens=16)
    ps = [random_tokens(20 + 9 * i, seed=30 + i) for i in range(3)]
    p = params(max_tokens=12, prompt_logprobs=2)
    plain = make_llm(str(tmp_path), **kw).generate(ps, p, use_tqdm=False)
    mtp = make_llm(str(tmp_path), speculative_method="mtp", num_speculative_tokens=2, **kw)
    outs = mtp.generate(ps, p, use_tqdm=False)
    for a, b in zip(outs, plain):
        assert_close(a.prompt_logprobs, b.prompt_logprobs, atol=1e-5)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert mtp.engine.spec is not None and sum(o.num_draft_tokens for o in outs) > 0
    mtp.engine.check_invariants()


@pytest.mark.parametrize("bad", [-1, -2, 21, True, 1.5, "3"])
def test_validation(bad):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    assert SamplingParams(prompt_logprobs=None).prompt_logprobs is None
