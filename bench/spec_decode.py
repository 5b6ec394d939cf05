"""Speculative decoding benchmark: decode tok/s with and without speculation (n-gram prompt
lookup, the target's own int4 / int8 copy as draft, or a draft model), same model, same
prompts, one run.

Prompt sets: `edit` (code the model is asked to repeat with a small change: its output
copies its context, where lookup pays, as far as the model copies), `repeat` (tables, CSV,
JSON lines and log lines the model continues: repetitive formats) and `chat` (ordinary
questions: it mostly doesn't).
Each request runs greedy to exactly --max-tokens new tokens (EOS ignored) at batch sizes
--batch (a sweep shows where speculation stops paying). Outputs with and without speculation
are checked equal (greedy: they must be). Writes JSON (default
bench/results/spec_decode-<date>.json).

  python bench/spec_decode.py [--model M] [--methods ngram,int4-self] [--k 3]
      [--prompts edit,chat] [--batch 1,4,16] [--max-tokens 128]"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

CODE = '''def moving_average(values, window):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''

EDIT = [f"Here is a Python function:\n\n{CODE}\nHere is the same function with the argument "
        f"`{name}` renamed to `{new}`, and nothing else changed:\n\n"
        for name, new in (("values", "xs"), ("window", "size"), ("values", "data"),
                          ("window", "width"))]
# repetitive formats the model continues (tables, CSV, JSON lines, logs): lookup's best case
REPEAT = ["| id | name | status |\n|---|---|---|\n" + "".join(
              f"| {i} | item{i} | ok |\n" for i in range(1, 6)),
          "id,name,price\n" + "".join(f"{i},product{i},{i}.99\n" for i in range(1, 6)),
          "".join(f'{{"id": {i}, "user": "user{i}", "active": true}}\n' for i in range(1, 5)),
          "".join(f"2024-05-0{i} 12:00:0{i} INFO worker-{i} finished job {i} in 12 ms\n"
                  for i in range(1, 6))]
CHAT = ["What is the capital of France? Answer in a few sentences.",
        "Explain what a hash table is to a beginner.",
        "Write a short poem about the sea.",
        "Give three tips for learning a new language."]


def run(llm, prompts, params, batch):
    todo = [prompts[i % len(prompts)] for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(todo, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    run.prompt_ids = [list(o.prompt_token_ids) for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs], elapsed


def lookup_bound(prompts: list[list[int]], outputs: list[list[int]], spec: dict) -> float:
    """Output tokens per step if n-gram speculation cost nothing beyond a plain decode
    step: replay each known (greedy) output, drafting from prompt + output so far and
    accepting the drafts' prefix that matches. Batch-1 speedup cannot exceed it."""
    from tokenmill.spec_decode.ngram import propose

    k, lo, hi = (spec[key] for key in ("num_speculative_tokens", "prompt_lookup_min",
                                       "prompt_lookup_max"))
    tokens = steps = 0
    for prompt, out in zip(prompts, outputs):
        pos = 0
        while pos < len(out):
            drafts = propose(prompt + out[:pos], k, lo, hi)
            hit = next((i for i, d in enumerate(drafts) if pos + i >= len(out)
                        or d != out[pos + i]), len(drafts))
            pos += hit + 1
            steps += 1
        tokens += len(out)
    return tokens / steps


