"""Plots of a bench.py result (the dict it writes as JSON), so they can be drawn on any machine:
throughput vs batch size from the rows that have a `batch` key, and the streams' inter-token
latency over time while a long prompt prefills from `long_context_timeline` (`bench.py prefix`).
matplotlib is imported only here, lazily: `pip install tinyserve[bench]`."""

from __future__ import annotations

import os

THROUGHPUT_PNG = "throughput_vs_batch.png"
ITL_PNG = "itl_during_prefill.png"
MISSING = "plotting needs matplotlib: pip install tinyserve[bench]"


def require_matplotlib() -> None:
    """Fail before a long run rather than after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(MISSING) from None


def _figure():
    require_matplotlib()
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    return fig, fig.subplots()


def throughput_series(res: dict) -> dict[str, list[tuple[int, float]]]:
    """Output tokens/s by batch size, a curve per engine / dtype / speculation setting:
    cpu rows give `tinyserve_<dtype>` and `transformers_float32`; e2e `decode` rows and spec
    rows give `out_tok_per_s` (spec labelled by k and forced acceptance)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    vocabs = {r["draft_vocab"] for r in res.get("rows", []) if r.get("k") and "draft_vocab" in r}
    for row in res.get("rows", []):
        if not isinstance(row.get("batch"), int):
            continue
        if "out_tok_per_s" in row:
            if "forced_accept" in row:
                k, f = row["k"], row["forced_accept"]
                label = "plain decode" if not k else f"MTP k={k}, {f} accepted"
                if k and len(vocabs) > 1:  # one run per --draft-vocab value
                    label += f", draft vocab {row['draft_vocab']}"
            elif row.get("k"):
                label = f"{row.get('method', 'spec')} k={row['k']}"
            else:
                label = "tinyserve" if row.get("workload") == "decode" else "plain decode"
            curves.setdefault(label, []).append((row["batch"], row["out_tok_per_s"]))
        for key, value in row.items():
            if key.startswith(("tinyserve_", "transformers_")) and isinstance(value, float):
                name, _, dtype = key.partition("_")
                curves.setdefault(f"{name} {dtype}", []).append((row["batch"], value))
    return {label: sorted(points) for label, points in curves.items()}


def itl_series(step_end_s: list[float], served: list[int]) -> tuple[list, list]:
    """(token times s, ITL ms): the steps that gave the streams tokens, and each one's gap to
    the previous such step (the first from the loop's start, as the row's intervals count)."""
    times, itl, prev = [], [], 0.0
    for t, n in zip(step_end_s, served):
        if n:
            times.append(t)
            itl.append((t - prev) * 1e3)
            prev = t
    return times, itl


def _subtitle(res: dict) -> str:
    where = res.get("device") or res.get("machine") or ""
    return ", ".join(str(x) for x in (res.get("model"), where, res.get("commit")) if x)


def plot_throughput(res: dict, path: str) -> bool:
    """Write the throughput-vs-batch PNG; False (nothing written) unless the rows cover at
    least two batch sizes."""
    curves = throughput_series(res)
    batches = sorted({b for points in curves.values() for b, _ in points})
    if len(batches) < 2:
        return False
    fig, ax = _figure()
    for label, points in curves.items():
        ax.plot([b for b, _ in points], [v for _, v in points], "o-", label=label)
    if batches[-1] >= 4 * batches[0]:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"bench.py {res.get('workload', '')}: throughput vs batch size\n{_subtitle(res)}")
    fig.savefig(path, dpi=120)
    return True


def plot_itl(res: dict, path: str) -> bool:
    """Write the ITL-during-prefill PNG; False (nothing written) without a long-context run."""
    tl = res.get("long_context_timeline")
    if not tl:
        return False
    row = next((r for r in res.get("rows", []) if r.get("workload") == "long_context"), {})
    fig, ax = _figure()
    prefill = (tl["long_arrival_s"], tl["long_first_token_s"])
    ax.axvspan(*prefill, color="tab:orange", alpha=0.15, label="long prompt prefilling")
    ax.axvline(tl["long_finished_s"], color="tab:orange", linestyle="--", label="long prompt done")
    t, itl = itl_series(tl["control_step_end_s"], tl["control_streams_with_tokens"])
    steps = dict(drawstyle="steps-pre")  # a token's ITL spans the gap that ends at it
    ax.plot(t, itl, color="0.6", linewidth=1, label="control: no long prompt", **steps)
    t, itl = itl_series(tl["step_end_s"], tl["streams_with_tokens"])
    ax.plot(t, itl, color="tab:blue", linewidth=1.2, marker=".", label="streams' ITL", **steps)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    what = (
        f"{row['streams']} streams, a {row['long_prompt']:,}-token prompt, budget {row['budget']}"
        if row
        else ""
    )
    ax.set_title(f"Inter-token latency while a long prompt prefills\n{what}  {_subtitle(res)}")
    fig.savefig(path, dpi=120)
    return True


def plot_result(res: dict, plot_dir: str) -> list[str]:
    """Every plot the result supports, written under plot_dir; the paths written."""
    require_matplotlib()
    os.makedirs(plot_dir, exist_ok=True)
    written = []
    for fn, name in ((plot_throughput, THROUGHPUT_PNG), (plot_itl, ITL_PNG)):
        path = os.path.join(plot_dir, name)
        if fn(res, path):
            written.append(path)
    return written
