"""Structured outputs (xgrammar) on the real SmolLM2: the vocabulary handed to xgrammar, every
spec kind, the compile cache, and the masks' neutrality: rows without a grammar, greedy tokens the
grammar allows, speculative drafts, chunked prefill and prefix-cache hits change nothing."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from tinyserve import LLM, AsyncEngine, InvalidParameter, SamplingParams
from tinyserve.sample.grammar import StepBitmask, tokenizer_info, vocab_type
from tinyserve.sampling_params import StructuredOutputsParams as SO

pytestmark = pytest.mark.slow

PHONE = r"[0-9]{3}-[0-9]{4}"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "pet"],
}
# GBNF: a tiny arithmetic language.
ARITH = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= [0-9]+ | "(" expr ")"
"""


def matches_schema(x, schema) -> bool:
    """The JSON Schema subset the tests use (jsonschema is not a dependency)."""
    if "enum" in schema:
        return x in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(x, dict)
            and all(k in x for k in schema.get("required", []))
            and all(k in props and matches_schema(v, props[k]) for k, v in x.items())
        )
    if kind == "array":
        return (
            isinstance(x, list)
            and len(x) <= schema.get("maxItems", len(x))
            and all(matches_schema(v, schema["items"]) for v in x)
        )
    if kind == "string":
        return isinstance(x, str) and len(x) <= schema.get("maxLength", len(x))
    if kind == "integer":
        low, high = schema.get("minimum", x), schema.get("maximum", x)
        return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high
    raise AssertionError(f"unhandled schema {schema}")


def params(spec: SO | None, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, **kw}, structured_outputs=spec)


def gen(llm, prompts, p):
    return llm.generate(prompts, p, use_tqdm=False)


def _tokenizer_json(**parts) -> dict:
    base = {"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": {}}}
    return base | {k: None for k in ("normalizer", "pre_tokenizer", "decoder")} | parts


META = {"type": "Metaspace", "replacement": "\u2581"}
PREPEND = {"type": "Prepend", "prepend": "\u2581"}
FALLBACK = {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]}


@pytest.mark.parametrize(
    "parts",
    [
        {"decoder": {"type": "ByteLevel"}, "pre_tokenizer": {"type": "ByteLevel"}},
        {"decoder": {"type": "Sequence", "decoders": [{"type": "ByteLevel"}]}},
        {  # Llama 2
            "normalizer": {"type": "Sequence", "normalizers": [PREPEND, {"type": "Replace"}]},
            "decoder": FALLBACK,
        },
        {"normalizer": {"type": "Prepend", "prepend": "_"}, "decoder": FALLBACK},
        {
            "normalizer": PREPEND,
            "decoder": FALLBACK,
        },
        {"pre_tokenizer": META | {"prepend_scheme": "first"}, "decoder": FALLBACK},  # Mistral
        {"pre_tokenizer": META | {"prepend_scheme": "never"}, "decoder": FALLBACK},
        {"pre_tokenizer": META | {"add_prefix_space": True}, "decoder": FALLBACK},
        {"pre_tokenizer": META | {"prepend_scheme": "always"}, "decoder": META},
        {"decoder": {"type": "WordPiece"}},
        {},
    ],
)
def test_vocab_type_agrees_with_xgrammar(parts):
    import xgrammar as xgr

    tokenizer_json = _tokenizer_json(**parts)
    theirs = xgr.TokenizerInfo._detect_metadata_from_hf(json.dumps(tokenizer_json))
    assert vocab_type(tokenizer_json) == (theirs["vocab_type"].value, theirs["add_prefix_space"])


def test_tokenizer_info_matches_our_tokenizer(smollm2_llm):
    """xgrammar's view of the vocabulary, built without transformers: byte-level BPE detected as
    xgrammar itself detects it, every token decodes to the bytes our tokenizer decodes it to,
    special tokens are never text, EOS is the stop token."""
    import xgrammar as xgr

    tok, mc = smollm2_llm.tokenizer, smollm2_llm.engine.model_config
    backend = tok.backend.to_str()
    assert vocab_type(json.loads(backend)) == (xgr.VocabType.BYTE_LEVEL.value, False)
    theirs = xgr.TokenizerInfo._detect_metadata_from_hf(backend)
    assert (theirs["vocab_type"], theirs["add_prefix_space"]) == (xgr.VocabType.BYTE_LEVEL, False)
    info = tokenizer_info(tok, mc.vocab_size, mc.eos_token_ids)
    assert info.vocab_size == mc.vocab_size and info.stop_token_ids == mc.eos_token_ids
    assert set(tok.all_special_ids) - set(mc.eos_token_ids) <= set(info.special_token_ids)
    decoded = info.decoded_vocab
    special = set(tok.all_special_ids)
    checked = 0
    for i in range(mc.vocab_size):
        if i in special:
            continue
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 sequence: compare bytes through a pair below
            continue
        assert decoded[i] == text.encode(), (i, decoded[i], text)
        checked += 1
    assert checked > 0.9 * mc.vocab_size
    # A byte-split character: two byte tokens of "é" concatenate to its UTF-8 bytes.
    ids = tok.encode("é", add_special_tokens=False)
    assert b"".join(decoded[i] for i in ids) == "é".encode()


