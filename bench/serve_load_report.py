"""The report of `bench/serve_load.py`: per-request records in, one JSON-ready dict out, and
the optional PNG of latency percentiles over time.

A record is a dict with `sent` and `done` (seconds since the run started) and either `error`
(the failure kind) or `ttft`, `e2el`, `tpot` (seconds, `tpot` None for one-token outputs),
`itl` (list of seconds), `tokens` and `finish`. Latencies are reported in milliseconds (and in
seconds under their bare names, for `bench/compare.py`)."""

from __future__ import annotations

import math
import statistics


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default, as vLLM reports)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary_ms(seconds: list[float]) -> dict:
    values = [s * 1e3 for s in seconds]
    return {"mean": statistics.fmean(values) if values else None,
            "p50": percentile(values, 50), "p99": percentile(values, 99)}


def _count(keys) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def timeline(records: list[dict], elapsed: float) -> dict:
    """Per-bucket (1 s, or 5 s for runs over a minute) view by completion time: completed and
    failed requests/s, and p50 / p99 of TTFT and E2EL (ms) of the requests done in it."""
    bucket = 1.0 if elapsed <= 60 else 5.0
    n = max(1, math.ceil(elapsed / bucket))
    done: list[list[dict]] = [[] for _ in range(n)]
    failed = [0] * n
    for r in records:
        i = min(n - 1, int(r["done"] / bucket))
        if "error" in r:
            failed[i] += 1
        else:
            done[i].append(r)
    out: dict = {"bucket_s": bucket, "t": [i * bucket for i in range(n)],
                 "completed_per_s": [len(d) / bucket for d in done],
                 "failed_per_s": [f / bucket for f in failed]}
    for metric in ("ttft", "e2el"):
        for q in (50, 99):
            out[f"{metric}_p{q}_ms"] = [
                None if not d else percentile([r[metric] * 1e3 for r in d], q) for d in done]
    return out


def build_report(records: list[dict], elapsed: float, mode: str,
                 memory: dict | None = None) -> dict:
    ok = [r for r in records if "error" not in r]
    out_tokens = sum(r["tokens"] for r in ok)
    report = {
        "mode": mode, "requests": len(records), "completed": len(ok),
        "failures": _count(r["error"] for r in records if "error" in r),
        "seconds": elapsed, "request_throughput": len(ok) / elapsed,
        "out_tps": out_tokens / elapsed, "mean_output_tokens": out_tokens / max(1, len(ok)),
        "finish_reasons": _count(str(r["finish"]) for r in ok),
        "ttft_ms": summary_ms([r["ttft"] for r in ok]),
        "tpot_ms": summary_ms([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_ms": summary_ms([gap for r in ok for gap in r["itl"]]),
        "e2el_ms": summary_ms([r["e2el"] for r in ok]),
        "timeline": timeline(records, elapsed),
    }
    # How long refusals (503 on overload, ...) took: they must be fast to be useful.
    report["failure_latency_ms"] = summary_ms([r["done"] - r["sent"] for r in records
                                               if "error" in r])
    if memory is not None:
        report["server_memory"] = memory
    return report


def plot(report: dict, path: str) -> None:
    """Top: p50 / p99 of TTFT and E2EL per time bucket. Bottom: completed (and failed)
    requests/s, with the server's RSS on a second axis when it was sampled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = report["timeline"]
    x = [t + tl["bucket_s"] / 2 for t in tl["t"]]  # bucket midpoints
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5))
    for key, style in (("ttft_p50_ms", "C0-"), ("ttft_p99_ms", "C0--"),
                       ("e2el_p50_ms", "C1-"), ("e2el_p99_ms", "C1--")):
        ys = [math.nan if v is None else v for v in tl[key]]
        top.plot(x, ys, style, marker=".", label=key[:-3].replace("_", " ").upper())
    top.set_ylabel("latency (ms)")
    top.legend(loc="upper left", fontsize="small")
    top.grid(alpha=0.3)
    top.set_title(f"{report['mode']}: {report['completed']} completed, "
                  f"{sum(report['failures'].values())} failed, "
                  f"{report['request_throughput']:.2f} req/s, {report['out_tps']:.1f} tok/s")
    width = tl["bucket_s"] * 0.8
    bottom.bar(x, tl["completed_per_s"], width=width, color="C2", label="completed/s")
    bottom.bar(x, tl["failed_per_s"], width=width, bottom=tl["completed_per_s"], color="C3",
               label="failed/s")
    bottom.set_xlabel(f"seconds since start ({tl['bucket_s']:g} s buckets, by completion)")
    bottom.set_ylabel("requests/s")
    bottom.grid(alpha=0.3)
    handles, labels = bottom.get_legend_handles_labels()
    memory = report.get("server_memory")
    if memory and memory["samples"]:
        rss = bottom.twinx()
        line = rss.plot([t for t, _ in memory["samples"]], [mb for _, mb in memory["samples"]],
                        "k-", label=f"server RSS (pid {memory['pid']})")
        rss.set_ylabel("RSS (MB)")
        handles += line
        labels.append(line[0].get_label())
    bottom.legend(handles, labels, loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
