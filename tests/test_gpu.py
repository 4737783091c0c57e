"""GPU end to end (make test-gpu): Triton kernels + CUDA graphs against transformers on the same
dummy weights in real shapes; graphs on vs off give identical greedy outputs."""

from __future__ import annotations

import gc
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

# bench.py sits in the checkout, which `make test-gpu` (PYTHONSAFEPATH) keeps off sys.path: put
# it last, so its kernels/ does not shadow the PyPI `kernels` that transformers imports.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import SHAPES  # noqa: E402
from tinyserve import LLM, SamplingParams  # noqa: E402


def shape_dir(tmp_path, name: str, **override) -> str:
    cfg = {**SHAPES[name], **override}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


def to_hf(llm, path: str, dtype: torch.dtype):
    """transformers model holding exactly our (dummy) weights, unpacked to HF names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = llm.engine.runner.model
    mc = llm.engine.model_config
    q = mc.num_attention_heads * mc.head_dim
    kv = mc.num_key_value_heads * mc.head_dim
    sd = {}
    for name, p in model.named_parameters():
        if "qkv_proj" in name:
            for part, t in zip("qkv", p.split([q, kv, kv])):
                sd[name.replace("qkv_proj", f"{part}_proj")] = t
        elif "gate_up_proj" in name:
            gate, up = p.chunk(2)
            sd[name.replace("gate_up_proj", "gate_proj")] = gate
            sd[name.replace("gate_up_proj", "up_proj")] = up
        else:
            sd[name] = p
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return hf.eval()


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_logits_and_greedy_match_transformers(tmp_path, name):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = shape_dir(tmp_path, name, num_hidden_layers=8, max_position_embeddings=4096)
    llm = LLM(path, load_format="dummy", dtype="float32", seed=0, max_num_seqs=8)
    hf = to_hf(llm, path, torch.float32)
    prompts = [[(37 * i + 11 * j) % 5000 + 100 for j in range(20 + 7 * i)] for i in range(4)]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompts[0]], device="cuda")).logits[0, -1].float()
    got = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=1), use_tqdm=False
    )
    first = got[0].outputs[0]
    ref_lp = torch.log_softmax(ref, -1)
    assert abs(first.logprobs[0][first.token_ids[0]] - ref_lp.max().item()) < 2e-3
    # Alone, the prompt decodes at batch 1: the fused gemv prologues (norm, SiLU) and the
    # rope_store_kv kernel run there, so they are checked against transformers too.
    alone = llm.generate(prompts[1:2], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for p, out in zip(prompts + prompts[1:2], got + alone):
        with torch.inference_mode():
            want = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == want[0, len(p) :].tolist()
    llm.engine.check_invariants()


def spy_split_counts(graphs) -> set:
    """The split counts (key[2]) of the graphs `graphs` replays from now on."""
    used = set()
    for key, graph in list(graphs.graphs.items()):
        graphs.graphs[key] = SimpleNamespace(
            replay=lambda key=key, graph=graph: (used.add(key[2]), graph.replay())
        )
    return used


def test_cuda_graphs_on_off_identical(tmp_path):
    """Batch 12, then one sequence whose context grows from 50 to 300 keys: its decode steps
    move through graphs of 1, 4, 8 and 16 splits (decode_num_splits; the last three in 32-key
    tiles, decode_tiling), as the eager steps do."""
    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=4096)
    prompts = [[(13 * i + j) % 3000 + 50 for j in range(10 + 5 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(path, load_format="dummy", seed=0, max_num_seqs=16, enforce_eager=eager)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        splits = spy_split_counts(graphs) if graphs is not None else set()
        runs = [
            llm.generate(prompts, params, use_tqdm=False),
            llm.generate([prompts[3] * 2], long, use_tqdm=False),
        ]  # 50 + 250 tokens
        outs.append([o.outputs[0].token_ids for run in runs for o in run])
        assert eager or {1, 4, 8, 16} <= splits, splits
        del llm, graphs
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_long_row_beside_short_ones_takes_the_long_split_graphs(tmp_path):
    """12 short sequences decode beside one whose context passes 9,000 keys: a batch of 13
    (padded 16: 2 GPU-filling splits) whose longest context leaves a split over LONG_SPLIT_KEYS
    takes the LONG_SPLITS graphs (short rows in one split of them), with the eager steps'
    outputs."""
    from tinyserve.runner.graph_shapes import LONG_SPLITS

    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=16384)
    prompts = [[(13 * i + j) % 3000 + 50 for j in range(10 + 5 * i)] for i in range(12)]
    prompts.append([(7 * j) % 5000 + 100 for j in range(9000)])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(
            path,
            load_format="dummy",
            seed=0,
            max_num_seqs=16,
            enforce_eager=eager,
            prefill_lane_tokens=0,
        )  # the same prompt kernels both ways
        graphs = llm.engine.runner.graphs
        splits = spy_split_counts(graphs) if graphs is not None else set()
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert eager or LONG_SPLITS in splits, splits
        del llm, graphs
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_mixed_graphs_read_a_long_decode_row_in_the_long_split_count(tmp_path):
    """A prompt is chunked (mixed graphs, no lane) while 12 short sequences decode beside one
    whose context passes 9,000 keys: those mixed steps take the LONG_SPLITS graphs, with the
    eager steps' tokens (float32: eager mixed steps attend decode rows with the prefill kernel)."""
    from tinyserve.runner.graph_shapes import LONG_SPLITS

    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=16384)
    prompts = {f"s{i}": [(13 * i + j) % 3000 + 50 for j in range(10 + 5 * i)] for i in range(12)}
    prompts["long"] = [(7 * j) % 5000 + 100 for j in range(9000)]
    late = [(11 * j) % 4000 + 70 for j in range(400)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=140, ignore_eos=True)  # past the late one

    def run(eager: bool) -> tuple[dict, set]:
        llm = LLM(
            path,
            load_format="dummy",
            dtype="float32",
            seed=0,
            max_num_seqs=16,
            num_kv_blocks=2048,
            max_num_batched_tokens=128,
            enforce_eager=eager,
            prefill_lane_tokens=0,
        )
        engine, used, sent = llm.engine, set(), []
        for g in engine.runner.mixed_graphs.values():
            for key, graph in list(g.graphs.items()):
                g.graphs[key] = SimpleNamespace(
                    replay=lambda key=key, graph=graph: (used.add(key[2][0]), graph.replay())
                )
        for rid, p in prompts.items():
            engine.add_request(rid, p, params if rid == "long" else short)

        def arrive(d):  # the late prompt, once the long row decodes
            if d.request_id == "long" and not sent:
                sent.append(engine.add_request("late", late, params))

        return steps_without_sync(engine, range(0), arrive), used

    graphed, used = run(eager=False)
    gc.collect()
    torch.cuda.empty_cache()
    assert LONG_SPLITS in used, used
    assert graphed == run(eager=True)[0]


