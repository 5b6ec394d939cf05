"""Offline throughput: tokenmill vs HF transformers `generate` on the same model, same run.

N prompts of random token ids, greedy, ignore EOS, exactly `--output-len` new tokens each.
Prints a table and writes JSON (default: bench/results/offline_throughput-<date>.json)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time

import torch


def tokenmill_run(args, prompts) -> float:
    from tokenmill import LLM, SamplingParams

    # no prefix caching: the warm-up's prompts are measured again, and transformers has none
    llm = LLM(args.model, kv_cache_memory_gib=args.kv_cache_memory, seed=0,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                 params.clone(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    return elapsed


def load_hf(model_path: str):
    from transformers import AutoModelForCausalLM

    if model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
            dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def transformers_run(args, prompts) -> float:
    model = load_hf(args.model).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed

    def generate(batch, n):
        with torch.inference_mode():
            return model.generate(batch, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0, attention_mask=torch.ones_like(batch))

    generate(ids[:2], 4)  # warm-up
    start = time.perf_counter()
    out = generate(ids, args.output_len)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == args.input_len + args.output_len
    return elapsed


def cpu_model() -> str:
    """The CPU's name and widest vector ISA: VMs of one name differ (this project's 'AMD EPYC'
    has been a Zen 3 with AVX2 and a Zen 4 with AVX-512 VNNI), and every engine's kernels
    differ with them."""
    name, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(isa)})" if isa else name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    parser.add_argument("--no-transformers", action="store_true",
                        help="measure tokenmill only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", default=None, help="output JSON path")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from tokenmill.loading.gguf import default_model_path
        args.model = default_model_path()
    from tokenmill.loading.checkpoint import load_hf_config
    vocab = load_hf_config(args.model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]

    results = {}
    engines = [("tokenmill", tokenmill_run)]
    if not args.no_transformers:
        engines.append(("transformers", transformers_run))
    for name, run in engines:
        elapsed = run(args, prompts)
        out_tokens = args.num_prompts * args.output_len
        results[name] = {"seconds": round(elapsed, 3),
                         "output_tokens_per_s": round(out_tokens / elapsed, 2),
                         "total_tokens_per_s": round(
                             args.num_prompts * (args.input_len + args.output_len) / elapsed, 2)}
    print(f"{'engine':<14}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}{'ratio':>8}")
    ref = results.get("transformers", {}).get("output_tokens_per_s")
    for name, r in results.items():
        ratio = f"{r['output_tokens_per_s'] / ref:.2f}x" if ref else "-"
        print(f"{name:<14}{r['seconds']:>10.2f}{r['output_tokens_per_s']:>12.1f}"
              f"{r['total_tokens_per_s']:>13.1f}{ratio:>8}")
    record = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None
                                                        else sys.argv[1:])]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": cpu_model(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "results": results,
    }
    path = args.json or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"offline_throughput-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
