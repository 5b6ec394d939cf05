"""GPU checklist (issue 30): correctness of the engine on a CUDA device against transformers,
then batch-1 decode against the HBM roofline, batched throughput against transformers'
`generate`, and 2k-token prefill against bf16 tensor-core peak. Every section runs even when
an earlier one fails; results go to one JSON file, rewritten after each section. Also mixed
steps with and without piecewise graphs (bench/gpu_pieces.py), and speculative decoding's
drafted steps with and without CUDA graphs (bench/gpu_speculation.py).

    python bench/gpu_check.py --out bench/results/gpu-<card>-<date>.json [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_pieces import pieces  # noqa: E402
from gpu_probes import (  # noqa: E402
    decode_rate,
    device_share,
    device_tflops,
    environment,
    generate,
    guarded,
    guarded_part,
    host_and_device,
    kernel_time,
    llama_7b_layers,
    profile_decode,
    replay_kernels,
    shares,
    timed,
    transformers_side,
)
from gpu_speculation import speculation  # noqa: E402

# engines whose 16-bit linears run decode steps on the Triton skinny matmul (config.py)
SKINNY = {"TOKENMILL_GPU_SKINNY_LINEAR": "1"}


def hardware() -> dict:
    """The card's own limits, measured: copy bandwidth and a large bf16 matmul."""
    props = torch.cuda.get_device_properties(0)
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    (y := torch.empty_like(x)).copy_(x)
    t = timed(lambda: y.copy_(x), 10)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    a @ a
    tm = timed(lambda: a @ a, 10)
    return {"name": props.name, "memory_gib": props.total_memory / 2**30,
            "sms": props.multi_processor_count, "torch": torch.__version__,
            "copy_gbps": 2 * 2 * 2**30 / t / 1e9, "bf16_matmul_tflops": 2 * 8192**3 / tm / 1e12}


def correctness(root: str) -> dict:
    """Tiny random models: greedy tokens from tokenmill on cuda (CUDA graphs where the model
    takes them: the MoE model on fused experts, DeepSeek's latent attention; prompt chunks
    in piecewise graphs) equal transformers' on cuda."""
    from helpers import make_model

    from tokenmill import LLM, SamplingParams

    out = {}
    prompts = [[5, 9, 17, 33, 2, 8], [7] * 40, list(range(3, 120))]
    for arch in ("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "deepseek_v3"):
        path = os.path.join(root, arch)
        hf = make_model(path, arch).to("cuda")
        refs = []
        for p in prompts:
            with torch.no_grad():
                ids = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24,
                                  min_new_tokens=24, do_sample=False, pad_token_id=0)
            refs.append(ids[0, len(p):].tolist())
        llm = LLM(path, device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                  max_num_batched_tokens=64, block_size=16)  # 64: the long prompt is chunked
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
        runner = llm.engine.core.runner
        out[arch] = {"graphs": runner.graphs is not None, "pieces": runner.pieces is not None,
                     "equal": got == refs, "matching_prefix": [
            next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r))
            for g, r in zip(got, refs)]}
        del llm, hf, runner
        torch.cuda.empty_cache()
    return out


def bench_model(path: str):
    """Qwen2-0.5B's shape with random bf16 weights (tied embeddings: 0.49 B parameters)."""
    import transformers as tf
    from helpers import make_tokenizer

    config = tf.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                            max_position_embeddings=4096, tie_word_embeddings=True,
                            eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    make_tokenizer(path)
    return model


def bench_model_at(root: str) -> str:
    """The bench model's folder under `root` (written by the performance section, else now)."""
    path = os.path.join(root, "qwen05b")
    if not os.path.isdir(path):
        bench_model(path)
    return path


