"""llama.cpp (llama-cpp-python) greedy decoding with and without its prompt-lookup decoding
(`LlamaPromptLookupDecoding`), run with the Python of the llama.cpp peer venv by
`bench/spec_decode_llamacpp.py`. Reads a JSON job on stdin: {"model", "prompts": {set: [text]},
"max_tokens", "num_pred_tokens", "max_ngram_size"}; prints one JSON line per (set, mode):
tok/s over the set's prompts one after another (batch 1), EOS banned so every request makes
exactly max_tokens tokens, and the token ids (to compare with tokenmill's)."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    job = json.load(sys.stdin)
    cores = os.cpu_count() or 1
    for mode in ("off", "lookup"):
        draft = None if mode == "off" else LlamaPromptLookupDecoding(
            num_pred_tokens=job["num_pred_tokens"], max_ngram_size=job["max_ngram_size"])
        llm = Llama(job["model"], n_ctx=2048, n_threads=cores, n_threads_batch=cores,
                    seed=0, verbose=False, draft_model=draft, logits_all=draft is not None)
        ban = {llm.token_eos(): float("-inf")}
        llm.create_completion("Hello", max_tokens=4, temperature=0.0)  # warm-up
        for name, prompts in job["prompts"].items():
            tokens, elapsed = [], 0.0
            for prompt in prompts:
                start = time.perf_counter()
                out = llm.create_completion(prompt, max_tokens=job["max_tokens"],
                                            temperature=0.0, logit_bias=ban)
                elapsed += time.perf_counter() - start
                tokens.append(out["usage"]["completion_tokens"])
            print(json.dumps({"prompts": name, "mode": mode,
                              "tok_s": round(sum(tokens) / elapsed, 2),
                              "completion_tokens": tokens}), flush=True)
        del llm


if __name__ == "__main__":
    main()
