"""tokenmill against the engines users would run instead, back to back on this machine.

  python bench/compare.py [--models default,qwen0.5b] [--engines tokenmill,vllm,llamacpp,
                           transformers] [--workloads w1,w2] [--repeats 2]
  (also `tokenmill bench compare ...`)

Peers come from `bench/peers/install.sh` (venvs under $TOKENMILL_PEERS_DIR, default
~/.cache/tokenmill-peers) and models from `bench/peers/prepare_models.py`; engines missing
there are skipped and reported. Each (model, workload) runs every engine `--repeats` times,
alternating the order, each run in a fresh process (`bench/peers/runner.py`); the best run
counts. Also measured in the same run: copy bandwidth and fp32 matmul rate, giving the
batch-1 decode ceiling (weight bytes per token / bandwidth) and the throughput ceiling
(2 x params FLOPs per token / matmul rate). Writes JSON (and a PNG if matplotlib is
installed) to bench/results/."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("TOKENMILL_PEERS_DIR", os.path.expanduser("~/.cache/tokenmill-peers"))
PEER_VENVS = {"vllm": "vllm", "llamacpp": "llamacpp"}
HOW_CORES = {"tokenmill": "torch threads = cores", "transformers": "torch threads = cores",
             "vllm": "VLLM_CPU_OMP_THREADS_BIND=0-<n-1>, no reserved CPU",
             "llamacpp": "n_threads = n_threads_batch = cores"}


def engine_python(engine: str) -> str | None:
    if engine in PEER_VENVS:
        path = os.path.join(ROOT, PEER_VENVS[engine], "bin", "python")
        return path if os.path.exists(path) else None
    return sys.executable


def model_path(models_dir: str, model: str, engine: str) -> str:
    base = os.path.join(models_dir, model)
    return os.path.join(base, "f32.gguf") if engine == "llamacpp" else os.path.join(base, "hf")


def run_one(engine: str, workload: str, path: str, args) -> dict:
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    if engine == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING")
    env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [engine_python(engine), os.path.join(HERE, "peers", "runner.py"), "--engine", engine,
           "--workload", workload, "--model", path, "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len),
           "--output-len", str(args.output_len if workload == "w1" else args.w2_output_len)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            result["wall_s"] = round(time.perf_counter() - start, 1)
            return result
    tail = (proc.stderr or proc.stdout)[-1500:]
    return {"engine": engine, "workload": workload, "error": f"exit {proc.returncode}: {tail}"}


def roofline(params: int) -> dict:
    """Copy bandwidth (read + write bytes) and fp32 matmul rate measured now."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    a = torch.empty(256 * 1024 * 1024 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    bandwidth = 2 * a.numel() * 4 / best
    n = 2048
    x, y = torch.randn(n, n), torch.randn(n, n)
    x @ y
    gflops = 2 * n ** 3 / min(_timed(lambda: x @ y) for _ in range(5)) / 1e9
    return {"bandwidth_gbs": round(bandwidth / 1e9, 1), "matmul_gflops": round(gflops, 1),
            "decode_ceiling_tps": round(bandwidth / (params * 4), 2),
            "throughput_ceiling_tps": round(gflops * 1e9 / (2 * params), 1)}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def count_params(hf_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), "pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    shape = f.get_slice(key).get_shape()
                    n = 1
                    for d in shape:
                        n *= d
                    total += n
    return total


def score(result: dict) -> float | None:
    if "error" in result:
        return None
    return result["out_tps"] if result["workload"] == "w1" else result["decode_tps"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default,qwen0.5b")
    p.add_argument("--engines", default="tokenmill,vllm,llamacpp,transformers")
    p.add_argument("--workloads", default="w1,w2")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--w2-output-len", type=int, default=128)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per engine run")
    p.add_argument("--models-dir", default=os.path.join(ROOT, "models"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    engines = [e for e in args.engines.split(",") if e]
    skipped = [e for e in engines if engine_python(e) is None]
    engines = [e for e in engines if e not in skipped]
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(),
                          "python": platform.python_version()},
              "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
              "how_cores": {e: HOW_CORES[e] for e in engines}, "skipped": skipped,
              "models": {}}
    for model in [m for m in args.models.split(",") if m]:
        hf_dir = model_path(args.models_dir, model, "tokenmill")
        if not os.path.isdir(hf_dir):
            report["skipped"].append(f"model {model} (run bench/peers/prepare_models.py)")
            continue
        params = count_params(hf_dir)
        entry = {"params": params, "roofline": roofline(params), "runs": []}
        for workload in [w for w in args.workloads.split(",") if w]:
            for r in range(args.repeats):
                order = engines if r % 2 == 0 else list(reversed(engines))
                for engine in order:
                    result = run_one(engine, workload, model_path(args.models_dir, model,
                                                                  engine), args)
                    result["repeat"] = r
                    entry["runs"].append(result)
                    print(json.dumps({"model": model, **result})[:400], flush=True)
        entry["table"] = _table(entry["runs"], engines)
        report["models"][model] = entry
    _print(report)
    out = args.out or os.path.join(HERE, "results",
                                   f"compare-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    _plot(report, out.replace(".json", ".png"))
    print(f"wrote {out}")


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
        print(f"\n{model}: {entry['params'] / 1e6:.0f}M params; bandwidth "
              f"{roof['bandwidth_gbs']} GB/s, matmul {roof['matmul_gflops']} GFLOP/s -> "
              f"decode ceiling {roof['decode_ceiling_tps']} tok/s, throughput ceiling "
              f"{roof['throughput_ceiling_tps']} tok/s")
        for workload, cells in entry["table"].items():
            ratio = cells.get("_ratio_to_best_peer")
            for engine, cell in cells.items():
                if engine.startswith("_"):
                    continue
                if workload == "w1":
                    print(f"  {workload} {engine:13s} {cell['out_tps']:8.2f} out tok/s")
                else:
                    print(f"  {workload} {engine:13s} {cell['decode_tps']:8.2f} decode tok/s, "
                          f"TTFT {cell['ttft']:.3f} s")
            if ratio:
                print(f"  {workload} tokenmill / best peer ({ratio['peer']}): {ratio['ratio']}")


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
        ax.set_ylabel("out tok/s" if workload == "w1" else "decode tok/s")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