def test_shared_prefix_graphs_match_eager(tmp_path):
    """24 prompts on two 300-token heads: decode steps replay the shared-prefix (cascade)
    graphs; fp32 keeps rounding out of the comparison with the eager row-by-row attention."""
    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=4, max_position_embeddings=4096)
    heads = [[(7 * j + 100 * h) % 4000 + 50 for j in range(300)] for h in range(2)]
    prompts = [heads[i % 2] + [(31 * i + j) % 3000 + 60 for j in range(3 + i)] for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(
            path, load_format="dummy", dtype="float32", seed=0, max_num_seqs=32, enforce_eager=eager
        )
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if not eager:
            assert llm.engine.runner.graphs.num_shared_replays >= 10
        llm.engine.check_invariants()
        del llm
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_mixed_batches_with_shared_prefixes_match_transformers(tmp_path, monkeypatch):
    """64-token budgets interleave prompt chunks (some after prefix-cache hits) with decode
    rows in one forward, then decode steps share prefixes: greedy = transformers."""
    import tinyserve.runner.model_runner as runner_module

    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=4, max_position_embeddings=4096)
    llm = LLM(
        path,
        load_format="dummy",
        dtype="float32",
        seed=0,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )
    mixed = []
    prepare = runner_module.build_host_inputs

    def spy(*args):
        h = prepare(*args)
        mixed.append(1 in h.q_lens and max(h.q_lens) > 1)
        return h

    monkeypatch.setattr(runner_module, "build_host_inputs", spy)
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = to_hf(llm, path, torch.float32)
    head = [(7 * j) % 4000 + 50 for j in range(200)]
    prompts = [head + [(31 * i + j) % 3000 + 60 for j in range(5 + 9 * i)] for i in range(10)]
    got = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    assert sum(mixed) >= 5 and llm.engine.runner.graphs.num_shared_replays >= 1
    for p, out in zip(prompts, got):
        with torch.inference_mode():
            want = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == want[0, len(p) :].tolist()
    llm.engine.check_invariants()


