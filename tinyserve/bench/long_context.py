"""The long-context run of `bench.py prefix`: streams decode, a long prompt arrives; the streams'
inter-token latency while it is computed and while it decodes beside them, against a control run
without it, and its TTFT against the idle engine. Also returns the run's timeline (step end
times, streams served per step, the long prompt's arrival / first token / finish) to plot."""

from __future__ import annotations

import time

from tinyserve.bench.common import pct
from tinyserve.bench.drive import as_served, drive, free_gpu

LONG_ROW_TOKENS = 32  # the long prompt's tokens after its first, decoded beside the streams


def long_context(
    path,
    load_format,
    budget,
    n_streams,
    long_len,
    rand_ids,
    lane_tokens=None,
    lane_reserve_sms=None,
) -> tuple[dict, dict]:
    """Streams decode; a long prompt arrives: ITL p99 while it is computed (beside them on the
    prefill lane where there is one, else chunked into their steps) vs the median without it,
    and its TTFT vs the same prompt on the idle engine; then the ITL median while it decodes
    LONG_ROW_TOKENS tokens beside them (one long row among short ones).

    "Without it" is a control run: fresh streams of the same lengths, stepped as many times
    with no long prompt, medians taken over the same step ranges. The streams' own contexts
    grow meanwhile (64 -> ~550 tokens while qwen3-0.6b's 32k prompt runs: its decode step reads
    ~4x the KV by the end), so the steps before the prompt arrived understate a step without
    it; their median is kept as `itl_median_ms_before`.

    Returns (row, timeline). The timeline holds, for the run and for the control, each step's end
    (s from its loop's start) and how many streams got tokens at it: the streams decode in
    lockstep, so the steps that served them are their token timestamps, and the gaps between
    steps are the intervals the row's medians and p99 are taken over. Also the long prompt's
    arrival, first token and finish on the run's clock. Recording costs a len() and two
    appends a step: no objects for the collector, no host work that would move the ITL."""
    from tinyserve import LLM, SamplingParams

    llm = LLM(
        path,
        load_format=load_format,
        max_num_batched_tokens=budget,
        seed=0,
        prefill_lane_tokens=lane_tokens,
        prefill_lane_reserve_sms=lane_reserve_sms,
    )
    engine = llm.engine
    lane = engine.runner.lane
    long_len = min(long_len, engine.max_model_len - 64)
    one = SamplingParams(temperature=0, max_tokens=1)
    drive(engine, [(0.0, "warm", rand_ids(min(long_len, 4 * budget)), one)])  # compile, warm
    as_served(engine)
    alone = drive(engine, [(0.0, "alone", rand_ids(long_len), one)])
    ttft_alone = alone["alone"]["times"][0] - alone["alone"]["arrival"]
    endless = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    for i in range(n_streams):
        engine.add_request(f"s{i}", rand_ids(64), endless)
    for _ in range(10):  # admission and warm-up
        engine.step()
    long_ids = rand_ids(long_len)  # fresh ids: no prefix hit (drawn here: 32k draws take ~10 ms)
    long = SamplingParams(temperature=0, max_tokens=1 + LONG_ROW_TOKENS, ignore_eos=True)
    before, during, beside, t_long, ttft, last = [], [], [], None, None, time.perf_counter()
    done, t0, step_ends, served = False, last, [], []
    while not done:
        if t_long is None and len(before) >= 30:
            engine.add_request("long", long_ids, long)
            t_long = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        (before if t_long is None else during if ttft is None else beside).append(now - last)
        last = now
        step_ends.append(now)
        num_served = len(deltas)  # the streams (and the long prompt) given tokens this step
        for d in deltas:
            if d.request_id == "long":
                num_served -= 1
                ttft = ttft or now - t_long
                done = d.finished
        served.append(num_served)
    for i in range(n_streams):
        engine.abort(f"s{i}")
    engine.step()
    # The control: the same schedule without the long prompt.
    for i in range(n_streams):
        engine.add_request(f"c{i}", rand_ids(64), endless)
    for _ in range(10):
        engine.step()
    control, last = [], time.perf_counter()
    c0, control_ends, control_served = last, [], []
    for _ in range(len(before) + len(during) + len(beside)):
        deltas = engine.step()
        now = time.perf_counter()
        control.append(now - last)
        last = now
        control_ends.append(now)
        control_served.append(len(deltas))
    for i in range(n_streams):
        engine.abort(f"c{i}")
    engine.step()
    engine.check_invariants()
    llm = engine = None
    free_gpu()
    start, end = len(before), len(before) + len(during)
    row = {
        "workload": "long_context",
        "streams": n_streams,
        "long_prompt": long_len,
        "budget": budget,
        "itl_median_ms_before": 1e3 * pct(before, 0.5),
        "itl_median_ms_without": 1e3 * pct(control[start:end], 0.5),
        "itl_median_ms_without_beside": 1e3 * pct(control[end:], 0.5),
        "itl_p99_ms_during": 1e3 * pct(during, 0.99),
        "itl_median_ms_during": 1e3 * pct(during, 0.5),
        "steps_during": len(during),
        "ttft_long_s": ttft,
        "ttft_long_alone_s": ttft_alone,
        "prefill_lane_tokens": lane.chunk if lane else 0,
        "prefill_lane_on_stream": bool(lane and lane.stream is not None),
        "prefill_lane_chunks": lane.num_launched if lane else 0,
        "prefill_lane_reserve_sms": lane.reserve_sms if lane else 0,
        "itl_median_ms_beside_long_row": 1e3 * pct(beside, 0.5),
    }
    row["itl_p99_ratio"] = row["itl_p99_ms_during"] / row["itl_median_ms_without"]
    row["itl_p99_ratio_vs_before"] = row["itl_p99_ms_during"] / row["itl_median_ms_before"]
    row["ttft_ratio"] = ttft / ttft_alone
    row["long_row_itl_ratio"] = (
        row["itl_median_ms_beside_long_row"] / row["itl_median_ms_without_beside"]
    )
    timeline = {
        "step_end_s": [round(t - t0, 6) for t in step_ends],
        "streams_with_tokens": served,
        "long_arrival_s": round(t_long - t0, 6),
        "long_first_token_s": round(t_long + ttft - t0, 6),
        "long_finished_s": round(step_ends[-1] - t0, 6),
        "control_step_end_s": [round(t - c0, 6) for t in control_ends],
        "control_streams_with_tokens": control_served,
    }
    return row, timeline
