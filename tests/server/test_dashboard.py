"""The metrics port's /dashboard in a real headless browser (Debian's chromium): after a few
requests the page shows what /metrics says (counts, latency percentiles computed as
Prometheus' histogram_quantile, per-replica gauges), and every request the page makes goes
to the server itself (Chromium's network log; its own background requests aside)."""

import json
import re
import shutil
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine")


def _samples(text: str) -> list:
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _quantile(samples, name: str, q: float) -> float | None:
    """Prometheus' histogram_quantile over the buckets of every series of `name`."""
    by_le: dict[float, float] = {}
    for s in samples:
        if s.name == name + "_bucket":
            le = float(s.labels["le"])
            by_le[le] = by_le.get(le, 0.0) + s.value
    buckets = sorted(by_le.items())
    total = buckets[-1][1]
    rank, prev_le, prev_count = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _dom_and_requests(url: str, tmp_path, budget_ms: int = 5000) -> tuple[str, list[dict]]:
    net = tmp_path / "net.json"
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--log-net-log={net}",
         f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    log = json.loads(net.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return done.stdout, [e["params"] for e in log["events"]
                         if e["type"] == start and "params" in e]


def _cell(dom: str, cell_id: str) -> str:
    return re.search(rf'id="{cell_id}">([^<]*)<', dom).group(1)


def test_the_page_shows_what_metrics_says(served_llama, tmp_path):
    for _ in range(3):
        httpx.post(served_llama.api + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "The river runs", "max_tokens": 8})
    origin = served_llama.metrics
    dom, requests = _dom_and_requests(origin + "/dashboard", tmp_path)
    samples = _samples(httpx.get(origin + "/metrics").text)
    total = lambda name: sum(s.value for s in samples if s.name == name)  # noqa: E731
    assert int(_cell(dom, "requests")) == total("tokenmill:request_success_total")
    assert int(_cell(dom, "output_tokens")) == total("tokenmill:generation_tokens_total")
    assert int(_cell(dom, "prompt_tokens")) == total("tokenmill:prompt_tokens_total")
    for q in (50, 90, 99):
        want = _quantile(samples, "tokenmill:time_to_first_token_seconds", q / 100)
        assert float(_cell(dom, f"ttft_p{q}")) == pytest.approx(want, rel=1e-2)
    row = re.search(r'id="replica_0">(.*?)</tr>', dom).group(1)
    assert re.findall(r"<td>([^<]*)</td>", row)[:3] == ["0", "0", "0"]  # (idle now)
    assert _cell(dom, "model") == "tiny" and "updated" in _cell(dom, "status")
    page = [r for r in requests if r.get("network_isolation_key", "").startswith(
        "http://127.0.0.1 ")]
    urls = {r["url"] for r in page}
    assert {origin + "/dashboard", origin + "/metrics",
            origin + "/dashboard/uPlot.iife.min.js"} <= urls
    assert all(u.startswith(origin + "/") for u in urls), urls


@pytest.mark.parametrize("asked,every", [("1", "0.5"), ("600000", "60"), ("soon", "2")])
def test_the_polling_period_asked_in_the_link_is_held_in_bounds(served_llama, tmp_path,
                                                                 asked, every):
    origin = served_llama.metrics
    dom, requests = _dom_and_requests(f"{origin}/dashboard?interval={asked}", tmp_path)
    assert f"(every {every} s)" in _cell(dom, "status")
    polls = [r for r in requests if r.get("url") == origin + "/metrics"]
    # 5 s of the page's (virtual) time: at most one poll per 0.5 s, the first at load and
    # the early second one (rates need two)
    assert 1 <= len(polls) <= 5 / 0.5 + 2, len(polls)


def test_rates_and_a_real_time_axis_from_the_first_second(served_llama, tmp_path):
    """Within its first second the page shows token rates (not "-") and charts whose time
    axis is the real window ending now (300 polls of 2 s), not years around one point."""
    started = time.time()
    dom, _ = _dom_and_requests(served_llama.metrics + "/dashboard", tmp_path, budget_ms=1500)
    assert _cell(dom, "output_tps") != "-" and _cell(dom, "prompt_tps") != "-"
    for chart in ("chart_tps", "chart_latency", "chart_requests", "chart_kv"):
        x_min, x_max = (float(v) for v in re.search(
            rf'id="{chart}"[^>]*data-x-min="([^"]+)" data-x-max="([^"]+)"', dom).groups())
        assert x_max - x_min == pytest.approx(600)
        assert started - 60 <= x_max <= time.time() + 60  # (the page's clock is virtual)


def test_the_page_allows_only_its_own_origin(served_llama):
    page = httpx.get(served_llama.metrics + "/dashboard")
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy
    for name in ("dashboard.js", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"):
        assert httpx.get(served_llama.metrics + "/dashboard/" + name).status_code == 200
    assert "http" not in re.sub(r"<!--.*?-->", "", page.text, flags=re.S)
    assert "tokenmill:num_requests_running" in httpx.get(served_llama.metrics + "/metrics").text
