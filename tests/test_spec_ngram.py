"""N-gram speculation: the proposer's matching rule, and lossless drafting on the real
SmolLM2 with the acceptance counters served on /metrics."""

from __future__ import annotations

import json

import pytest

from tinyserve import LLM, SamplingParams
from tinyserve.spec.ngram import NgramProposer


def test_ngram_proposer_takes_the_most_recent_match():
    p = NgramProposer(k=3, max_n=3, min_n=2)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]
    assert p.propose([5, 6, 7, 8]) == []  # no earlier occurrence
    assert p.propose([4, 4, 4, 4]) == [4]  # the most recent match, cut at the end
    assert p.propose([1]) == []


EDIT = (
    "Fix the typos in this text and repeat it in full.\n\nText: The quick brown fox jumpd over "
    "the lazy dog. It was a sunny day and the fox was very hapy. The dog did not care at all, "
    "it kept sleeping under the old oak tree near the river.\n\nFixed text:"
)


@pytest.mark.slow
def test_ngram_on_smollm2_is_lossless_and_served_with_metrics(smollm2_path, smollm2_llm):
    """Greedy n-gram speculation on an edit prompt: same tokens as plain decode, most drafts
    accepted, and the server exports the acceptance counters."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families
    from test_server import serving  # pytest puts tests/ on sys.path (no package)

    params = SamplingParams(temperature=0, max_tokens=48)
    ref = smollm2_llm.chat([{"role": "user", "content": EDIT}], params, use_tqdm=False)[0]
    llm = LLM(
        smollm2_path,
        dtype="float32",
        device="cpu",
        speculative_method="ngram",
        num_speculative_tokens=4,
        num_kv_blocks=256,
    )
    out = llm.chat([{"role": "user", "content": EDIT}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.num_accepted_tokens > out.num_draft_tokens / 3 > 0

    async def scrape():
        async with serving(llm.engine) as client:
            body = {
                "messages": [{"role": "user", "content": EDIT}],
                "max_tokens": 48,
                "temperature": 0,
                "stream": True,
            }
            r = await client.post("/v1/chat/completions", json=body)
            text = await r.text()
            return text, await (await client.get("/metrics")).text()

    stream, metrics = asyncio.run(scrape())
    pieces = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p["choices"])
    assert text == ref.outputs[0].text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    drafted = families["tinyserve:spec_decode_num_draft_tokens"].samples[0].value
    accepted = families["tinyserve:spec_decode_num_accepted_tokens"].samples[0].value
    assert drafted >= accepted > 0
    assert families["tinyserve:spec_decode_mean_accepted_length"].samples[0].value > 1
