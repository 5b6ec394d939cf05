"""Host memory of a block-FP8 checkpoint (DeepSeek-V3 / R1's format) kept as float8 against
loaded as float weights, on the CPU: layers of Llama-2-7B's shape with random weights, their
projections written as float8 with a factor per 128 x 128 block (bench/gpu_fp8_blocks.py's
checkpoint), each mode loaded by `load_model` in a fresh process (TOKENMILL_FP8_BLOCKS=keep:
`Fp8BlockKernel`, one byte a weight and a scale per row and 128 inputs; dequantize: bf16
weights, as a GPU would hold them without it): the weights' bytes, the parameters' bytes
as the model is built (before loading: what a GPU allocates at once), the process's resident
memory before loading, its peak (the checkpoint's mapped pages included) and the memory it
holds itself after, and the load's seconds.

    python bench/fp8_blocks_memory.py [--layers 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(__file__), ".."))  # (PYTHONPATH wins: a worktree)

from record import save  # noqa: E402


def child(path: str) -> dict:
    """One load in this process (the mode from the environment)."""
    import psutil
    import torch

    from tokenmill.loading import checkpoint as loader
    from tokenmill.loading.checkpoint import load_hf_config, load_model
    from tokenmill.quantization.model import weight_bytes

    built = []  # the parameters' bytes as built, before a byte is read (a GPU's allocator
    build = loader.build_model  # takes them at once; the CPU's pages only when touched)

    def counted(*args):
        model = build(*args)
        built.append(sum(p.numel() * p.element_size() for p in model.parameters()
                         if not p.is_meta))
        return model

    loader.build_model = counted
    config = load_hf_config(path)
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    model = load_model(path, config, torch.bfloat16, torch.device("cpu"), 64)
    seconds = time.perf_counter() - start
    kernels: dict[str, int] = {}
    for module in model.modules():
        if hasattr(module, "kernel"):
            kernels[module.kernel.name] = kernels.get(module.kernel.name, 0) + 1
    return {"weight_bytes": weight_bytes(model), "built_param_bytes": built[0],
            "rss_before_load_bytes": before,
            "peak_rss_bytes": _status("VmHWM"), "anon_rss_after_load_bytes":
            _status("RssAnon"),
            "load_s": seconds, "kernels": kernels}


def _status(field: str) -> int:
    """A memory field of /proc/self/status in bytes: VmHWM, the peak resident memory
    (getrusage's maxrss would carry over the parent's peak across the exec; it counts the
    checkpoint's pages mapped by safetensors too), RssAnon, the memory the process holds
    itself now."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", help="a JSON result file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child)))
        return
    from gpu_fp8_blocks import write_checkpoint

    path = os.path.join(tempfile.mkdtemp(), "llama7b_layers_fp8")
    write_checkpoint(path, "cpu", args.layers)
    result = {"layers": args.layers, "checkpoint_bytes": os.path.getsize(
        os.path.join(path, "model.safetensors"))}
    for mode in ("keep", "dequantize"):
        env = {**os.environ, "TOKENMILL_FP8_BLOCKS": mode}
        out = subprocess.run([sys.executable, __file__, "--child", path], env=env, check=True,
                             capture_output=True, text=True).stdout
        result[mode] = json.loads(out.split("RESULT ", 1)[1])
        print(mode, json.dumps(result[mode]), flush=True)
    if args.out:
        save(args.out, **result)


if __name__ == "__main__":
    main()
