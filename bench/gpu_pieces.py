"""Piecewise CUDA graphs on a GPU (bench/gpu_check.py's "pieces" section): the steps the
decode buckets do not take, in pieces between attention calls (worker/piecewise_graphs.py),
against the same steps op by op (TOKENMILL_GPU_PIECEWISE_GRAPHS=0; decode graphs on in
both), in one run, on the 0.5B bench model:

- `arrivals`: 16 prompts of 64-1024 tokens, 32 tokens each, a 512-token budget and 16
  sequences at most: prompt chunks ride beside decodes, most steps mixed (output tokens/s
  and the whole run's seconds);
- `prompt_512`: one 512-token prompt's prefill (one step; seconds);

and whether the greedy tokens agree; the memory the graphs hold with and without the pieces.
Run alone:

    python bench/gpu_pieces.py --model DIR --out FILE.json
"""

from __future__ import annotations

import functools
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from gpu_probes import environment, generate, standalone, timed  # noqa: E402

OFF = {"TOKENMILL_GPU_PIECEWISE_GRAPHS": "0"}


def pieces(path: str, device: str = "cuda", dtype: str = "bfloat16") -> dict:
    """`path`: the bench model's folder."""
    import transformers

    from tokenmill import LLM, SamplingParams

    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(64, 1025, (16,), generator=g).tolist()
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]
    prompt = torch.randint(2, vocab, (512,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    one = params.clone(max_tokens=1)
    res = {"prompt_tokens": sum(lengths), "output_tokens": 32 * len(prompts)}
    tokens = {}
    for name, env in (("pieces", {}), ("op_by_op", OFF)):
        with environment(env):
            llm = LLM(path, device=device, dtype=dtype, gpu_memory_utilization=0.4, seed=0,
                      enable_prefix_caching=False, max_num_batched_tokens=512,
                      max_num_seqs=16)
        runner = llm.engine.core.runner
        run = functools.partial(generate, llm, prompts, params)
        tokens[name] = [o.outputs[0].token_ids for o in run()]  # (and warms up)
        seconds = timed(run)
        generate(llm, [prompt], one)
        res[name] = {"piece_sizes": runner.pieces.sizes if runner.pieces else None,
                     "graph_gib": runner.graph_bytes / 2**30,  # (the pieces' pool too)
                     "arrivals_s": seconds,
                     "arrivals_out_tok_s": res["output_tokens"] / seconds,
                     "prompt_512_s": timed(functools.partial(generate, llm, [prompt], one),
                                           3)}
        del llm, runner, run
        gc.collect()
        torch.cuda.empty_cache()
    res["same_greedy_tokens"] = tokens["pieces"] == tokens["op_by_op"]
    for key in ("arrivals_s", "prompt_512_s"):
        res[key.replace("_s", "_speedup")] = res["op_by_op"][key] / res["pieces"][key]
    return res


if __name__ == "__main__":
    standalone(pieces)
