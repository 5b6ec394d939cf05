"""Structured outputs: what one constrained request costs the batch it runs in, and how long
grammars take to compile.

Throughput: 16 requests (random-token prompts, greedy, exactly --max-tokens new tokens each)
all unconstrained, then the same with one of them constrained to a JSON schema (an array of
integers, so it runs to max_tokens like the others), alternated --repeats times in one run
on one engine; output tok/s of each and their ratio (issue 28's target: >= 0.9).
Compile: each schema of tests/sample/test_structured_outputs.py's corpus through a fresh compiler
(xgrammar's cache off), wall time per schema.

  python bench/structured_outputs.py [--model M] [--max-tokens 64] [--repeats 3] [--out F]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

# 100+ digits in an array: more tokens than --max-tokens, so it runs as long as the others
LONG = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 100}


def throughput(args) -> dict:
    import torch

    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, enable_prefix_caching=False, seed=0)
    vocab = llm.engine.core.hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, vocab - 100, (64,), generator=g).tolist()}
               for _ in range(16)]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = plain.clone(structured_outputs={"json": LONG})
    llm.generate(prompts[:2], [plain, constrained], use_tqdm=False)  # warm-up, compile
    runs = {"plain": [], "one_constrained": []}
    for _ in range(args.repeats):
        for name, params in (("plain", [plain] * 16),
                             ("one_constrained", [constrained] + [plain] * 15)):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            runs[name].append(tokens / elapsed)
            if name == "one_constrained":  # (the constraint held)
                text = outs[0].outputs[0].text
                assert re.fullmatch(r"\[[0-9, ]*", text), text
                assert len(outs[0].outputs[0].token_ids) == args.max_tokens
    best = {name: max(v) for name, v in runs.items()}
    llm.shutdown()
    return {"tok_s": runs, "best_tok_s": best,
            "ratio": round(best["one_constrained"] / best["plain"], 3)}


def compile_times(args) -> dict:
    import xgrammar as xgr
    from sample.test_structured_outputs import SCHEMAS

    from tokenmill.loading.checkpoint import load_hf_config, load_tokenizer
    from tokenmill.structured_output.backend import json_schema_ebnf

    tokenizer = load_tokenizer(args.model)
    vocab = load_hf_config(args.model).vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    out = []
    for schema in [*SCHEMAS, LONG]:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        start = time.perf_counter()
        compiler.compile_grammar(json_schema_ebnf(json.dumps(schema)))
        out.append(round((time.perf_counter() - start) * 1000, 2))
    return {"ms_per_schema": out, "vocab_size": vocab}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled default model")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.model is None:
        from tokenmill.loading.gguf import default_model_path
        args.model = default_model_path()
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count()},
              "command": "bench/structured_outputs.py " + " ".join(sys.argv[1:]),
              "throughput": throughput(args), "compile": compile_times(args)}
    print(json.dumps(result, indent=1))
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"structured_outputs-{datetime.date.today()}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
