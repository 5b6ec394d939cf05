"""One engine, one workload, one process: run by `bench/compare.py` with the Python of the
engine's own venv (so it imports only that engine). Prints one JSON line.

  python runner.py --engine tokenmill|transformers|vllm|llamacpp --workload w1|w2 --model M

W1: N prompts x input-len random token ids -> exactly output-len new tokens each (greedy,
    EOS ignored), one batch: output tokens/s over the whole run.
W2: one prompt of input-len -> output-len tokens: time to first token and decode tokens/s
    (tokens after the first / time after the first).
W4: a second chat turn on a long shared prefix: the first turn's prompt P (input-len) is
    answered (output-len tokens, A), then P + A + 128 new tokens is sent: the first turn's
    TTFT (nothing cached) against the second's (prefix caching on; llama.cpp keeps the
    sequence's KV, as its server's slot does).
Every engine gets both cores (torch/OpenMP threads = cores; llama.cpp n_threads = cores)."""

from __future__ import annotations

import argparse
import json
import os
import random
import time

CORES = os.cpu_count() or 1


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


WARMUP_MAX = 2048  # a longer prompt warms nothing more (every engine prefills in chunks)


def warmup_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """Prompts for the untimed warm-up: never the measured ones (seed 0), so that no engine's
    cache can start the timed run with a prompt already computed; at most WARMUP_MAX tokens
    (a 16k-token warm-up doubled a long-context run's time)."""
    return make_prompts(n, min(length, WARMUP_MAX), vocab, seed=1)


def timed_steps(engine, add_request, n_expected: int) -> dict:
    """W2 from an engine's own step loop (tokenmill's and vLLM's LLMEngine): the request
    added, the first token's time seen as it comes, then the decode rate after it."""
    start, first, n = time.perf_counter(), None, 0
    add_request()
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            if first is None and n:
                first = time.perf_counter()
    end = time.perf_counter()
    assert n == n_expected
    return {"ttft": first - start, "decode_tps": (n - 1) / (end - first)}


def measure_turns(generate, vocab: int, args) -> dict:
    """W4 for engines with a blocking `generate(prompt, n) -> tokens` and a prefix cache."""
    prompt = make_prompts(1, args.input_len, vocab)[0]
    question = make_prompts(1, 128, vocab, seed=2)[0]
    generate(warmup_prompts(1, 64, vocab)[0], 2)
    start = time.perf_counter()
    generate(prompt, 1)
    first = time.perf_counter() - start
    answer = generate(prompt, args.output_len)
    start = time.perf_counter()
    generate(prompt + answer + question, 1)
    return {"ttft": first, "turn2_ttft": time.perf_counter() - start}


def measure_blocking(generate, vocab: int, args) -> dict:
    """For engines with only a blocking `generate(prompts, n)`: W1 times one batch. W2 times a
    full call; TTFT is when the first token came if `generate` returns that
    (`time.perf_counter()` value), else the time of a 1-token call."""
    if args.workload == "w1":
        prompts = make_prompts(args.num_prompts, args.input_len, vocab)
        generate(warmup_prompts(2, args.input_len, vocab), 2)
        start = time.perf_counter()
        generate(prompts, args.output_len)
        return {"seconds": time.perf_counter() - start}
    prompt = make_prompts(1, args.input_len, vocab)
    generate(warmup_prompts(1, args.input_len, vocab), 2)
    start = time.perf_counter()
    first = generate(prompt, args.output_len)
    end = time.perf_counter()
    if isinstance(first, float):
        return {"ttft": first - start, "decode_tps": (args.output_len - 1) / (end - first)}
    one = time.perf_counter()
    generate(prompt, 1)
    ttft = time.perf_counter() - one
    return {"ttft": ttft, "decode_tps": (args.output_len - 1) / (end - start - ttft)}


