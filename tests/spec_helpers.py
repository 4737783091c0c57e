"""Shared by the test_spec_*.py modules: a tiny random MiMo (an MTP head; CPU, fp32, dummy
weights), an LLM factory, prompts that make n-gram drafts hit, an engine tracer and the
from-scratch MTP drafts. The checkpoint and its plain greedy outputs are conftest's `mimo_dir`
and `reference` fixtures."""

from __future__ import annotations

import random

import torch

from tinyserve import LLM, SamplingParams
from tinyserve.core.sequence import PLACEHOLDER
from tinyserve.model.layers.attention import forward_context

VOCAB = 96
CONFIG = dict(
    architectures=["MiMoForCausalLM"],
    model_type="mimo",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    num_nextn_predict_layers=1,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def make_llm(path, **kw):
    """The overlapped loop unless a test says otherwise (on the CPU it is off by default)."""
    kw = (
        dict(
            dtype="float32",
            device="cpu",
            load_format="dummy",
            seed=3,
            block_size=4,
            async_scheduling=True,
        )
        | kw
    )
    kw["num_kv_blocks"] = kw.get("num_kv_blocks") or 512  # not the 4 GiB CPU default per engine
    return LLM(path, **kw)


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(24)]
    # repeated spans make n-gram drafts hit; a shared head exercises the prefix trie
    return [base[:12] + base[: 5 + 3 * i] + [rng.randrange(VOCAB)] for i in range(n)]


def run(llm, ps, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(ps, params, use_tqdm=False)
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


def traced(llm):
    """Record per sequence each verify's (drafted, accepted), count the launches that took a
    token from the step in flight, and check the invariants after every step."""
    engine = llm.engine
    trace = {"verifies": {}, "from_device": 0}
    real_launch, real_step = engine.runner.launch, engine.step
    for_seq = {}

    def launch(batch, rows, prev=None, *rest):
        trace["from_device"] += any(s.token_ids[-1] == PLACEHOLDER for s in batch.seqs)
        return real_launch(batch, rows, prev, *rest)

    def step():
        before = {
            s.seq_id: (s.num_draft_tokens, s.num_accepted_tokens)
            for r in engine.requests.values()
            for s in r.seqs
        }
        out = real_step()
        for r in engine.requests.values():
            for s in r.seqs:
                d0, a0 = before.get(s.seq_id, (0, 0))
                if s.num_draft_tokens > d0:
                    for_seq.setdefault(s.seq_id, []).append(
                        (s.num_draft_tokens - d0, s.num_accepted_tokens - a0)
                    )
        engine.check_invariants()
        return out

    engine.runner.launch, engine.step = launch, step
    trace["verifies"] = for_seq
    return trace


def reference_drafts(
    model, tokens: list[int], k: int, allowed: list[int] | None = None
) -> list[int]:
    """MTP drafts for a sequence computed from scratch with plain causal attention (no paged KV):
    entry i pairs the target hidden h_i with token t_{i+1}; a chained entry pairs the previous
    entry's output with the draft it produced. `allowed`: the argmax over those ids only."""
    mtp = model.mtp
    with torch.inference_mode(), forward_context(None):
        attn = [m for m in model.modules() if hasattr(m, "k_cache")]
        saved = [(m.k_cache, m.v_cache) for m in attn]
        for m in attn:
            m.k_cache = m.v_cache = None
        try:
            n = len(tokens) - 1
            ids = torch.tensor(tokens)
            hidden = model(ids[:n], torch.arange(n))
            if mtp.layout.normed_hidden:
                hidden = model.model.norm(hidden)
            ts, drafts = tokens[1:], []
            for _ in range(k):
                out = mtp(torch.tensor(ts), hidden, torch.arange(len(ts)), target_hidden=False)
                logits = mtp.compute_logits(out[-1:])[0]
                if allowed is None:
                    drafts.append(int(logits.argmax()))
                else:
                    drafts.append(allowed[int(logits[allowed].argmax())])
                ts.append(drafts[-1])
                hidden = torch.cat([hidden, out[-1:]])
            return drafts
        finally:
            for m, (kc, vc) in zip(attn, saved):
                m.k_cache, m.v_cache = kc, vc
