"""Tensor and pipeline parallel on this machine's CPU: W1 offline throughput with one rank
(all cores) against several ranks (the cores shared out), the all-reduce time inside those steps, a
gloo all-reduce micro-benchmark, and each rank's peak resident memory.

Model: random weights shaped like Qwen2.5-0.5B (bench/peers/prepare_models.py), fp32, made
once into --model-dir. Every configuration runs in a fresh process (its own threads and peak
memory). W1: --num-prompts prompts of --input-len random ids -> exactly --output-len new
tokens, greedy; W2: the first of them alone -> --w2-output-len tokens (batch-1 decode).

Configurations are TPxPP; a "-serial" suffix (1x2-serial) keeps one pipeline micro-batch in
flight instead of one per stage. W1's prompt phase (until every request has its first token)
and decode phase are timed apart.

  python bench/tensor_parallel.py [--configs 1x1,2x1,1x2,1x2-serial] [--json PATH]"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child_w1(args) -> dict:
    """One configuration, in this process (rank 0) and its workers."""
    import psutil
    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.distributed import parallel_state
    from tokenmill.loading.checkpoint import load_hf_config
    from tokenmill.quantization.model import weight_bytes

    spent = {"s": 0.0, "calls": 0}
    plain = parallel_state.TensorParallelGroup.all_reduce

    # Rank 0's wall time in all-reduces called from Python (prompt steps, embeddings), waiting
    # for the other ranks included; the compiled decode step's all-reduces run inside C.
    def timed(self, x):
        start = time.perf_counter()
        out = plain(self, x)
        spent["s"] += time.perf_counter() - start
        spent["calls"] += 1
        return out

    parallel_state.TensorParallelGroup.all_reduce = timed
    vocab = load_hf_config(args.model_dir).vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # "1x2-serial": pipeline stages with one micro-batch in flight instead of one per stage
    layout, _, mode = args.child.partition("-")
    tp, pp = (int(x) for x in layout.split("x"))
    with LLM(args.model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             kv_cache_memory_gib=0.25, max_num_batched_tokens=args.max_num_batched_tokens,
             enable_prefix_caching=False) as llm:
        if mode == "serial":
            llm.engine.core.max_in_flight = 1
        llm.generate(prompts[:2], params.clone(max_tokens=4), use_tqdm=False)  # warm-up
        spent.update(s=0.0, calls=0)
        steps = {"n": 0, "prefill_s": None}
        core = llm.engine.core
        step = core.step

        def counted():
            steps["n"] += 1
            out = step()
            # the prompt phase ends when every request has its first token
            if steps["prefill_s"] is None and not core.scheduler.waiting and all(
                    r.output_token_ids for r in core.scheduler.requests.values()):
                steps["prefill_s"] = time.perf_counter() - start
            return out

        core.step = counted
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        w1_spent = dict(spent)
        # W2: one request decoding alone (batch 1), the weights streamed once per token.
        spent.update(s=0.0, calls=0)
        start = time.perf_counter()
        llm.generate(prompts[:1], params.clone(max_tokens=args.w2_output_len), use_tqdm=False)
        w2 = time.perf_counter() - start
        workers = [p.pid for p in psutil.Process().children(recursive=True)]
        weights = weight_bytes(llm.engine.core.runner.model) / 2**20
        rss = [peak_rss_mib(os.getpid())] + [peak_rss_mib(pid) for pid in workers]
        threads = torch.get_num_threads()
    w1_steps = steps["n"] - args.w2_output_len
    return {"config": args.child, "seconds": round(elapsed, 2),
            "prefill_s": round(steps["prefill_s"], 2),
            "decode_s": round(elapsed - steps["prefill_s"], 2),
            "out_tok_s": round(args.num_prompts * args.output_len / elapsed, 2),
            "steps": w1_steps, "threads_per_rank": threads,
            "all_reduce_s": round(w1_spent["s"], 3), "all_reduce_calls": w1_spent["calls"],
            "all_reduce_share": round(w1_spent["s"] / elapsed, 4),
            "all_reduce_ms_per_step": round(1000 * w1_spent["s"] / max(1, w1_steps), 3),
            "w2_tok_s": round(args.w2_output_len / w2, 2),
            "rank0_weights_mib": round(weights, 1),
            "peak_rss_mib_per_rank": [round(r, 1) for r in rss]}


def _allreduce_rank(rank: int, path: str, shm_path: str, shapes: list, repeats: int,
                    out) -> None:
    import datetime as dt

    import torch
    import torch.distributed as dist

    from tokenmill.distributed.shm_allreduce import ShmAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=120))
    shm = ShmAllReduce(shm_path, rank, 2)
    result = {"gloo": {}, "shm": {}}
    for name, reduce in (("gloo", dist.all_reduce), ("shm", shm)):
        for rows, hidden in shapes:
            x = torch.randn(rows, hidden)
            for _ in range(3):
                reduce(x)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                reduce(x)
            result[name][f"{rows}x{hidden}"] = round(
                1e6 * (time.perf_counter() - start) / repeats, 1)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def allreduce_micro(hidden: int, repeats: int) -> dict:
    """Microseconds per all-reduce of [rows, hidden] fp32 between two 1-thread ranks: gloo's
    and the shared-memory one."""
    import tempfile

    import torch.multiprocessing as mp

    from tokenmill.distributed.shm_allreduce import create_segment

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(prefix="tm-ar-"), "store")
    shm_path = create_segment(2)
    shapes = [(1, hidden), (32, hidden), (256, hidden), (2048, hidden)]
    procs = [ctx.Process(target=_allreduce_rank,
                         args=(r, path, shm_path, shapes, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(60)
    os.unlink(shm_path)
    return result


def ensure_model(model_dir: str) -> None:
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return
    sys.path.insert(0, os.path.join(HERE, "peers"))
    from prepare_models import qwen_shaped

    qwen_shaped(model_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "tokenmill-bench", "qwen0.5b"))
    p.add_argument("--configs", default="1x1,2x1,1x2",
                   help="tensor x pipeline parallel sizes to run, the first is the baseline")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--w2-output-len", type=int, default=128, help="batch-1 decode tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's token budget per step (micro-batch)")
    p.add_argument("--repeats", type=int, default=200, help="micro-benchmark repeats")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child_w1(args)))
        return
    ensure_model(args.model_dir)
    runs = []
    for size in args.configs.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", size,
               "--model-dir", args.model_dir, "--num-prompts", str(args.num_prompts),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--w2-output-len", str(args.w2_output_len)]
        if args.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{size} failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    from tokenmill.loading.checkpoint import load_hf_config

    micro = allreduce_micro(load_hf_config(args.model_dir).hidden_size, args.repeats)
    base = runs[0]["out_tok_s"]
    print(f"{'tp x pp':>11}{'W1 tok/s':>10}{'vs base':>9}{'prompts s':>11}{'decode s':>10}"
          f"{'W2 tok/s':>10}{'vs base':>9}{'steps':>7}{'AR ms/step':>12}"
          f"{'AR share':>10}{'weights MiB':>13}  peak RSS MiB per rank")
    for r in runs:
        print(f"{r['config']:>11}{r['out_tok_s']:>10.2f}{r['out_tok_s'] / base:>8.2f}x"
              f"{r['prefill_s']:>11.2f}{r['decode_s']:>10.2f}"
              f"{r['w2_tok_s']:>10.2f}{r['w2_tok_s'] / runs[0]['w2_tok_s']:>8.2f}x{r['steps']:>7}"
              f"{r['all_reduce_ms_per_step']:>12.2f}{100 * r['all_reduce_share']:>9.1f}%"
              f"{r['rank0_weights_mib']:>13.1f}  "
              f"{r['peak_rss_mib_per_rank']}")
    print("all-reduce of [rows, hidden] fp32, 2 ranks of 1 thread, us:", micro)
    from offline_throughput import cpu_model

    record = {"command": "python bench/tensor_parallel.py " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "processor": cpu_model(),
                          "cpus": os.cpu_count()},
              "model": "Qwen2.5-0.5B-shaped random fp32", "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "runs": runs, "all_reduce_us": micro}
    path = args.json or os.path.join(HERE, "results",
                                     f"tensor_parallel-{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