def test_regex_phone_number_greedy_and_sampled(smollm2_llm):
    eos = smollm2_llm.engine.model_config.eos_token_ids
    p = params(SO(regex=PHONE))
    out = gen(smollm2_llm, ["Call me at"], p)[0].outputs[0]
    assert re.fullmatch(PHONE, out.text), out.text
    # The grammar ends only through EOS, which it allows only once the number is complete.
    assert out.finish_reason == "stop" and out.token_ids[-1] in eos
    sampled = gen(smollm2_llm, ["Call me at"], params(SO(regex=PHONE), temperature=1.0, n=3))
    assert all(re.fullmatch(PHONE, o.text) for o in sampled[0].outputs)
    # ignore_eos: the grammar still ends the sequence where it is complete.
    out = gen(smollm2_llm, ["Call me at"], params(SO(regex=PHONE), ignore_eos=True))[0]
    assert re.fullmatch(PHONE, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    smollm2_llm.engine.check_invariants()


def test_json_schema_sampled_n3_is_valid(smollm2_llm):
    prompt = "Describe a person as a JSON object with name, age and pet:\n"
    p = params(SO(json=PERSON), temperature=1.0, n=3, seed=7, max_tokens=80)
    outs = gen(smollm2_llm, [prompt], p)[0].outputs
    assert len(outs) == 3
    for o in outs:
        assert o.finish_reason == "stop", o.text
        assert matches_schema(json.loads(o.text), PERSON), o.text
    smollm2_llm.engine.check_invariants()


def test_choice_grammar_and_json_object(smollm2_llm):
    choices = ["yes", "no", 'it "depends"']
    out = gen(smollm2_llm, ["Is the sky green? Answer:"], params(SO(choice=choices)))[0]
    assert out.outputs[0].text in choices
    out = gen(smollm2_llm, ["2 plus 3 is written"], params(SO(grammar=ARITH), max_tokens=20))[0]
    text = out.outputs[0].text
    if out.outputs[0].finish_reason == "stop":
        assert re.fullmatch(r"[0-9+\-()]+", text) and text.count("(") == text.count(")")
    else:  # a prefix of the language
        assert re.fullmatch(r"[0-9+\-()]*", text)
    p = params(SO(json_object=True), max_tokens=80, temperature=1.0, n=2, seed=3)
    for o in gen(smollm2_llm, ["A JSON object describing a cat:"], p)[0].outputs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict), o.text
        else:
            assert o.text.lstrip().startswith("{")
    smollm2_llm.engine.check_invariants()


def test_logprobs_are_of_the_masked_distribution(smollm2_llm):
    """The mask comes before everything (vLLM's order): the reported logprobs are those of the
    grammar's distribution, so tokens it forbids never show up among the top ones."""
    p = params(SO(choice=["yes", "no"]), logprobs=5, max_tokens=3)
    out = gen(smollm2_llm, ["Is the sky green? Answer:"], p)[0].outputs[0]
    first = out.logprobs[0]  # {token id: logprob}: the sampled token's and the top 5
    shown = {smollm2_llm.tokenizer.decode([i]) for i, lp in first.items() if lp > float("-inf")}
    assert shown and all("yes".startswith(t) or "no".startswith(t) for t in shown), shown
    assert first[out.token_ids[0]] > float("-inf")


