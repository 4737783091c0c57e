"""MTP speculative decoding on Qwen3.5 (hybrid) with the checkpoint's `mtp.*` layer, on tiny
random checkpoints written by transformers plus random MTP tensors (fp32, CPU): the MTP layer's
forward as a torch reference written from the published op order (text and multimodal
checkpoints); the engine's drafts as that reference computes them from scratch (paged MTP KV,
chunked prefill, prefix hits resumed from state checkpoints, chained drafts); greedy tokens
identical to transformers' (= MTP off) with prefix hits and chunk budgets of 16 / 64 /
unlimited, in the synchronous and the overlapped loop.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from qwen3_5_helpers import (
    BASE,
    FULL,
    LIN,
    TINY_VISION,
    add_mtp_weights,
    eager_decode_graphs,
    hf_greedy,
    make_checkpoint,
    randomize_,
)
from spec_helpers import traced

from tinyserve import LLM, SamplingParams
from tinyserve.model.config import ModelConfig, UnsupportedModel
from tinyserve.model.layers.attention import forward_context
from tinyserve.model.loader import load_model

transformers = pytest.importorskip("transformers")

BS = 4
BASE_KW = dict(dtype="float32", device="cpu", block_size=BS, num_kv_blocks=128)
SYSTEM, SUFFIX, MAX_NEW = 30, 7, 16  # the system prompt: 7 full blocks and 2 tokens


# -- a torch reference from the published op order ----------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: scale 1 + w (fp32 throughout here)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def rope(x: torch.Tensor, positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """(T, heads, D): rotate the first `dim` dims of each head (halves paired, as HF's
    rotate_half), the others pass through."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angle = positions[:, None].float() * inv_freq  # (T, dim / 2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2, rest = x[..., : dim // 2], x[..., dim // 2 : dim], x[..., dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def reference_mtp(w: dict, cfg, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """vLLM's / SGLang's qwen3_5_mtp: (T, H) target hidden after the final norm and the (T,)
    next tokens at positions 0..T-1 -> (T, H) after mtp.norm. `w`: the checkpoint's tensors
    (mtp.*, the embedding)."""
    eps, p = cfg.rms_norm_eps, "mtp.layers.0."
    (num, _), d = hidden.shape, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    positions = torch.arange(num)
    e = rms(w["embed"][ids], w["mtp.pre_fc_norm_embedding.weight"], eps)  # no position-0 mask
    h = rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = torch.cat([e, h], dim=-1) @ w["mtp.fc.weight"].T  # embedding first
    # One full-attention decoder layer: gated attention (q/k norm, partial rotary), then the MLP.
    a = rms(x, w[p + "input_layernorm.weight"], eps)
    qg = (a @ w[p + "self_attn.q_proj.weight"].T).view(num, hq, 2 * d)  # per head [q | gate]
    q, gate = qg[..., :d], qg[..., d:].reshape(num, hq * d)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(num, hkv, d)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(num, hkv, d)
    q = rms(q, w[p + "self_attn.q_norm.weight"], eps)
    k = rms(k, w[p + "self_attn.k_norm.weight"], eps)
    params = cfg.rope_parameters  # text positions: the interleaved mRoPE is plain RoPE
    rot, theta = int(d * params["partial_rotary_factor"]), params["rope_theta"]
    q, k = rope(q, positions, rot, theta), rope(k, positions, rot, theta)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * d**-0.5
    scores = scores.masked_fill(torch.ones(num, num).triu(1).bool(), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(num, hq * d)
    x = x + (o * torch.sigmoid(gate)) @ w[p + "self_attn.o_proj.weight"].T
    m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
    mlp = F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
    x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["mtp.norm.weight"], eps)


def text_config(hf):
    return getattr(hf.config, "text_config", hf.config)


def text_model(hf):
    return getattr(hf.model, "language_model", hf.model)


def multimodal_checkpoint(path, seed: int):
    """A Qwen3_5ForConditionalGeneration checkpoint (model.language_model.*, model.visual.*)."""
    text = {**BASE, "layer_types": [LIN, FULL], "num_hidden_layers": 2}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=TINY_VISION)
    torch.manual_seed(seed)
    hf = transformers.Qwen3_5ForConditionalGeneration(config)
    randomize_(hf, seed)
    hf.save_pretrained(path)
    return hf.eval()


@pytest.mark.parametrize("kind", ["text", "multimodal"])
@torch.no_grad()
def test_mtp_layer_matches_a_torch_reference(tmp_path, kind):
    """Our MTP head loaded from `mtp.*` (top level in both kinds of checkpoint) over a target's
    hidden states (normed by the target's final norm first) and next tokens: the reference's
    output, position 0 included (its embedding is not masked)."""
    if kind == "text":
        hf = make_checkpoint(tmp_path, "published_tied", 1)
    else:
        hf = multimodal_checkpoint(tmp_path, 1)
    mc = ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModel, match="no MTP layers"):
        load_model(mc, torch.float32, "cpu", with_mtp=True)
    w = add_mtp_weights(tmp_path, text_model(hf), 11)
    w["embed"] = text_model(hf).embed_tokens.weight
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert mc.num_nextn_predict_layers == 1
    ours = load_model(mc, torch.float32, "cpu", with_mtp=True)
    gen = torch.Generator().manual_seed(0)
    num = 11
    hidden = torch.randn(num, mc.hidden_size, generator=gen)  # pre-norm, as the target's
    ids = torch.randint(0, mc.vocab_size, (num,), generator=gen)
    with forward_context(None):  # no KV cache: causal attention over the T tokens
        got = ours.mtp(ids, hidden, torch.arange(num), target_hidden=True)
    normed = rms(hidden, text_model(hf).norm.weight, mc.rms_norm_eps)
    want = reference_mtp(w, text_config(hf), normed, ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    # The drafts' logits: the target's LM head (shared).
    torch.testing.assert_close(ours.mtp.compute_logits(got), want @ hf.lm_head.weight.T)


# -- through the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, transformers model, MTP tensors and the embedding): the published layer
    pattern with a random MTP layer, and a 12-token vocabulary whose MTP layer mostly echoes the
    last token (greedy runs of one token accept several drafts a step)."""
    out = {}
    for variant, seed in (("published_tied", 2), ("small_vocab", 5)):
        path = tmp_path_factory.mktemp(variant)
        hf = make_checkpoint(path, variant, seed)
        w = add_mtp_weights(path, hf.model, 20 + seed, echo=variant == "small_vocab")
        out[variant] = (str(path), hf, w | {"embed": hf.model.embed_tokens.weight})
    return out


def shared_prompts(vocab: int, seed: int) -> list[list[int]]:
    """A system prompt with distinct questions (prefix hits that branch mid-block), one that
    branches exactly at a block end (the block before it keyed on a different next token), and
    an unrelated short prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(SYSTEM)]
    question = [[rng.randrange(vocab) for _ in range(SUFFIX)] for _ in range(4)]
    return [
        system + question[0],
        system + question[1],
        system[:28] + question[2],
        [rng.randrange(vocab) for _ in range(5)],
        system + question[3],
    ]


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@torch.no_grad()
def check_drafts(hf, w, tokens: list[int], seen: list[tuple[int, list[int]]]) -> int:
    """Each draft the engine proposed after the first n + 1 of a sequence's final `tokens`
    (`seen`: (n, drafts)) is the reference's argmax (up to float ties) given the drafts before
    it: entry i pairs transformers' normed hidden h_i with token t_{i+1}; a chained entry pairs
    the previous entry's output with the draft it produced. Returns the drafts checked."""
    cfg = text_config(hf)
    every = hf.model(torch.tensor([tokens])).last_hidden_state[0]  # (T, H), normed; causal
    for n, drafts in seen:
        hidden, ts = every[:n], list(tokens[1 : n + 1])
        for draft in drafts:
            out = reference_mtp(w, cfg, hidden, torch.tensor(ts))[-1:]  # (1, H)
            logits = (out @ hf.lm_head.weight.T)[0]
            assert logits[draft] >= logits.max() - 1e-4, (n, draft, int(logits.argmax()))
            ts.append(draft)
            hidden = torch.cat([hidden, out])
    return len(seen)


@pytest.mark.parametrize("k,caching,budget", [(1, False, None), (3, True, 16)])
def test_drafts_equal_a_from_scratch_computation(checkpoints, k, caching, budget):
    """The paged MTP KV (written by every prompt chunk, reused from the prefix cache on hits
    resumed from state checkpoints, verify rows' entries rewritten once verified, the chained
    lookahead) gives the reference's drafts at every step. The synchronous loop: the host holds
    each step's drafts."""
    path, hf, w = checkpoints["published_tied"]
    llm = LLM(
        path,
        **BASE_KW,
        speculative_method="mtp",
        num_speculative_tokens=k,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
    )
    engine = llm.engine
    ps = shared_prompts(hf.config.vocab_size, 1)[:4]
    seen: dict[str, list[tuple[int, list[int]]]] = {str(i): [] for i in range(len(ps))}
    final: dict[str, list[int]] = {}
    for wave in ([0], range(1, len(ps))):  # the first request's blocks and checkpoints, then hits
        for i in wave:
            engine.add_request(str(i), ps[i], greedy(6))
        while engine.has_unfinished():
            engine.step()
            engine.check_invariants()
            for s in engine.scheduler.running:
                final[s.request_id] = list(s.token_ids)
                if s.draft_ids:
                    seen[s.request_id].append((s.num_tokens - 1, list(s.draft_ids)))
    checked = sum(check_drafts(hf, w, final[r], seen[r]) for r in seen)
    assert checked > 15
    if caching:
        assert engine.pool.trie.num_hit_tokens > 0
        assert engine.scheduler.state_pool.num_checkpoint_hits > 0


@pytest.fixture(scope="module")
def expected(checkpoints):
    """The small-vocabulary checkpoint, its shared prompts and transformers' greedy
    continuations."""
    path, hf, _ = checkpoints["small_vocab"]
    ps = shared_prompts(hf.config.vocab_size, 3)
    return path, ps, [hf_greedy(hf, p, MAX_NEW)[len(p) :] for p in ps]


@pytest.mark.parametrize(
    "k,budget,overlap", [(3, 16, False), (2, 64, True), (1, None, False), (3, 16, True)]
)
def test_greedy_tokens_are_transformers_with_prefix_hits(expected, k, budget, overlap):
    """Lossless: MTP on, prefix caching on (hits resume from state checkpoints; the MTP KV of
    cached blocks is keyed on the token after each block), chunked prefill: transformers'
    greedy tokens, which MTP off gives too (test_qwen3_5_engine.py). The first request runs
    alone (its blocks and checkpoints are committed), then the others together."""
    path, ps, want = expected
    llm = LLM(
        path,
        **BASE_KW,
        speculative_method="mtp",
        num_speculative_tokens=k,
        enable_prefix_caching=True,
        max_num_batched_tokens=budget,
        async_scheduling=overlap,
    )
    trace = traced(llm)  # (drafted, accepted) of every verify; invariants after every step
    got = llm.generate(ps[:1], greedy(), use_tqdm=False)
    got += llm.generate(ps[1:], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    # Request 5 resumes at the branch point request 2 saved (28: block 6 is keyed on token 28,
    # which they share); request 3 branches right after block 6, keyed on another token.
    assert got[4].num_cached_tokens == 28 and got[2].num_cached_tokens <= 24
    accepted = [a for verifies in trace["verifies"].values() for _, a in verifies]
    assert 0 in accepted and max(accepted) >= min(k, 2), accepted  # several a step, too


@pytest.mark.parametrize(
    "overlap,k,force,caching", [(False, 2, None, True), (True, 2, None, True), (True, 1, 1, False)]
)
def test_graph_steps_are_transformers(expected, overlap, k, force, caching):
    """Decode and verify graphs (replayed eagerly on the CPU): a verify replay's rows keep each
    token's state in the slots its inputs name and the runner commits the accepted one after the
    drafting replay (then saves checkpoints); steps whose rows carry no drafts replay a decode
    graph. Greedy: transformers' tokens; forced acceptance: the eager steps' tokens."""
    path, ps, want = expected
    kw = dict(BASE_KW, max_num_seqs=8, async_scheduling=overlap, enable_prefix_caching=caching)
    kw |= dict(speculative_method="mtp", num_speculative_tokens=k, spec_force_accept=force)

    def run(graphs: bool):
        llm = LLM(path, **kw)
        if graphs:
            eager_decode_graphs(llm, verify=True)
        got = llm.generate(ps[:1], greedy(), use_tqdm=False)
        got += llm.generate(ps[1:], greedy(), use_tqdm=False)
        llm.engine.check_invariants()
        return llm, got

    if force is not None:
        want = [o.outputs[0].token_ids for o in run(graphs=False)[1]]
    llm, got = run(graphs=True)
    assert [o.outputs[0].token_ids for o in got] == want
    r = llm.engine.runner
    assert r.verify_graphs.num_replays > 5 and r.graphs.num_replays > 0
    assert llm.engine.spec.stats.num_accepted_tokens > 0
    if caching:
        assert got[-1].num_cached_tokens > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_is_mtp_offs(expected, overlap):
    """Seeded sampling: each emitted token draws what the step without speculation draws (the
    same RNG counter), so MTP on gives MTP off's tokens, in either loop."""
    path, ps, _ = expected
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=12, ignore_eos=True)
    kw = dict(BASE_KW, enable_prefix_caching=True, async_scheduling=overlap)
    want = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(ps, params, use_tqdm=False)]
    llm = LLM(path, **kw, speculative_method="mtp", num_speculative_tokens=2)
    got = llm.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.engine.spec.stats.num_accepted_tokens > 0
