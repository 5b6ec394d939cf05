// tokenmill's dashboard: polls /metrics (Prometheus text), shows rates, latency percentiles
// (from the histograms' buckets, as Prometheus' histogram_quantile), and per-replica gauges.
"use strict";

// ?interval=MS: the polling period, held to 0.5-60 s (a shared link must not make a page poll
// the server a thousand times a second); absent or not a number: 2 s.
const ASKED_MS = Number(new URLSearchParams(location.search).get("interval"));
const INTERVAL_MS = Number.isFinite(ASKED_MS) && ASKED_MS > 0
  ? Math.min(60000, Math.max(500, ASKED_MS)) : 2000;
const WINDOW = 300;  // points kept per chart
const SPAN_S = WINDOW * INTERVAL_MS / 1000;  // the time axis: the window those points cover

// "name{a="x",b="y"} 1.5" lines -> [{name, labels, value}]
function parse(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const kv of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[kv[1]] = kv[2];
    out.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return out;
}

const sum = (samples, name) =>
  samples.filter((s) => s.name === name).reduce((a, s) => a + s.value, 0);

// Prometheus' histogram_quantile over the buckets of every series of `name`, summed by le.
function quantile(samples, name, q) {
  const byLe = new Map();
  for (const s of samples) {
    if (s.name !== name + "_bucket") continue;
    const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
    byLe.set(le, (byLe.get(le) || 0) + s.value);
  }
  const buckets = [...byLe.entries()].sort((a, b) => a[0] - b[0]);
  if (!buckets.length) return null;
  const total = buckets[buckets.length - 1][1];
  if (total === 0) return null;
  const rank = q * total;
  let prevLe = 0, prevCount = 0;
  for (const [le, count] of buckets) {
    if (count >= rank) {
      if (le === Infinity) return prevLe;
      if (count === prevCount) return le;
      return prevLe + (le - prevLe) * (rank - prevCount) / (count - prevCount);
    }
    prevLe = le; prevCount = count;
  }
  return prevLe;
}

const fmt = (v, digits = 3) => (v === null || v === undefined || isNaN(v)) ? "-" :
  (Number.isInteger(v) || Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(digits));
const set = (id, v, digits) => { document.getElementById(id).textContent = fmt(v, digits); };

function makeChart(el, title, series) {
  const node = document.getElementById(el);
  const opts = { title, width: 460, height: 220,
    // the real window ending at the latest poll, from the first frame on (with one point,
    // uPlot's `max` is that point plus 86,400 "days" in seconds: the axis spanned years)
    scales: { x: { time: true, range: (u, min, max) => {
      const xs = u.data[0], last = xs.length ? xs[xs.length - 1] : max;
      return [last - SPAN_S, last];
    } } },
    // the axis shown, as data attributes (tests read them)
    hooks: { setScale: [(u, key) => {
      if (key === "x") Object.assign(node.dataset, { xMin: u.scales.x.min, xMax: u.scales.x.max });
    }] },
    series: [{}, ...series.map((label, i) => ({
      label, stroke: ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"][i % 4] }))] };
  return { plot: new uPlot(opts, [[], ...series.map(() => [])], node),
           data: [[], ...series.map(() => [])] };
}

function push(chart, t, values) {
  chart.data[0].push(t);
  values.forEach((v, i) => chart.data[i + 1].push(v));
  if (chart.data[0].length > WINDOW) chart.data.forEach((d) => d.shift());
  chart.plot.setData(chart.data);
}

const charts = {
  tps: makeChart("chart_tps", "tokens / s", ["output", "prompt"]),
  latency: makeChart("chart_latency", "latency p50 (s)", ["TTFT", "inter-token"]),
  requests: makeChart("chart_requests", "requests", ["running", "waiting"]),
  kv: makeChart("chart_kv", "KV-cache use", ["used fraction"]),
};
let last = null;

function replicas(samples) {
  const rows = new Map();
  const take = (name, key) => {
    for (const s of samples) {
      if (s.name !== name) continue;
      const r = s.labels.engine || "0";
      if (!rows.has(r)) rows.set(r, {});
      rows.get(r)[key] = s.value;
    }
  };
  take("tokenmill:num_requests_running", "running");
  take("tokenmill:num_requests_waiting", "waiting");
  take("tokenmill:kv_cache_usage_perc", "kv");
  take("tokenmill:prefix_cache_hit_rate", "hit");
  take("tokenmill:spec_decode_draft_acceptance_rate", "spec");
  const table = document.getElementById("replicas");
  while (table.rows.length > 1) table.deleteRow(1);
  for (const [r, v] of [...rows.entries()].sort()) {
    const row = table.insertRow();
    row.id = "replica_" + r;
    for (const cell of [r, fmt(v.running), fmt(v.waiting), fmt(v.kv), fmt(v.hit), fmt(v.spec)])
      row.insertCell().textContent = cell;
  }
  return rows;
}

async function poll() {
  try {
    const response = await fetch("metrics", { cache: "no-store" });
    const samples = parse(await response.text());
    const now = Date.now() / 1000;
    const model = samples.find((s) => s.labels.model_name);
    if (model) document.getElementById("model").textContent = model.labels.model_name;
    const counts = {
      output: sum(samples, "tokenmill:generation_tokens_total"),
      prompt: sum(samples, "tokenmill:prompt_tokens_total"),
    };
    set("requests", sum(samples, "tokenmill:request_success_total"));
    set("output_tokens", counts.output);
    set("prompt_tokens", counts.prompt);
    set("in_flight", sum(samples, "tokenmill:num_requests_in_flight"));
    for (const q of [50, 90, 99]) {
      set("ttft_p" + q, quantile(samples, "tokenmill:time_to_first_token_seconds", q / 100));
      set("itl_p" + q, quantile(samples, "tokenmill:inter_token_latency_seconds", q / 100));
    }
    const rows = replicas(samples);
    if (last) {
      const dt = now - last.t;
      const tps = [(counts.output - last.output) / dt, (counts.prompt - last.prompt) / dt];
      set("output_tps", tps[0]);
      set("prompt_tps", tps[1]);
      push(charts.tps, now, tps);
    }
    push(charts.latency, now, [quantile(samples, "tokenmill:time_to_first_token_seconds", 0.5),
                               quantile(samples, "tokenmill:inter_token_latency_seconds", 0.5)]);
    const all = [...rows.values()];
    push(charts.requests, now, [all.reduce((a, v) => a + (v.running || 0), 0),
                                all.reduce((a, v) => a + (v.waiting || 0), 0)]);
    push(charts.kv, now, [all.length ? Math.max(...all.map((v) => v.kv || 0)) : null]);
    last = { t: now, ...counts };
    document.getElementById("status").textContent =
      "updated " + new Date().toLocaleTimeString() + " (every " + INTERVAL_MS / 1000 + " s)";
  } catch (err) {
    document.getElementById("status").textContent = "cannot read /metrics: " + err;
  }
}

// Rates need two polls: the second comes half a second after the first, not a period later.
poll().then(() => setTimeout(poll, Math.min(500, INTERVAL_MS)));
setInterval(poll, INTERVAL_MS);