def test_invalid_specs_raise_before_queueing(smollm2_llm):
    engine = smollm2_llm.engine
    bad = [
        SO(regex="[0-9"),
        SO(json={"type": "nonsense"}),
        SO(json={"type": "integer", "minimum": 5, "maximum": 1}),
        SO(grammar="root ::= undefined_rule"),
    ]
    for spec in bad:
        with pytest.raises(InvalidParameter) as e:
            gen(smollm2_llm, ["x"], params(spec))
        assert e.value.param == "structured_outputs"
        assert "/" not in str(e.value) and ".cc" not in str(e.value)  # no C++ paths
        assert not engine.has_unfinished()
    for fields in ({}, {"regex": "a", "choice": ["a"]}, {"json": "{not json"}, {"choice": []}):
        with pytest.raises(InvalidParameter):
            SO(**fields)
    with pytest.raises(InvalidParameter):
        SamplingParams(structured_outputs={"regexp": "a"})
    assert SamplingParams(structured_outputs={"regex": "a"}).structured_outputs.regex == "a"
    engine.check_invariants()


def test_compile_cache_and_precompiled_handle(smollm2_llm):
    engine = smollm2_llm.engine
    comp = engine.grammar_compiler
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    compiles, hits = comp.num_compiles, comp.num_cache_hits
    g = engine.compile_grammar(SO(json=schema))
    assert comp.num_compiles == compiles + 1
    # The same schema again, as JSON text this time: a cache hit, no compile.
    assert engine.compile_grammar(SO(json=json.dumps(schema))) is g
    assert (comp.num_compiles, comp.num_cache_hits) == (compiles + 1, hits + 1)
    # add_request takes the compiled handle (the server compiles in an executor).
    p = params(SO(json=schema), max_tokens=20)
    engine.add_request("pre", "A JSON object with a number n:", p, grammar=g)
    out = []
    while engine.has_unfinished():
        out += [o for d in engine.step() for o in d.outputs]
    assert "n" in json.loads("".join(o.text for o in out))
    assert comp.num_compiles == compiles + 1
    engine.check_invariants()


def test_async_engine_compiles_off_the_loop(smollm2_llm):
    p = params(SO(regex=PHONE))

    async def go():
        ae = AsyncEngine(smollm2_llm.engine)
        try:
            text = "".join([d.outputs[0].text async for d in ae.generate("a1", "Call me at", p)])
            with pytest.raises(InvalidParameter):
                async for _ in ae.generate("a2", "x", params(SO(regex="("))):
                    pass
        finally:
            await ae.close()
        return text

    assert re.fullmatch(PHONE, asyncio.run(go()))


def test_mixed_batch_leaves_unconstrained_rows_alone(smollm2_llm):
    """Constrained and unconstrained rows in one step: the unconstrained rows get exactly
    their tokens alone (greedy)."""
    plain = ["The capital of France is", "List three colors:", "def fibonacci(n):"]
    p = params(None, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in gen(smollm2_llm, plain, p)]
    prompts = ["Call me at", plain[0], "Answer yes or no:", plain[1], plain[2]]
    ps = [params(SO(regex=PHONE)), p, params(SO(choice=["yes", "no"])), p, p]
    outs = gen(smollm2_llm, prompts, ps)
    assert [outs[i].outputs[0].token_ids for i in (1, 3, 4)] == alone
    assert re.fullmatch(PHONE, outs[0].outputs[0].text)
    assert outs[2].outputs[0].text in ("yes", "no")
    smollm2_llm.engine.check_invariants()


def test_greedy_allowed_by_the_grammar_is_unchanged(smollm2_llm):
    """Masks that allow the greedy token change nothing: a regex admitting any text, and a
    choice holding exactly the unconstrained greedy text."""
    prompt = "Once upon a time, in a small village by the sea,"
    ref = gen(smollm2_llm, [prompt], params(None, max_tokens=12, ignore_eos=True))[0].outputs[0]
    wide = gen(smollm2_llm, [prompt], params(SO(regex=r"[\s\S]*"), max_tokens=12))[0].outputs[0]
    assert wide.token_ids == ref.token_ids
    exact = gen(smollm2_llm, [prompt], params(SO(choice=[ref.text]), max_tokens=13))[0].outputs[0]
    eos = smollm2_llm.engine.model_config.eos_token_ids
    assert exact.token_ids[:-1] == ref.token_ids and exact.token_ids[-1] in eos


