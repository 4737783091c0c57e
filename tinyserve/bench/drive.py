"""Driving an engine in-process for a benchmark: requests arriving on a schedule or in a closed
loop (`drive`), offline `generate` runs timed after a warm-up (`run_offline`), the steady decode
step (`steady_step_ms`), and the server's GC setup (`as_served`) undone by `free_gpu`."""

from __future__ import annotations

import time

import torch


def drive(engine, arrivals: list[tuple[float, str, list[int], object]], then=None) -> dict:
    """Step the engine over requests arriving at given offsets (seconds); per request: arrival,
    first-token time and every token's time (for TTFT and inter-token latency), its prompt, its
    output ids and the prompt tokens the prefix cache served (`cached`). `then(rid, output_ids)`,
    if given, is called as each request finishes and returns (rid, ids, params) to add at once:
    a closed loop, such as a chat whose next turn is sent when the answer is complete."""
    pending = sorted(arrivals, key=lambda a: a[0])
    stats: dict[str, dict] = {}
    t0 = time.perf_counter()

    def add(rid: str, ids: list[int], params, now: float) -> None:
        engine.add_request(rid, ids, params)
        stats[rid] = {"arrival": now, "times": [], "prompt": ids, "ids": [], "cached": 0}

    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            _, rid, ids, params = pending.pop(0)
            add(rid, ids, params, now)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for d in engine.step():
            t = time.perf_counter() - t0
            st = stats[d.request_id]
            new = [i for o in d.outputs for i in o.token_ids]
            st["times"] += [t] * len(new)
            st["ids"] += new
            st["cached"] = d.num_cached_tokens
            if d.finished and then is not None:
                for rid, ids, params in then(d.request_id, st["ids"]):
                    add(rid, ids, params, t)
    stats["_elapsed"] = time.perf_counter() - t0
    return stats


def as_served(engine) -> None:
    """The server's start-up GC setup (cli.py): objects built so far leave the collector's
    generations, so full collections stop rescanning them (an unfrozen heap's collections
    stalled the GPU mid-run: docs/benchmark-log.md). `free_gpu` undoes it."""
    import gc

    gc.collect()
    gc.freeze()


def free_gpu() -> None:
    """Return the memory of engines the caller dropped (weights, KV pool, graph pools)."""
    import gc

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_offline(llm, prompts, out_lens, temperature: float = 0.0) -> tuple[float, int]:
    """(seconds, output tokens) of one `generate` over prompts, after a short warm-up."""
    from tinyserve import SamplingParams

    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(out_lens)
    ]
    warm = [p[::-1] for p in prompts[:2]]  # not the prompts themselves: no prefix-cache hits
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == list(out_lens)
    return dt, sum(out_lens)


def steady_step_ms(llm, prompts, out_len: int, temperature: float = 0.0) -> float:
    """Mean wall ms of the engine steps that run once every prompt has its first token, to the
    end: a decode step as TPOT counts it (prefill and first tokens excluded). Every prompt has
    the same length and output length, so all rows run to the last step."""
    from tinyserve import SamplingParams

    engine = llm.engine
    for i, p in enumerate(prompts):
        params = SamplingParams(
            temperature=temperature, seed=i, max_tokens=out_len, ignore_eos=True
        )
        engine.add_request(f"steady-{i}", p, params)
    started, t0, steps = set(), 0.0, 0
    while engine.has_unfinished():
        deltas = engine.step()
        if len(started) == len(prompts):
            steps += 1
        else:
            started.update(d.request_id for d in deltas if d.outputs[0].token_ids)
            t0 = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / max(steps, 1) * 1e3