# -- tokenmill ------------------------------------------------------------------------------
def tokenmill(args):
    from tokenmill import LLM, SamplingParams
    from tokenmill.quantization.model import weight_bytes

    # prefix caching off, as vLLM runs here: every prompt is computed in full (W4: on)
    engine_args = {"dtype": args.dtype, "kv_cache_memory_gib": 2.0, "seed": 0,
                   "enable_prefix_caching": args.workload == "w4", **json.loads(args.engine_args)}
    llm = LLM(args.model, **engine_args)
    vocab = llm.engine.core.hf_config.vocab_size
    runner = llm.engine.core.runner
    memory = {"weight_bytes": weight_bytes(runner.model), "kv_block_bytes": runner.block_bytes}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    if args.workload == "w4":
        def turn(prompt, n):
            (out,) = llm.generate({"prompt_token_ids": prompt}, params.clone(max_tokens=n),
                                  use_tqdm=False)
            return list(out.outputs[0].token_ids)
        return {**measure_turns(turn, vocab, args), **memory}
    if args.workload == "w1":
        prompts = make_prompts(args.num_prompts, args.input_len, vocab)
        llm.generate([{"prompt_token_ids": p} for p in warmup_prompts(2, args.input_len, vocab)],
                     params.clone(max_tokens=2), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        return {"seconds": elapsed, **memory}
    prompt = make_prompts(1, args.input_len, vocab)[0]
    engine = llm.engine
    engine.add_request(None, {"prompt_token_ids": warmup_prompts(1, args.input_len, vocab)[0]},
                       params.clone(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    return {**timed_steps(engine, lambda: engine.add_request(None, {"prompt_token_ids": prompt},
                                                             params), args.output_len),
            **memory}


# -- transformers ---------------------------------------------------------------------------
def transformers(args):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(CORES)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    vocab = model.config.vocab_size

    def generate(batch, n):
        ids = torch.tensor(batch)
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, attention_mask=torch.ones_like(ids))
        assert out.shape[1] == ids.shape[1] + n
        return out

    return measure_blocking(generate, vocab, args)


# -- vLLM (CPU) -----------------------------------------------------------------------------
def vllm(args):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    turn2 = args.input_len + 2 * args.output_len + 128 + 16 if args.workload == "w4" else 0
    llm = LLM(args.model, dtype=args.dtype,
              max_model_len=max(turn2, args.input_len + args.output_len + 16),
              seed=0, enable_prefix_caching=args.workload == "w4")
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True,
                              detokenize=False)

    def generate(prompts, n):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params(n),
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return [list(o.outputs[0].token_ids) for o in outs]

    if args.workload == "w4":
        return measure_turns(lambda prompt, n: generate([prompt], n)[0], vocab, args)
    if args.workload == "w1":
        return measure_blocking(generate, vocab, args)
    # W2 from the engine's steps, as tokenmill's: the first token's time seen as it comes (a
    # separate 1-token call timed the TTFT before, and at 16k tokens its prefill's noise,
    # seconds, outweighed the 32 tokens' decode)
    from vllm.sampling_params import RequestOutputKind

    generate(warmup_prompts(1, args.input_len, vocab), 2)
    engine = llm.llm_engine
    streamed = params(args.output_len)
    streamed.output_kind = RequestOutputKind.CUMULATIVE
    prompt = TokensPrompt(prompt_token_ids=make_prompts(1, args.input_len, vocab)[0])
    return timed_steps(engine, lambda: engine.add_request("w2", prompt, streamed),
                       args.output_len)


# -- llama.cpp (low-level batch API) --------------------------------------------------------
def llamacpp(args):

    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(args.model.encode(), mparams)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    n_seq = args.num_prompts if args.workload == "w1" else 1
    per_seq = args.input_len + args.output_len + 8 + (
        args.output_len + 129 if args.workload == "w4" else 0)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = per_seq * n_seq
    # a prompt goes in chunks of at most 2048 tokens (llama-server's batch; long prompts)
    chunk = min(max(args.input_len, n_seq, 129), 2048)
    cparams.n_batch = max(chunk, n_seq)
    cparams.n_ubatch = cparams.n_batch
    cparams.n_seq_max = n_seq
    cparams.n_threads = CORES
    cparams.n_threads_batch = CORES
    ctx = lc.llama_init_from_model(model, cparams)
    batch = lc.llama_batch_init(cparams.n_batch, 0, n_seq)

    def decode(entries):
        """entries: (token, pos, seq, want_logits); returns rows of logits wanted."""
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want
        assert lc.llama_decode(ctx, batch) == 0
        rows = [i for i, e in enumerate(entries) if e[3]]
        out = []
        for i in rows:
            ptr = lc.llama_get_logits_ith(ctx, i)
            out.append(int(np.argmax(np.ctypeslib.as_array(ptr, shape=(vocab,)))))
        return out

    def prefill(tokens, start, seq):
        """tokens at positions start.. of seq, in chunks; the last token's greedy next"""
        out = []
        for c in range(0, len(tokens), chunk):
            part = tokens[c:c + chunk]
            out = decode([(t, start + c + j, seq, c + j == len(tokens) - 1)
                          for j, t in enumerate(part)])
        return out

    if args.workload == "w4":  # seq 0's KV stays between the turns
        prompt = make_prompts(1, args.input_len, vocab)[0]
        question = make_prompts(1, 128, vocab, seed=2)[0]
        prefill(warmup_prompts(1, 64, vocab)[0], 0, 0)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        start = time.perf_counter()
        answer = prefill(prompt, 0, 0)
        first = time.perf_counter() - start
        pos = len(prompt)
        while len(answer) < args.output_len:
            answer += decode([(answer[-1], pos, 0, True)])
            pos += 1
        start = time.perf_counter()
        prefill([answer[-1]] + question, pos, 0)
        return {"ttft": first, "turn2_ttft": time.perf_counter() - start}

    def run(prompts, n_new):
        mem = lc.llama_get_memory(ctx)
        lc.llama_memory_clear(mem, True)
        last = []
        for s, p in enumerate(prompts):  # prefill prompt by prompt
            last += prefill(p, 0, s)
        first_time = time.perf_counter()
        produced = 1
        pos = [len(p) for p in prompts]
        while produced < n_new:  # then decode all sequences jointly
            last = decode([(last[s], pos[s], s, True) for s in range(len(prompts))])
            pos = [x + 1 for x in pos]
            produced += 1
        return first_time

    return measure_blocking(run, vocab, args)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", required=True,
                   choices=["tokenmill", "transformers", "vllm", "llamacpp"])
    p.add_argument("--workload", required=True, choices=["w1", "w2", "w4"])
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="tokenmill, vLLM and transformers (llama.cpp: the file's types)")
    p.add_argument("--engine-args", default="{}",
                   help="tokenmill only: JSON of extra LLM(...) arguments (quantization, ...)")
    args = p.parse_args()
    result = globals()[args.engine](args)
    if args.workload == "w1":
        result["out_tps"] = args.num_prompts * args.output_len / result["seconds"]
    print("RESULT " + json.dumps({"engine": args.engine, "workload": args.workload, **result}),
          flush=True)


if __name__ == "__main__":
    main()
