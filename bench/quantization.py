"""Quantization methods side by side on one model, in one run (`tokenmill bench quant`):

- accuracy: perplexity over a fixed local text of >= 20k tokens (the docstrings of a fixed list
  of Python standard-library modules: deterministic, no download), scored in windows with
  chunked prefill so that later chunks read K/V back from the cache (int8 KV is exercised);
  and greedy continuations of a few text prompts compared token by token with fp32;
- speed: W2 batch-1 decode (128 -> 128 tokens) and W1 throughput (32 prompts x 128 -> 64),
  through bench/peers/runner.py, every variant repeated and alternated;
- memory: weight bytes as loaded and KV bytes per block (so blocks per budget).

Variants: fp32 (a GGUF's blocks expanded to float32), gguf (a GGUF's Q8_0/Q4 blocks served as
they are), int8, int4 (group 32, LM head int8), a8w8 (dynamic), fp8 (dynamic), kv-int8 (fp32
weights, int8 KV cache), int8+kv-int8. Each measurement runs in its own process.

  python bench/quantization.py [--model PATH] [--variants fp32,int8,...] [--repeats 2]"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VARIANTS = {
    "fp32": {}, "gguf": {}, "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"}, "a8w8": {"quantization": "a8w8"},
    "fp8": {"quantization": "fp8"}, "kv-int8": {"kv_cache_dtype": "int8"},
    "int8+kv-int8": {"quantization": "int8", "kv_cache_dtype": "int8"},
}
# Standard-library modules whose documentation is the evaluation text, in this order.
TEXT_MODULES = ["argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email",
                "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging",
                "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
                "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
                "typing", "unittest", "urllib.parse", "uuid", "zipfile"]
PROMPTS = ["The history of the printing press", "In mathematics, a prime number is",
           "To make a good cup of tea, you", "The capital of France is",
           "Once upon a time, in a small village,", "def quicksort(items):",
           "Photosynthesis is the process by which", "The best way to learn a language is"]


def evaluation_text() -> str:
    """Module and member docstrings of TEXT_MODULES (public names, sorted): plain English
    prose about software, fixed for a given Python version."""
    parts = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for member_name, member in sorted(vars(module).items()):
            if member_name.startswith("_") or getattr(member, "__module__", None) != name:
                continue
            doc = inspect.getdoc(member)
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


def variant_env(variant: str) -> dict:
    env = dict(os.environ)
    if variant in ("fp32", "kv-int8"):  # no compiled kernels: a GGUF loads as float32
        env["TOKENMILL_CPU_KERNELS"] = "0"
    return env


# -- worker: accuracy of one variant, in its own process --------------------------------------
def accuracy_worker(args) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, kv_cache_memory_gib=1.0, max_num_batched_tokens=args.chunk,
              **VARIANTS[args.variant])
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(evaluation_text(), add_special_tokens=False)["input_ids"][:args.ppl_tokens]
    windows = [ids[i:i + args.window] for i in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) > 1]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll = [-next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]]
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=args.greedy_tokens, temperature=0,
                                                  ignore_eos=True), use_tqdm=False)
    return {"ppl": math.exp(sum(nll) / len(nll)), "scored_tokens": len(nll),
            "text_tokens": len(ids), "seconds": round(time.perf_counter() - start, 1),
            "greedy": [o.outputs[0].token_ids for o in greedy]}


def run_in_process(cmd: list[str], variant: str, args) -> dict:
    """One measurement in a fresh process: its `RESULT {json}` line, or the error."""
    proc = subprocess.run(cmd, env=variant_env(variant), capture_output=True, text=True,
                          timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}


def run_accuracy(variant: str, args) -> dict:
    return run_in_process([sys.executable, os.path.abspath(__file__), "--worker", variant,
                           "--model", args.model, "--ppl-tokens", str(args.ppl_tokens),
                           "--window", str(args.window), "--chunk", str(args.chunk),
                           "--greedy-tokens", str(args.greedy_tokens)], variant, args)


def run_speed(variant: str, workload: str, args) -> dict:
    return run_in_process([sys.executable, os.path.join(HERE, "peers", "runner.py"),
                           "--engine", "tokenmill", "--workload", workload, "--model",
                           args.model, "--num-prompts", "32", "--input-len", "128",
                           "--output-len", "64" if workload == "w1" else "128",
                           "--engine-args", json.dumps(VARIANTS[variant])], variant, args)


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Share of greedy tokens equal to fp32's, up to each prompt's first difference."""
    same = total = 0
    for ours, ref in zip(tokens, reference):
        total += len(ref)
        for a, b in zip(ours, ref):
            if a != b:
                break
            same += 1
    return same / total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M (Q4_1)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--ppl-tokens", type=int, default=20480)
    p.add_argument("--window", type=int, default=1024, help="tokens per scored window")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens per step)")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.model is None:
        from tokenmill.loading.gguf import default_model_path
        args.model = default_model_path()
    if args.worker:
        args.variant = args.worker
        print("RESULT " + json.dumps(accuracy_worker(args)), flush=True)
        return
    from offline_throughput import cpu_model

    variants = [v for v in args.variants.split(",") if v]
    if not args.model.endswith(".gguf") and "gguf" in variants:
        variants.remove("gguf")
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "python": platform.python_version()},
              "command": " ".join(["bench/quantization.py"] + (argv or sys.argv[1:])),
              "model": args.model, "variants": {v: {} for v in variants}}
    if not args.skip_accuracy:
        for variant in variants:
            result = run_accuracy(variant, args)
            report["variants"][variant]["accuracy"] = result
            print(json.dumps({"variant": variant, **{k: v for k, v in result.items()
                                                      if k != "greedy"}}), flush=True)
    if not args.skip_speed:
        for workload in ("w2", "w1"):
            for r in range(args.repeats):
                for variant in variants if r % 2 == 0 else list(reversed(variants)):
                    result = run_speed(variant, workload, args)
                    report["variants"][variant].setdefault(workload, []).append(result)
                    print(json.dumps({"variant": variant, **result}), flush=True)
    report["table"] = summarize(report)
    print_table(report["table"])
    out = args.out or os.path.join(HERE, "results",
                                   f"quantization-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {out}")