def performance(root: str, quick: bool) -> dict:
    from tokenmill import LLM, SamplingParams

    path = os.path.join(root, "qwen05b")
    g = torch.Generator().manual_seed(0)
    out_len = 64 if quick else 128
    batch = 32 if quick else 64
    prompts = [torch.randint(2, 150000, (128,), generator=g).tolist() for _ in range(batch)]
    long_prompt = torch.randint(2, 150000, (2048,), generator=g).tolist()
    res = transformers_side(bench_model(path).to("cuda"), prompts, out_len)
    torch.cuda.empty_cache()

    start = time.perf_counter()
    llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5, seed=0,
              enable_prefix_caching=False, max_num_batched_tokens=4096)
    res["start_s"] = time.perf_counter() - start  # load, KV cache, CUDA-graph capture
    runner = llm.engine.core.runner
    res["backend"] = type(runner.backend).__name__
    res["graph_sizes"] = runner.graphs.sizes if runner.graphs is not None else None
    res["piece_sizes"] = runner.pieces.sizes if runner.pieces is not None else None
    res["graph_gib"] = runner.graph_bytes / 2**30  # (held beside the KV cache)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)

    run = functools.partial(generate, llm)
    run(prompts[:2], params.clone(max_tokens=4))
    t1 = timed(functools.partial(run, prompts[:1], params))
    t0 = timed(functools.partial(run, prompts[:1], params.clone(max_tokens=1)))
    per_token = (t1 - t0) / (out_len - 1)
    res["batch1_tok_s"] = 1 / per_token
    res["batch1_roofline_tok_s"] = None  # filled by the caller from the measured bandwidth
    res["batch_tok_s"] = batch * out_len / timed(functools.partial(run, prompts, params))
    run([long_prompt], params.clone(max_tokens=1))
    tp = timed(functools.partial(run, [long_prompt], params.clone(max_tokens=1)), 3)
    # 2·params per token for the linears (the tied LM head runs once, on the last token) plus
    # causal attention's QK and PV: 2·2·(L²/2)·heads·head_dim per layer
    linear = 2 * (res["params"] - 151936 * 896) * len(long_prompt)
    attn = 24 * 2 * 2 * (len(long_prompt) ** 2 / 2) * 14 * 64
    res["prefill_2k_s"] = tp
    res["prefill_2k_tflops"] = (linear + attn) / tp / 1e12
    res["prefill_2k_kernels"] = guarded(functools.partial(
        kernel_time, functools.partial(run, [long_prompt], params.clone(max_tokens=1))))
    device_tflops(res, linear + attn)
    res["decode_split"] = host_and_device(runner, functools.partial(
        run, prompts[:1], params.clone(max_tokens=9)), 8)
    greedy = [o.outputs[0].token_ids for o in run(prompts[:4], params.clone(max_tokens=16))]
    del llm, runner, run
    gc.collect()
    torch.cuda.empty_cache()
    res["eager"] = other_engines(path, prompts, params, batch, greedy, {
        "triton": {"enforce_eager": True, "attention_backend": "triton"},
        "torch": {"enforce_eager": True, "attention_backend": "torch"}}, 32, long_prompt)
    res["async_scheduling"] = guarded(lambda: other_engines(
        path, prompts, params, batch, greedy, {"graphs": {"async_scheduling": True}},
        out_len)["graphs"])
    # decode's linears through the Triton skinny matmul instead of cuBLAS (the same graphs)
    res["skinny_linear"] = guarded(lambda: other_engines(
        path, prompts, params, batch, greedy, {"skinny_linear": {"env": SKINNY}},
        out_len)["skinny_linear"])
    return res