def default_f32(root: str = os.path.expanduser("~/.cache/tokenmill-bench")) -> str:
    """The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) dequantized by
    transformers into an f32 Hugging Face folder (written once): the f32 target whose own
    int4 copy drafts for it. Its weights sit on Q4_1's grid, so an int4 copy stays closer
    to it than to a model trained in 16 bits (acceptance is higher than such a model's)."""
    out = os.path.join(root, "smollm2-135m-f32")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.loading.gguf import default_model_path

    folder, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    os.makedirs(out, exist_ok=True)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tokenizer.save_pretrained(out)
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def configs(args) -> dict[str, dict]:
    """--methods names -> speculative configs: ngram (prompt lookup), int4-self / int8-self
    (the target loaded quantized as its own draft), draft (--draft-model)."""
    low, high = (int(x) for x in args.ngram.split(","))
    known = {"ngram": {"method": "ngram", "prompt_lookup_min": low,
                       "prompt_lookup_max": high},
             "int4-self": {"method": "draft_model", "quantization": "int4"},
             "int8-self": {"method": "draft_model", "quantization": "int8"},
             "draft": {"method": "draft_model", "model": args.draft_model}}
    out = {}
    for name in args.methods.split(","):
        if name not in known:
            raise SystemExit(f"unknown method {name!r}; known: {', '.join(known)}")
        if name == "draft" and not args.draft_model:
            raise SystemExit("--methods draft needs --draft-model")
        out[name] = {**known[name], "num_speculative_tokens": args.k}
        if args.never_off:  # (measures where speculation stops paying)
            out[name]["disable_by_batch_size"] = 10**9
    return out


def main() -> None:
    from tokenmill import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled default model; "
                   "default-f32: it dequantized to f32 (written once by transformers)")
    p.add_argument("--methods", default="ngram", help="comma-separated: ngram, int4-self, "
                   "int8-self, draft")
    p.add_argument("--draft-model", default=None, help="the draft of --methods draft")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--ngram", default="3,5", help="prompt_lookup_min,max")
    p.add_argument("--prompts", default="edit,repeat,chat")
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--never-off", action="store_true", help="speculate at every batch size "
                   "(default: each method's disable_by_batch_size)")
    p.add_argument("--kv-gib", type=float, default=1.0, help="each engine's KV cache (a "
                   "draft model's holds as many tokens)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    specs = configs(args)
    if args.model == "default-f32":
        args.model = default_f32()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    common = {"enable_prefix_caching": False, "seed": 0, "kv_cache_memory_gib": args.kv_gib}
    engines = {"off": LLM(args.model, **common)}
    for name, spec in specs.items():
        engines[name] = LLM(args.model, speculative_config=spec, **common)
    for llm in engines.values():  # warm-up
        llm.generate(["Hello"], params.clone(max_tokens=8), use_tqdm=False)
    sets = {"edit": EDIT, "repeat": REPEAT, "chat": CHAT}
    for name in args.prompts.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            row = {"prompts": name, "batch": batch}
            tokens = {}
            for label, llm in engines.items():
                sched = llm.engine.core.scheduler
                before = (sched.num_draft_tokens, sched.num_accepted_tokens,
                          sched.num_spec_steps)
                tokens[label], elapsed = run(llm, sets[name], params, batch)
                row[f"{label}_tok_s"] = round(batch * args.max_tokens / elapsed, 2)
                if label == "off":
                    continue
                drafts = sched.num_draft_tokens - before[0]
                accepted = sched.num_accepted_tokens - before[1]
                steps = sched.num_spec_steps - before[2]
                row[f"{label}_acceptance_rate"] = round(accepted / drafts, 3) if drafts else None
                row[f"{label}_mean_accepted_length"] = round(1 + accepted / steps, 2) \
                    if steps else None
                row[f"{label}_speedup"] = round(row[f"{label}_tok_s"] / row["off_tok_s"], 2)
            if "ngram" in specs:
                row["ngram_bound"] = round(lookup_bound(run.prompt_ids, tokens["off"],
                                                        specs["ngram"]), 2)
            row["identical"] = all(t == tokens["off"] for t in tokens.values())
            print(json.dumps(row), flush=True)
            results.append(row)
    for llm in engines.values():
        llm.shutdown()
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"spec_decode-{date}.json")
    with open(out, "w") as f:
        json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "machine": {"cpu": platform.processor() or platform.machine(),
                               "cores": os.cpu_count()},
                   "command": "bench/spec_decode.py " + " ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                       if v is not None and k != "out"),
                   "speculative_configs": specs, "results": results}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