def test_grammar_state_drafts_and_rows(smollm2_llm):
    """Draft rows: each row's mask assumes the drafts before it accepted; a draft the grammar
    rejects truncates the list; the matcher ends where it started."""
    tok = smollm2_llm.tokenizer
    g = smollm2_llm.engine.compile_grammar(SO(regex=PHONE))
    state = g.matcher()
    digits = [tok.encode(c, add_special_tokens=False)[0] for c in "0123456789"]
    dash = tok.encode("-", add_special_tokens=False)[0]
    letter = tok.encode("a", add_special_tokens=False)[0]
    assert state.valid_drafts([digits[1], digits[2], letter, digits[3]]) == digits[1:3]
    assert state.valid_drafts([dash]) == []
    buf = StepBitmask(smollm2_llm.engine.model_config.vocab_size, pin=False)

    class Seq:  # the fields StepBitmask reads
        params = SamplingParams(structured_outputs=SO(regex=PHONE))
        draft_ids = [digits[1], digits[2], digits[3], letter]

    plain = type("Plain", (), {"params": SamplingParams(), "draft_ids": [digits[0]]})
    m = buf.fill([plain, Seq], lambda s: state)
    assert m.rows == [2, 3, 4, 5, 6]  # after the plain row and its draft

    def allowed(row):
        bits = (m.bitmask[row][:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return set(bits.flatten().nonzero().flatten().tolist())

    assert set(digits) <= allowed(0) and dash not in allowed(0)
    assert dash in allowed(3) and digits[0] not in allowed(3)  # after three digits: "-" only
    assert allowed(4) == allowed(3)  # past the rejected draft: a copy (never accepted)
    assert state.matcher.accept_token(digits[5])  # rolled back to the start


def test_ngram_speculation_equals_plain_constrained(smollm2_path, smollm2_llm):
    """Drafts from prompt lookup (some the grammar allows, some not), verified under the masks:
    the output equals the non-speculative constrained output."""
    record = '{"name": "Ada Lovelace", "born": 1815, "field": "mathematics"}'
    prompt = f"Copy this record exactly: {record}\nCopy: "
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "born": {"type": "integer"},
            "field": {"type": "string"},
        },
        "required": ["name", "born", "field"],
    }
    specs = [SO(json=schema), SO(regex=PHONE)]  # drafts mostly allowed; mostly rejected
    ref = gen(smollm2_llm, [prompt] * 2, [params(s, max_tokens=32) for s in specs])
    llm = LLM(
        smollm2_path,
        dtype="float32",
        device="cpu",
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    outs = gen(llm, [prompt] * 2, [params(s, max_tokens=32) for s in specs])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert outs[0].num_draft_tokens > 0 and outs[0].num_accepted_tokens > 0
    llm.engine.check_invariants()


def test_chunked_prefill_and_prefix_cache_hit(smollm2_path, smollm2_llm):
    long_prompt = "Here is a list of people and their phone numbers. " * 12 + "Ada's number is"
    p = params(SO(regex=PHONE))
    ref = gen(smollm2_llm, [long_prompt], p)[0].outputs[0]
    llm = LLM(smollm2_path, dtype="float32", device="cpu", max_num_batched_tokens=64)
    first = gen(llm, [long_prompt], p)[0]
    assert len(first.prompt_token_ids) > 2 * 64  # prefilled in chunks
    second = gen(llm, [long_prompt], p)[0]
    assert second.num_cached_tokens > 64  # a prefix-cache hit
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == ref.token_ids
    llm.engine.check_invariants()


def test_overlapped_loop_equals_synchronous(smollm2_path, smollm2_llm, monkeypatch):
    """The overlapped loop keeps constrained rows (their matchers advance over the step in
    flight's tokens while the next forward runs): the same tokens as the synchronous loop, for
    greedy and seeded rows, grammars that end early, and unconstrained rows beside them."""
    prompts = ["Call me at", "Describe a person as JSON:", "Answer yes or no:", "List colors:"]
    ps = [
        params(SO(regex=PHONE)),
        params(SO(json=PERSON), temperature=1.0, seed=7, max_tokens=60),
        params(SO(choice=["yes", "no"]), temperature=1.0, seed=3),
        params(None, max_tokens=12, ignore_eos=True),
    ]
    ref = [o.outputs[0] for o in gen(smollm2_llm, prompts, ps)]
    llm = LLM(smollm2_path, dtype="float32", device="cpu", seed=0, async_scheduling=True)
    engine = llm.engine
    early = []
    real = engine.constraints._advance_early
    monkeypatch.setattr(
        engine.constraints, "_advance_early", lambda *a: early.append(1) or real(*a)
    )
    outs = [o.outputs[0] for o in gen(llm, prompts, ps)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
    assert re.fullmatch(PHONE, outs[0].text) and outs[2].text in ("yes", "no")
    assert matches_schema(json.loads(outs[1].text), PERSON)
    assert len(early) > 10  # the overlapped loop ran them
    engine.check_invariants()