def test_speculative_decoding_is_lossless_and_verifies_in_graphs(tmp_path):
    """MTP and n-gram speculation (k = 3) give the greedy tokens of plain decoding (fp32), with
    CUDA graphs on and off; with graphs on, the verify steps replay the verify graphs."""
    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=4,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    base = [(7 * j) % 900 + 100 for j in range(40)]
    prompts = [base[: 10 + 3 * i] + base[:12] for i in range(10)]  # repeats for n-gram hits
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(load_format="dummy", dtype="float32", seed=0, max_num_seqs=16, num_kv_blocks=2048)
    ref = [
        o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    ]
    for method in ("mtp", "ngram"):
        for eager in (False, True):
            llm = LLM(
                path, **kw, speculative_method=method, num_speculative_tokens=3, enforce_eager=eager
            )
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert got == ref, (method, eager)
            llm.engine.check_invariants()
            if not eager and method == "mtp":
                assert llm.engine.runner.verify_graphs.num_replays > 10
            del llm
            torch.cuda.empty_cache()


def steps_without_sync(engine, strict, on_delta=None) -> dict[str, list[int]]:
    """Step the engine to the end; steps whose index is in `strict` (steady state: after prefill
    and warm-up, before the ends; or where `strict(index, engine)` is true) run under
    set_sync_debug_mode('error'), so any implicit device sync raises. Returns each request's
    tokens; `on_delta` sees every delta."""
    got: dict[str, list[int]] = {}
    for n in range(1000):
        if not engine.has_unfinished():
            break
        check = strict(n, engine) if callable(strict) else n in strict
        torch.cuda.set_sync_debug_mode("error" if check else "default")
        try:
            deltas = engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for d in deltas:
            got.setdefault(d.request_id, []).extend(d.outputs[0].token_ids)
            if on_delta is not None:
                on_delta(d)
    assert not engine.has_unfinished()
    return got


def overlapped_and_synchronous(path, requests: dict, strict: range, graphs_ran, **kw) -> list:
    """Each request's tokens ({i: (prompt, params)}) from the overlapped loop, whose steps in
    `strict` run under set_sync_debug_mode('error'), then from the synchronous loop; every
    engine's invariants hold and `graphs_ran(engine)` is true."""
    outs = []
    for overlap in (True, False):
        llm = LLM(
            path, load_format="dummy", seed=0, num_kv_blocks=2048, async_scheduling=overlap, **kw
        )
        engine = llm.engine
        for i, (p, sp) in requests.items():
            engine.add_request(str(i), p, sp)
        outs.append(steps_without_sync(engine, strict if overlap else range(0)))
        engine.check_invariants()
        assert graphs_ran(engine)
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("greedy_only", [False, True])
def test_overlapped_loop_has_no_hidden_sync_and_same_outputs(tmp_path, greedy_only):
    """Steady-state overlapped steps run under set_sync_debug_mode('error') (any implicit
    device sync raises), and give the tokens of the synchronous loop. Greedy-only batches take
    the graph's own argmax and gather their inputs inside the replay."""
    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=4096)
    prompts = [[(11 * i + 3 * j) % 3000 + 50 for j in range(8 + 3 * i)] for i in range(8)]
    params = [
        SamplingParams(
            temperature=0.8 if i % 2 and not greedy_only else 0,
            seed=i,
            max_tokens=40,
            ignore_eos=True,
            logprobs=1 if i == 3 and not greedy_only else None,
        )
        for i in range(8)
    ]
    outs = overlapped_and_synchronous(
        path,
        dict(enumerate(zip(prompts, params))),
        range(3, 30),
        lambda engine: engine.runner.graphs.num_replays > 20,
        max_num_seqs=16,
    )
    assert outs[0] == outs[1]


