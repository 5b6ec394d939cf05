"""n-gram speculation side by side with llama.cpp's prompt-lookup decoding (llama-cpp-python's
`LlamaPromptLookupDecoding`) on the bundled default model's GGUF (SmolLM2-135M-Instruct,
Q4_1), the prompt sets of bench/spec_decode.py, batch 1 (prompts one after another), greedy,
exactly --max-tokens new tokens (EOS ignored / banned), each engine with and without lookup,
in one run. llama.cpp runs in its peer venv (bench/peers/install.sh llamacpp).

  python bench/spec_decode_llamacpp.py [--k 5] [--ngram 3] [--max-tokens 96]"""

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
PEER_PYTHON = os.path.expanduser("~/.cache/tokenmill-peers/llamacpp/bin/python")


def main() -> None:
    sys.path.insert(0, HERE)
    from spec_decode import CHAT, EDIT, REPEAT

    from tokenmill import LLM, SamplingParams
    from tokenmill.loading.gguf import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=5, help="draft tokens per step (both engines)")
    p.add_argument("--ngram", type=int, default=3, help="longest suffix looked up (lookup "
                   "from that many tokens down to one, in both)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = default_model_path()
    sets = {"edit": EDIT, "repeat": REPEAT, "chat": CHAT}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
            "prompt_lookup_max": args.ngram}
    rows = []
    for mode, config in (("off", None), ("lookup", spec)):
        llm = LLM(model, enable_prefix_caching=False, seed=0, kv_cache_memory_gib=0.5,
                  speculative_config=config)
        llm.generate(["Hello"], params.clone(max_tokens=4), use_tqdm=False)
        for name, prompts in sets.items():
            elapsed = 0.0
            for prompt in prompts:
                start = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                elapsed += time.perf_counter() - start
            rows.append({"engine": "tokenmill", "prompts": name, "mode": mode,
                         "tok_s": round(len(prompts) * args.max_tokens / elapsed, 2)})
            print(json.dumps(rows[-1]), flush=True)
        llm.shutdown()
    job = {"model": model, "prompts": sets, "max_tokens": args.max_tokens,
           "num_pred_tokens": args.k, "max_ngram_size": args.ngram}
    done = subprocess.run([PEER_PYTHON, os.path.join(HERE, "peers", "llamacpp_lookup.py")],
                          input=json.dumps(job), capture_output=True, text=True, check=True)
    for line in done.stdout.splitlines():
        row = json.loads(line)
        assert all(n == args.max_tokens for n in row.pop("completion_tokens")), row
        rows.append({"engine": "llama.cpp", **row})
        print(json.dumps(rows[-1]), flush=True)
    speed = {(r["engine"], r["prompts"], r["mode"]): r["tok_s"] for r in rows}
    summary = [{"prompts": name, **{
        f"{engine}_{key}": value for engine in ("tokenmill", "llama.cpp")
        for key, value in (("off_tok_s", speed[engine, name, "off"]),
                           ("lookup_tok_s", speed[engine, name, "lookup"]),
                           ("speedup", round(speed[engine, name, "lookup"]
                                             / speed[engine, name, "off"], 2)))}}
               for name in sets]
    for row in summary:
        print(json.dumps(row))
    out = args.out or os.path.join(HERE, "results", f"spec_decode_llamacpp-"
                                   f"{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "machine": {"cpu": platform.processor() or platform.machine(),
                               "cores": os.cpu_count()},
                   "command": "bench/spec_decode_llamacpp.py " + " ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                       if v is not None and k != "out"),
                   "model": os.path.basename(model), "rows": rows, "summary": summary},
                  f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
