"""Speculative decoding on a GPU (bench/gpu_check.py's "speculation" section): the batch-1
rate of the 0.5B bench model with an EAGLE-1 head of random weights drafting k = 3 tokens,
and with n-gram lookup (k = 3; on random text most lookups come short and are filled up to
k), beside the same model without speculation, in one run:

- `rejected`: the head's drafts are all rejected (the target's own tokens): speculation's
  worst case, a drafted step's whole cost for one token;
- `accepted`: every draft accepted by fiat (4 tokens a step; not the target's tokens): its
  best case;

each with CUDA graphs (the drafted steps of 4 rows a sequence and the head's passes replayed,
worker/cuda_graphs.py, worker/draft_head_graphs.py) and eagerly (`--enforce-eager`), so what
the graphs bring to a drafted step shows. Run alone:

    python bench/gpu_speculation.py --model DIR --out FILE.json
"""

from __future__ import annotations

import gc
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_probes import decode_rate, standalone  # noqa: E402

K = 3


def _accept_all(argmax: list[int], drafts: list[int]) -> list[int]:
    return drafts + [argmax[len(drafts)]]


def speculation(path: str, root: str, device: str = "cuda", dtype: str = "bfloat16") -> dict:
    """`path`: the bench model's folder; the head is written under `root`."""
    from spec_decode.test_spec_decode_eagle import make_eagle

    from tokenmill import LLM, SamplingParams
    from tokenmill.sample import rejection_sampler as rejection

    head = os.path.join(root, "eagle_head")
    if not os.path.isdir(head):
        make_eagle(path, head)
    prompts = [[2 + i * 7 % 500 for i in range(128)]]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    eagle = {"method": "eagle", "model": head, "num_speculative_tokens": K}
    # (a random model's text rarely repeats: lookups come short, filled up to k with graphs)
    ngram = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    res = {"k": K, "eagle_head": "random weights (its drafts: random tokens)"}
    verify = rejection.verify_greedy
    for name, eager, speculative in (("plain", False, None), ("plain_eager", True, None),
                                     ("eagle", False, eagle), ("eagle_eager", True, eagle),
                                     ("ngram", False, ngram), ("ngram_eager", True, ngram)):
        with LLM(path, device=device, dtype=dtype, gpu_memory_utilization=0.4, seed=0,
                 enable_prefix_caching=False, enforce_eager=eager,
                 speculative_config=speculative) as llm:
            if speculative is None:
                res[name] = {"batch1_tok_s": decode_rate(llm, prompts, one)}
            else:
                runner = llm.engine.core.runner
                res[name] = {
                    "graph_rows": sorted(runner.graphs.widths) if runner.graphs else None,
                    "head_graphs": runner.heads is not None and runner.heads.graphs is not None,
                    "rejected_tok_s": decode_rate(llm, prompts, one)}
                try:
                    rejection.verify_greedy = _accept_all
                    res[name]["accepted_tok_s"] = decode_rate(llm, prompts, one)
                finally:
                    rejection.verify_greedy = verify
                del runner
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    plain = res["plain"]["batch1_tok_s"]
    for name in ("eagle", "eagle_eager", "ngram", "ngram_eager"):
        for kind in ("rejected", "accepted"):
            res[name][f"{kind}_vs_plain"] = res[name][f"{kind}_tok_s"] / plain
    return res


if __name__ == "__main__":
    import tempfile

    standalone(lambda model: speculation(model, tempfile.mkdtemp()))