def prefill_7b_shape(root: str) -> dict:
    """Prefill efficiency where it can be high: 4 layers of Llama-2-7B's shape (4096 wide,
    11008 MLP, 32 heads of 128), random bf16 weights, one 2048-token prompt. A prompt's work
    is per layer, so 4 layers measure the same share of peak as 32 would, at an eighth of the
    weights. FLOPs: 2 x the layers' parameters per token, plus causal attention's QK and PV.
    And batch-1 decode of the same layers, synchronous and with asynchronous scheduling:
    per layer a 7B model's kernels and bytes, so the share of the bandwidth roofline a 7B
    model would reach (its bytes per token: the layers, the final norm and the LM head)."""
    import transformers as tf
    from helpers import make_tokenizer

    from tokenmill import LLM, SamplingParams

    path = os.path.join(root, "llama7b_4layers")
    config = llama_7b_layers()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    make_tokenizer(path)
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    del model
    torch.cuda.empty_cache()
    llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5, seed=0,
              enable_prefix_caching=False, max_num_batched_tokens=4096)
    prompt = torch.randint(2, 32000, (2048,), generator=torch.Generator().manual_seed(1))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    run = functools.partial(generate, llm, [prompt.tolist()], one)
    run()
    seconds = timed(run, 3)
    flops = 2 * layer_params * 2048 + 4 * 2 * 2 * (2048 ** 2 / 2) * 32 * 128
    res = {"layer_params": layer_params, "prefill_2k_s": seconds,
           "prefill_2k_tflops": flops / seconds / 1e12,
           "prefill_2k_kernels": guarded(functools.partial(kernel_time, run)),
           "decode_read_bytes": 2 * (layer_params + 4096 + 32000 * 4096)}
    device_tflops(res, flops)
    short = [prompt[:128].tolist()]

    def decode_async() -> float:
        llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5, seed=0,
                  enable_prefix_caching=False, async_scheduling=True)
        return decode_rate(llm, short, one)

    def decode_skinny() -> dict:
        with environment(SKINNY):
            llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5,
                      seed=0, enable_prefix_caching=False)
        return {"batch1_tok_s": decode_rate(llm, short, one), "decode_split": host_and_device(
            llm.engine.core.runner, functools.partial(generate, llm, short,
                                                      one.clone(max_tokens=9)), 8)}

    res["batch1_tok_s"] = decode_rate(llm, short, one)
    # the step's device time and its kernels: a 32-layer model's share of the roofline follows
    split = functools.partial(host_and_device, llm.engine.core.runner, functools.partial(
        generate, llm, short, one.clone(max_tokens=9)), 8)
    res["decode_split"] = guarded(split)
    del llm, run, split
    gc.collect()
    torch.cuda.empty_cache()
    res["batch1_async_tok_s"] = guarded(decode_async)
    gc.collect()
    torch.cuda.empty_cache()
    res["skinny_linear"] = guarded(decode_skinny)
    gc.collect()
    torch.cuda.empty_cache()
    return res


def other_engines(path, prompts, params, batch, greedy, engines: dict, n: int,
                  long_prompt: list[int] | None = None) -> dict:
    """The same model under other engine settings (`engines`: name -> LLM keyword arguments),
    `n` tokens per request: op by op (no CUDA graphs) on the Triton and on the torch backend,
    what the graphs and the kernels each bring; asynchronous scheduling, what overlapping the
    host's work with the device's brings (and the host waits left per decode step); whether
    the tokens stay the same; with `long_prompt`, its prefill's seconds too."""
    from tokenmill import LLM

    res = {}
    for name, settings in engines.items():
        settings = dict(settings)
        with environment(settings.pop("env", {})):
            llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5,
                      seed=0, enable_prefix_caching=False, max_num_batched_tokens=4096,
                      **settings)
        one, short = params.clone(max_tokens=n), params.clone(max_tokens=1)
        generate(llm, prompts[:2], params.clone(max_tokens=4))
        t1 = timed(functools.partial(generate, llm, prompts[:1], one))
        t0 = timed(functools.partial(generate, llm, prompts[:1], short))
        res[name] = {
            "batch1_tok_s": (n - 1) / (t1 - t0),
            "batch_tok_s": batch * n / timed(functools.partial(generate, llm, prompts, one)),
            "same_greedy_tokens_as_graphs": [o.outputs[0].token_ids for o in generate(
                llm, prompts[:4], params.clone(max_tokens=16))] == greedy}
        if long_prompt is not None:
            generate(llm, [long_prompt], short)
            res[name]["prefill_2k_s"] = timed(functools.partial(
                generate, llm, [long_prompt], short), 3)
        if settings.get("async_scheduling") or name == "skinny_linear":
            res[name]["decode_split"] = host_and_device(
                llm.engine.core.runner, functools.partial(
                    generate, llm, prompts[:1], params.clone(max_tokens=9)), 8)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return res


