"""GPU end to end (make test-gpu), the step loop: overlapped steps do no hidden device sync
and give the synchronous loop's tokens, the prefill lane on its stream gives the steps'
outputs, and no step after start-up compiles a kernel."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from gpu_helpers import overlapped_and_synchronous, shape_dir, steps_without_sync  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402


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
    the step loop: BENCHMARKS.md). With enforce_eager every decode step is eager, so start-up
    runs the eager warm-up steps for it too (`warmup`)."""
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