def summarize(report: dict) -> dict:
    variants = report["variants"]
    base = variants.get("fp32", {})
    base_ppl = base.get("accuracy", {}).get("ppl")
    base_greedy = base.get("accuracy", {}).get("greedy")

    def best(runs, key, low=False):
        values = [r[key] for r in runs or [] if key in r]
        return (min(values) if low else max(values)) if values else None

    table = {}
    for name, v in variants.items():
        acc = v.get("accuracy", {})
        row = {"ppl": acc.get("ppl"), "decode_tps": best(v.get("w2"), "decode_tps"),
               "ttft_s": best(v.get("w2"), "ttft", low=True),
               "w1_out_tps": best(v.get("w1"), "out_tps")}
        runs = (v.get("w2") or []) + (v.get("w1") or [])
        mem = next((r for r in runs if "weight_bytes" in r), {})
        row["weight_mib"] = mem.get("weight_bytes", 0) / 2**20 or None
        row["kv_block_bytes"] = mem.get("kv_block_bytes")
        if base_ppl and row["ppl"]:
            row["ppl_change_pct"] = 100 * (row["ppl"] / base_ppl - 1)
        if base_greedy and acc.get("greedy"):
            row["greedy_agreement"] = agreement(acc["greedy"], base_greedy)
        for key in ("decode_tps", "w1_out_tps"):
            ref = table.get("fp32", {}).get(key) if name != "fp32" else row[key]
            if ref and row[key]:
                row[key.replace("_tps", "_x_fp32")] = row[key] / ref
        table[name] = row
    return table


def print_table(table: dict) -> None:
    cols = ["ppl", "ppl_change_pct", "greedy_agreement", "decode_tps", "decode_x_fp32",
            "ttft_s", "w1_out_tps", "w1_out_x_fp32", "weight_mib", "kv_block_bytes"]
    print("| variant | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in table.items():
        cells = [("-" if row.get(c) is None else f"{row[c]:.3g}" if isinstance(row[c], float)
                  else str(row[c])) for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