def kernels(root: str) -> dict:
    """Profiles, last (after every timing: a profiler once left the eager engines timed after
    it slower): for the 0.5B model and the 7B-shaped layers, the host ops and kernel count of a
    short batch-1 request, and the kernels of one batch-1 decode graph replay."""
    from tokenmill import LLM, SamplingParams

    res = {}
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    for name in ("qwen05b", "llama7b_4layers"):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        llm = LLM(path, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5, seed=0,
                  enable_prefix_caching=False)
        run = functools.partial(generate, llm, [list(range(2, 130))], params)
        run()
        graphs = llm.engine.core.runner.graphs
        one = [g for (size, rows, _), g in (graphs.graphs if graphs is not None else {}).items()
               if size == rows == 1]
        res[name] = {"decode_profile": guarded(functools.partial(profile_decode, run)),
                     "batch1_replay_kernels": guarded(functools.partial(replay_kernels, one[0]))
                     if one else None}
        del llm, run, graphs, one
        gc.collect()
        torch.cuda.empty_cache()
    return res


def derive(result: dict) -> None:
    """Shares of the card's measured limits, from the sections that have finished."""
    hw, perf, big = (result.get(k, {}) for k in ("hardware", "performance", "prefill_7b_shape"))
    if "copy_gbps" in hw and "weight_bytes" in perf and "batch1_tok_s" in perf:
        perf["batch1_roofline_tok_s"] = hw["copy_gbps"] * 1e9 / perf["weight_bytes"]
        perf["batch1_of_roofline"] = perf["batch1_tok_s"] / perf["batch1_roofline_tok_s"]
        perf["batch_vs_hf"] = perf["batch_tok_s"] / perf["hf_batch_tok_s"]
        perf["prefill_of_peak"] = perf["prefill_2k_tflops"] / hw["bf16_matmul_tflops"]
        if "prefill_2k_device_tflops" in perf:
            perf["prefill_device_of_peak"] = (perf["prefill_2k_device_tflops"]
                                              / hw["bf16_matmul_tflops"])
        perf["batch1_device_of_roofline"] = device_share(perf, perf["batch1_roofline_tok_s"])
        shares(guarded_part(perf, "async_scheduling"), perf["batch1_roofline_tok_s"])
        shares(guarded_part(perf, "skinny_linear"), perf["batch1_roofline_tok_s"])
    if "bf16_matmul_tflops" in hw and "prefill_2k_tflops" in big:
        big["prefill_of_peak"] = big["prefill_2k_tflops"] / hw["bf16_matmul_tflops"]
        if "prefill_2k_device_tflops" in big:
            big["prefill_device_of_peak"] = (big["prefill_2k_device_tflops"]
                                             / hw["bf16_matmul_tflops"])
    if "copy_gbps" in hw and "batch1_tok_s" in big:
        big["batch1_roofline_tok_s"] = hw["copy_gbps"] * 1e9 / big["decode_read_bytes"]
        for name in ("batch1_tok_s", "batch1_async_tok_s"):
            if isinstance(big.get(name), float):
                big[name.replace("tok_s", "of_roofline")] = (big[name]
                                                             / big["batch1_roofline_tok_s"])
        big["batch1_device_of_roofline"] = device_share(big, big["batch1_roofline_tok_s"])
        shares(guarded_part(big, "skinny_linear"), big["batch1_roofline_tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections",
                    default="hardware,correctness,performance,prefill_7b_shape,pieces,"
                            "speculation,kernels",
                    help="comma-separated subset to run (a rerun of the ones that failed)")
    args = ap.parse_args()
    result = {"date": datetime.date.today().isoformat(),
              "command": "python " + " ".join(sys.argv)}
    root = tempfile.mkdtemp()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # the targets first; the file is rewritten after every section, so a run stopped by its
    # time limit keeps what finished
    for name, fn in (("hardware", hardware), ("correctness", lambda: correctness(root)),
                     ("performance", lambda: performance(root, args.quick)),
                     ("prefill_7b_shape", lambda: prefill_7b_shape(root)),
                     ("pieces", lambda: pieces(bench_model_at(root))),
                     ("speculation", lambda: speculation(bench_model_at(root), root)),
                     ("kernels", lambda: kernels(root))):
        if name not in args.sections.split(","):
            result[name] = {}
            continue
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - a checklist reports every section
            result[name] = {"error": traceback.format_exc()[-3000:]}
        result[name]["seconds"] = time.perf_counter() - start
        derive(result)
        print(json.dumps({name: result[name]}, indent=1), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
