"""`bench.py serve`: an online client against a running `tinyserve run` (--url), sweeping request
rates and concurrencies, with vLLM's metric definitions: TTFT is request sent -> first chunk with
text; ITL the gaps between successive text chunks, pooled over requests; TPOT per request
(E2E latency - TTFT) / (output tokens - 1); throughputs over the run's wall time. /health is
probed from a separate process the whole time (the event loop's latency)."""

from __future__ import annotations

import json
import time

from tinyserve.bench.common import pct


def bench_serve(args) -> dict:
    import asyncio

    return {"server": args.url, "rows": asyncio.run(serve_sweep(args))}


async def serve_sweep(args) -> list[dict]:
    import random

    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        args.url, headers=headers, timeout=timeout, connector=conn
    ) as client:
        async with client.get("/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        lo, hi = 1 - args.range_ratio, 1 + args.range_ratio
        await serve_one(client, model, list(range(1000, 1016)), 4)  # warm-up
        rows = []
        for rate in args.request_rate:
            for conc in args.concurrency:
                # new random prompts per run, so no run hits the previous one's prefix cache
                rng = random.Random(len(rows))
                reqs = [
                    (
                        [
                            rng.randrange(1000, 30000)
                            for _ in range(max(1, round(args.input_len * rng.uniform(lo, hi))))
                        ],
                        max(1, round(args.output_len * rng.uniform(lo, hi))),
                    )
                    for _ in range(args.num_prompts)
                ]
                rows.append(await serve_run(client, model, reqs, rate, conc, args))
                print(json.dumps(rows[-1]))
        return rows


async def serve_one(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    chunk_times, num_out = [], 0
    async with client.post("/v1/completions", json=body) as r:
        if r.status != 200:
            return {"ok": False}
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                num_out = event["usage"]["completion_tokens"]
            choice = event["choices"][0] if event["choices"] else None
            # a chunk per token; a model without a tokenizer streams chunks with empty text
            if choice and (choice["text"] or choice.get("finish_reason") is None):
                chunk_times.append(time.perf_counter())
    end = time.perf_counter()
    if not chunk_times:
        return {"ok": False}
    ttft = chunk_times[0] - t0
    return {
        "ok": True,
        "ttft": ttft,
        "e2el": end - t0,
        "num_out": num_out,
        "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
        "tpot": (end - t0 - ttft) / (num_out - 1) if num_out > 1 else None,
    }


async def serve_run(client, model: str, reqs, rate: float, conc: int, args) -> dict:
    import asyncio
    import multiprocessing
    import random

    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    probe = ctx.Process(target=probe_health, args=(args.url, args.health_hz, stop, out))
    probe.start()
    sem = asyncio.Semaphore(conc)
    rng = random.Random(1)

    async def limited(prompt, max_tokens):
        async with sem:
            return await serve_one(client, model, prompt, max_tokens)

    t0 = time.perf_counter()
    tasks = []
    for prompt, max_tokens in reqs:  # Poisson arrivals at `rate` req/s (inf: all at once)
        tasks.append(asyncio.ensure_future(limited(prompt, max_tokens)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    stop.set()
    health = await asyncio.get_running_loop().run_in_executor(None, out.get)
    probe.join()
    done = [r for r in results if r["ok"]]
    ms = 1e3
    num_out = sum(r["num_out"] for r in done)
    num_in = sum(len(p) for (p, _), r in zip(reqs, results) if r["ok"])
    itl = [x for r in done for x in r["itl"]]
    tpot = [r["tpot"] for r in done if r["tpot"] is not None]
    return {
        "rate": rate,
        "concurrency": conc,
        "num_prompts": len(reqs),
        "completed": len(done),
        "duration_s": duration,
        "req_per_s": len(done) / duration,
        "out_tok_per_s": num_out / duration,
        "total_tok_per_s": (num_in + num_out) / duration,
        "ttft_median_ms": pct([r["ttft"] for r in done], 0.5) * ms,
        "ttft_p99_ms": pct([r["ttft"] for r in done], 0.99) * ms,
        "tpot_median_ms": pct(tpot, 0.5) * ms,
        "tpot_p99_ms": pct(tpot, 0.99) * ms,
        "itl_median_ms": pct(itl, 0.5) * ms,
        "itl_p99_ms": pct(itl, 0.99) * ms,
        "e2el_median_ms": pct([r["e2el"] for r in done], 0.5) * ms,
        "health_n": len(health),
        "health_p50_ms": pct(health, 0.5) * ms,
        "health_p99_ms": pct(health, 0.99) * ms,
        "health_max_ms": max(health, default=0) * ms,
    }


def probe_health(url: str, hz: float, stop, out) -> None:
    """GET /health at `hz` on one keep-alive connection until `stop`; put the latencies (s)."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
    lat = []
    while not stop.is_set():
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        lat.append(time.perf_counter() - t0)
        time.sleep(max(0.0, 1 / hz - (time.perf_counter() - t0)))
    out.put(lat)
