"""What the GPU checklist (gpu_check.py) measures with: a part guarded so its failure keeps
the section's other numbers, wall time around CUDA syncs, a decode step's device time (graph
replays) beside its host waits, profiles of host ops and of the kernels of a graph replay or
of any call (a 2k prefill: its device-only TFLOP/s), the device step's share of the bandwidth
roofline, transformers' own `generate` beside it, and environment variables set while an
engine is built."""

from __future__ import annotations

import contextlib
import os
import time
import traceback

import torch


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """Environment variables set while an engine is built (its kernel choices), then restored."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def standalone(section) -> None:
    """A checklist section run alone: `--model DIR --out FILE.json`, `section(DIR)`'s
    result written to FILE.json and printed."""
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = section(args.model)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


def guarded(fn) -> dict:
    """A part of a section that has never run on a GPU: its failure is recorded in its place
    instead of taking the section's other numbers with it."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a checklist reports every part
        return {"error": traceback.format_exc()[-3000:]}


def guarded_part(section: dict, name: str) -> dict:
    """A part of a section that may have failed (its error in its place): {} if it did."""
    part = section.get(name, {})
    return part if "batch1_tok_s" in part else {}


def shares(part: dict, roofline_tok_s: float) -> None:
    """A measured engine's batch-1 rate and device step as shares of the roofline."""
    if part:
        part["batch1_of_roofline"] = part["batch1_tok_s"] / roofline_tok_s
        part["batch1_device_of_roofline"] = device_share(part, roofline_tok_s)


def timed(fn, reps: int = 1) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": x} for x in prompts], params, use_tqdm=False)


def decode_rate(llm, prompts, one) -> float:
    """Batch-1 decode tokens per second: 65 tokens' time less one token's (the prompt's
    prefill and the request's own costs cancel), `one` greedy params with max_tokens 1."""
    import functools

    generate(llm, prompts, one.clone(max_tokens=8))
    t1 = timed(functools.partial(generate, llm, prompts, one.clone(max_tokens=65)))
    t0 = timed(functools.partial(generate, llm, prompts, one))
    return 64 / (t1 - t0)


def transformers_side(hf, prompts: list[list[int]], out_len: int) -> dict:
    """The model's size, and transformers' `generate` at batch 1 and over every prompt."""
    res = {"params": sum(p.numel() for p in hf.parameters()),
           "weight_bytes": sum(p.numel() * p.element_size() for p in hf.parameters())}

    def hf_generate(ids, n):
        with torch.inference_mode():
            return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0, attention_mask=torch.ones_like(ids))

    ids = torch.tensor(prompts, device="cuda")
    hf_generate(ids[:2], 4)
    res["hf_batch1_tok_s"] = out_len / timed(lambda: hf_generate(ids[:1], out_len))
    res["hf_batch_tok_s"] = len(prompts) * out_len / timed(lambda: hf_generate(ids, out_len))
    return res


def llama_7b_layers(layers: int = 4):
    """Llama-2-7B's shape (4096 wide, 11008 MLP, 32 heads of 128) with `layers` layers: per
    layer a 7B model's kernels and bytes, at a fraction of its weights."""
    import transformers as tf

    return tf.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                          num_hidden_layers=layers, num_attention_heads=32,
                          num_key_value_heads=32, max_position_embeddings=4096,
                          eos_token_id=1, bos_token_id=0)


def host_and_device(runner, fn, steps: int) -> dict:
    """A decode step's device time (one replay of each batch-1 and batch-64 graph variant,
    timed by CUDA events; the variant is the attention's key-split count) beside what the
    engine spends per token in all: the rest is host work the device waits through. And how
    often the host waits for the device over `steps` decode steps (torch's sync debug mode
    warns at each wait; one per step, for the tokens, is the least a step can do)."""
    import warnings

    res = {}
    graphs = runner.graphs
    for (size, rows, variant), graph in (graphs.graphs if graphs is not None else {}).items():
        if size not in (1, 64) or rows != 1:
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        res[f"graph_replay_ms_batch{size}_variant{variant}"] = start.elapsed_time(end) / 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [str(w.message).splitlines()[0][:80] for w in caught
             if "synchroniz" in str(w.message)]
    res["host_waits_per_decode_step"] = len(waits) / steps
    res["host_wait_kinds"] = sorted(set(waits))
    return res


def replay_kernels(graph) -> dict:
    """Where one batch-1 decode step's device time goes: the kernels of one graph replay,
    grouped by name, with their total device time (what a faster step must shrink)."""
    return kernel_time(graph.replay)


def kernel_time(fn) -> dict:
    """The kernels `fn` runs, grouped by name, and their total device time: beside `fn`'s
    wall time (measured without the profiler), what is left is time the device waited for
    the host (a 2k-token prefill's scheduling and inputs, before its first kernel)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {"kernels": sum(e.count for e in kernels),
            "device_us": round(sum(e.self_device_time_total for e in kernels)),
            "top": [[e.key[:70], e.count, round(e.self_device_time_total)]
                    for e in kernels[:20]]}


def profile_decode(fn) -> dict:
    """Where batch-1 decode's time goes: the ops with the most CPU time over one short
    request, and how many kernels it launched."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    events = prof.key_averages()
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    return {"cuda_kernels": kernels, "top_self_cpu_us": [
        [e.key[:60], e.count, round(e.self_cpu_time_total)] for e in top]}


def device_share(section: dict, roofline_tok_s: float) -> float | None:
    """The device's batch-1 step alone (its fastest graph replay) as a share of the roofline:
    what a model whose host work is hidden (asynchronous scheduling, or a 32-layer model's
    longer steps) can reach."""
    split = section.get("decode_split", {})
    replays = [v for k, v in split.items() if k.startswith("graph_replay_ms_batch1_")]
    return 1e3 / min(replays) / roofline_tok_s if replays else None


def device_tflops(res: dict, flops: float) -> None:
    """The 2k prefill's FLOPs over its kernels' device time alone (`kernel_time`): the share
    of peak the device reached, apart from the host's time before its first kernel and
    after its last."""
    device_us = res["prefill_2k_kernels"].get("device_us")
    if device_us:
        res["prefill_2k_device_tflops"] = flops / device_us / 1e6