@pytest.mark.parametrize("token_map", [False, True])
def test_mtp_drafts_from_the_verify_graph_equal_eager_drafts(tmp_path, token_map):
    """The drafting graph replayed after a verify graph proposes what the eager MTP pass does
    (fp32; a split-count difference in the chained attention may flip a rare near-tie). The
    verify graphs take the split count of the context (12 to ~80 keys: 1 and 4), and the one
    drafting graph of a size reads the hidden states of whichever ran. With a token map, the
    graphs draft its ids only."""
    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=4,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    spec = {}
    if token_map:
        hot = list(range(151_679, 0, -5))
        (tmp_path / "map.json").write_text(json.dumps(hot))
        spec["speculative_token_map"] = str(tmp_path / "map.json")
    prompts = [[(13 * i + 5 * j) % 900 + 100 for j in range(12 + 5 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seen = []
    for eager in (False, True):  # the synchronous loop: the host holds the drafts
        llm = LLM(
            path,
            load_format="dummy",
            dtype="float32",
            seed=0,
            max_num_seqs=8,
            num_kv_blocks=2048,
            speculative_method="mtp",
            num_speculative_tokens=3,
            enforce_eager=eager,
            async_scheduling=False,
            **spec,
        )
        engine, drafts = llm.engine, []
        splits = set() if eager else spy_split_counts(engine.runner.verify_graphs)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished():
            engine.step()
            drafts.append(sorted((s.seq_id, tuple(s.draft_ids)) for s in engine.scheduler.running))
        if not eager:
            assert engine.runner.verify_graphs.num_replays > 10
            assert {1, 4} <= splits, splits
        seen.append(drafts)
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    assert len(seen[0]) == len(seen[1])
    same = sum(a == b for a, b in zip(*seen))
    assert same >= 0.9 * len(seen[0]), (same, len(seen[0]))
    if token_map:
        ids = {t for step in seen[0] + seen[1] for _, d in step for t in d}
        assert len(ids) > 5 and ids <= set(hot)


def test_verify_steps_take_the_split_k_decode_kernel(tmp_path, monkeypatch):
    """Eager MTP verify steps (k = 3) attend through decode_attention with query_len 4 (split-K
    over the context), not the prefill kernel; their greedy tokens are speculation-off's."""
    from tinyserve.model.layers import attention as layer

    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=4,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    query_lens = []
    real = layer.decode_attention

    def spy(*args, query_len=1, **kwargs):
        query_lens.append(query_len)
        return real(*args, query_len=query_len, **kwargs)

    monkeypatch.setattr(layer, "decode_attention", spy)  # the name the layer calls
    prompt = [(7 * j) % 900 + 100 for j in range(300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for spec in ({}, {"speculative_method": "mtp", "num_speculative_tokens": 3}):
        llm = LLM(
            path,
            load_format="dummy",
            dtype="float32",
            seed=0,
            max_num_seqs=4,
            enforce_eager=True,
            **spec,
        )
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]
    assert 4 in query_lens


@pytest.mark.parametrize(("force", "temperature"), [(None, 0), (None, 0.8), (2, 0), (2, 0.8)])
def test_overlapped_mtp_loop_has_no_hidden_sync_and_same_outputs(tmp_path, force, temperature):
    """MTP verify steps overlap: the next step's last token, drafts, positions and (seeded
    sampling) RNG counters come from the step in flight on the device. Steady-state steps run
    under set_sync_debug_mode('error') and give the synchronous loop's tokens (forced
    acceptance: every step moves positions and counters). Sampled rows read the accepted
    counts of the step in flight after their own verify replay: those counts must not sit in
    memory the replay reuses (free acceptance diverged at the second verify step)."""
    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=4,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    prompts = [[(13 * i + 5 * j) % 900 + 100 for j in range(12 + 5 * i)] for i in range(6)]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=60, ignore_eos=True)
    outs = overlapped_and_synchronous(
        path,
        {i: (p, params) for i, p in enumerate(prompts)},
        range(3, 10),
        lambda engine: engine.runner.verify_graphs.num_replays > 8,
        dtype="float32",
        max_num_seqs=8,
        speculative_method="mtp",
        num_speculative_tokens=3,
        spec_force_accept=force,
    )
    if force is None:
        assert outs[0] == outs[1]
    else:  # the overlapped loop drafts less in the last steps (a step in flight may accept)
        assert all(outs[0][r][:-10] == outs[1][r][:-10] for r in outs[1])


@pytest.mark.parametrize("force", [0, 1])
def test_mtp_steps_after_start_up_compile_no_kernel(tmp_path, force):
    """MTP verify steps after start-up, greedy and sampled, at batch sizes 1-9 and contexts
    past 256 tokens, compile no Triton kernel (a compile stalls every stream for 0.2-1 s).
    `test_steps_after_start_up_compile_no_kernel` covers plain steps on short prompts. The
    thirty-fifth session's `bench.py spec` saw one ~1.2 s stall at MTP batch 2; this test then
    found 28 variants compiled mid-run (eager drafting, accept and shift kernels, decode tiles),
    which `tinyserve.runner.warmup` and unspecialized step sizes removed (BENCHMARKS.md)."""
    from triton import knobs

    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=2,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    llm = LLM(
        path,
        load_format="dummy",
        seed=0,
        max_num_seqs=16,
        speculative_method="mtp",
        num_speculative_tokens=1,
        spec_force_accept=force,
    )
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(
        (kw["fn"].name, kw["compile"]["constants"])
    )
    try:
        kinds = [
            SamplingParams(temperature=0, max_tokens=260, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, max_tokens=240, ignore_eos=True),
        ]
        for batch in (1, 2, 5, 9):
            prompts = [
                [(7 * i + 3 * j) % 900 + 100 for j in range(32 + 9 * i)] + [batch]
                for i in range(batch)
            ]
            llm.generate(prompts, [kinds[i % 2] for i in range(batch)], use_tqdm=False)
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == [], sorted({name for name, _ in compiled})


def test_lm_head_writes_float32_accumulators(monkeypatch):
    """Above 64 rows (Qwen3's vocabulary) the LM head is cuBLAS writing float32 (torch >= 2.8):
    logits as exact as a float32 matmul of the same bf16 operands, into `out` or a new tensor;
    older torch (the fallback) rounds them to bf16 first, as HF's logits.float() does."""
    import torch.nn.functional as F

    from tinyserve.model.layers import embedding

    torch.manual_seed(0)
    head = embedding.LMHead(151936, 1024).cuda().to(torch.bfloat16)
    head.weight.normal_(0, 0.02)
    x = torch.randn(96, 1024, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ head.weight.float().t()
    for out in (None, torch.empty(96, 151936, device="cuda")):
        got = head(x, out)
        assert got.dtype == torch.float32 and (got - ref).abs().max().item() < 1e-3
    monkeypatch.setattr(embedding, "_MM_FLOAT_OUT", False)
    assert torch.equal(head(x), F.linear(x, head.weight).float())


def test_pdl_on_off_identical(tmp_path, monkeypatch):
    """Programmatic dependent launch only changes when kernels are scheduled: greedy outputs
    with it off equal those with it on, at batch 1 (fused decode kernels) and batch 12."""
    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=4096)
    prompts = [[(13 * i + j) % 3000 + 50 for j in range(10 + 5 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("TINYSERVE_PDL", flag)
        llm = LLM(path, load_format="dummy", seed=0, max_num_seqs=16, num_kv_blocks=512)
        runs = [
            llm.generate(prompts[:1], params, use_tqdm=False),
            llm.generate(prompts, params, use_tqdm=False),
        ]
        outs.append([o.outputs[0].token_ids for run in runs for o in run])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_split_k_sums_in_the_norms_change_no_bit(tmp_path, monkeypatch):
    """At 33-128 rows a 7-8B model's o and down projections run split-K and hand their partials
    unsummed to the next norm (or the last add), also past 64 rows, where the down projection
    follows a cuBLAS gate_up and its own SiLU (`Linear.gated`): greedy tokens and logprobs equal
    those of summing them in the projections (decode steps of 96, then 48 rows, in graphs)."""
    from tinyserve.kernels.gemv import SplitSum
    from tinyserve.model.layers.linear import Linear

    path = shape_dir(tmp_path, "llama-3.1-8b", num_hidden_layers=2, max_position_embeddings=4096)
    prompts = [[(29 * i + 7 * j) % 20000 + 100 for j in range(3 + i % 5)] for i in range(96)]
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 6 * (i % 2), logprobs=2, ignore_eos=True)
        for i in range(96)
    ]
    deferred, gated = [], []
    split_gated = Linear.gated
    unreduced = Linear.unreduced

    def spy(self, x):
        y = unreduced(self, x)
        deferred.append(isinstance(y, SplitSum))
        return y

    def gated_spy(self, x):
        y = split_gated(self, x)
        gated.append(isinstance(y, SplitSum))
        return y

    runs = []
    for patch in (spy, Linear.forward):
        monkeypatch.setattr(Linear, "unreduced", patch)
        monkeypatch.setattr(Linear, "gated", gated_spy)
        llm = LLM(path, load_format="dummy", seed=0, max_num_seqs=128)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert any(deferred) and any(gated)
    assert runs[0] == runs[1]


def test_prefill_lane_on_its_stream_gives_the_steps_outputs(tmp_path):
    """A 5,000-token prompt arriving while 12 sequences decode: with the lane (its graph on a
    green-context stream, as by default) its chunks 2,048 tokens at a time run beside the decode
    steps, which meanwhile do no device sync, up to its last token; the outputs are those of
    the engine without the lane (512-token chunks inside the steps), see below."""
    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=8192)
    prompts = [[(13 * i + j) % 3000 + 50 for j in range(10 + 5 * i)] for i in range(12)]
    long = [(7 * j) % 5000 + 100 for j in range(5000)]
    short = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    outs = []
    for lane_tokens in (2048, 0):
        llm = LLM(
            path,
            load_format="dummy",
            seed=0,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            prefill_lane_tokens=lane_tokens,
        )
        engine, lane = llm.engine, llm.engine.runner.lane
        assert (lane is not None and lane.graph is not None) == bool(lane_tokens)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, short)
        for _ in range(5):
            engine.step()
        engine.add_request("long", long, SamplingParams(temperature=0, max_tokens=8, logprobs=5))
        firsts = []  # the long prompt's logprobs, first token first

        def lane_busy(n, engine, lane=lane):  # the steps beside lane chunks in flight
            return lane is not None and bool(engine.scheduler.lane) and n > 8

        def keep(d, firsts=firsts):
            if d.request_id == "long":
                firsts.extend(d.outputs[0].logprobs)

        tokens = steps_without_sync(engine, lane_busy, keep)
        engine.check_invariants()
        assert lane is None or lane.num_launched == 3  # 500-2548, -4596, -4999 (padded)
        outs.append((tokens, firsts[0]))
        # The closures hold the lane, whose model holds the KV cache: the next engine needs it.
        del llm, engine, lane, lane_busy, keep
        gc.collect()
        torch.cuda.empty_cache()
    (lane_tokens, lane_first), (step_tokens, step_first) = outs
    # The prompt's last token runs as a 1-token row of a decode graph with the lane, inside a
    # prompt chunk without: other kernels, so its KV may differ in the last bits, and later
    # tokens of this dummy model may flip on near-ties (seen at the third token). Its first
    # token's top-5 must agree; the decode rows beside it are not touched at all.
    assert lane_tokens.pop("long")[0] == step_tokens.pop("long")[0]
    assert lane_tokens == step_tokens
    assert lane_first.keys() == step_first.keys()
    for i, lp in lane_first.items():
        assert abs(lp - step_first[i]) < 0.05, (lane_first, step_first)


@pytest.mark.parametrize("eager", [False, True])
def test_steps_after_start_up_compile_no_kernel(tmp_path, eager):
    """Start-up compiles what the steps launch: later eager steps of any batch size, sampled or
    greedy, with penalties, logprobs or prefix hits, compile no Triton kernel (a compile stalls
    the step loop for ~0.2 s on the H100 host; the race kernels compiled once per new batch
    size until the chunk count became a runtime argument). With enforce_eager every decode
    step is eager, so start-up runs the eager warm-up steps for it too (`warmup`)."""
    from triton import knobs

    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=2)
    llm = LLM(
        path,
        load_format="dummy",
        seed=0,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        enforce_eager=eager,
    )
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(
        (kw["fn"].name, kw["compile"]["constants"])
    )
    try:
        head = [(5 * j) % 3000 + 50 for j in range(100)]
        kinds = [
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=6, ignore_eos=True),
            SamplingParams(
                temperature=1.0,
                top_k=20,
                repetition_penalty=1.1,
                max_tokens=6,
                ignore_eos=True,
                logprobs=3,
            ),
        ]
        for batch in (1, 2, 3, 5, 9, 17, 33, 70, 120):
            prompts = [head[: 20 + (7 * i) % 80] + [i + 7, batch] for i in range(batch)]
            llm.generate(prompts, [kinds[i % 3] for i in range(batch)], use_tqdm=False)
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == [], sorted({name for name, _ in compiled})
