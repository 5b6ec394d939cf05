"""What this machine allows, measured in the same run as the engines it judges.

`measure` times read and copy bandwidth, the fp32 matmul rate and the FMA peak. `ceilings`
turns a rate (compare.py gives it the FMA peak) and a bandwidth into the fastest each workload
could run, counting every pass the workload needs: a pass takes at least its FLOPs at the rate
and at least its bytes (all weights once, plus the K/V it reads or writes) at the bandwidth,
whichever is longer. The FLOPs are 2 per
layer weight and token, 2 per LM-head weight and sampled row (a prompt samples its last row
only), and 4 x heads x head_dim per layer for each (query, key) pair of causal attention.
Norms, rotary, sampling and the engine's own work count as free, so no engine reaches a
ceiling; the question a ceiling answers is how much of it a target asks for."""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

FP32 = 4  # bytes per weight and per cached K/V value: the fp32 comparison


def measure(params: int, weight_bytes: int | None = None) -> dict:
    """Read bandwidth (the faster of torch's and `peaks.c`'s sum of 1 GiB), copy bandwidth
    (read + write bytes), fp32 matmul rate and FMA peak measured now; batch-1 decode reads
    every weight once per token (`weight_bytes`, default 4 bytes per parameter)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    a = torch.ones(256 * 1024 * 1024 // 4)  # touched pages: torch.empty would read the zero page
    b = torch.empty_like(a)
    b.copy_(a)
    copy_bandwidth = 2 * a.numel() * 4 / min(_timed(lambda: b.copy_(a)) for _ in range(5))
    read = read_bandwidth()
    n = 2048
    x, y = torch.randn(n, n), torch.randn(n, n)
    x @ y
    gflops = 2 * n ** 3 / min(_timed(lambda: x @ y) for _ in range(5)) / 1e9
    ours = tokenmill_matmul_gflops(x, y)
    best = max(gflops, ours or 0.0)  # a ceiling below what an engine reaches says nothing
    peak = fma_peak_gflops()
    return {**read,
            "copy_bandwidth_gbs": round(copy_bandwidth / 1e9, 1),
            "matmul_gflops": round(gflops, 1),
            "tokenmill_matmul_gflops": None if ours is None else round(ours, 1),
            "fma_peak_gflops": None if peak is None else round(peak, 1),
            "decode_ceiling_tps": round(read["bandwidth_gbs"] * 1e9
                                        / (weight_bytes or params * FP32), 2),
            "throughput_ceiling_tps": round(best * 1e9 / (2 * params), 1)}


def read_bandwidth() -> dict:
    """GB/s reading 1 GiB: torch's sum and `peaks.c`'s (the faster is `bandwidth_gbs`)."""
    import torch

    big = torch.ones(1024 * 1024 * 1024 // 4)  # touched pages: torch.empty reads the zero page
    big.sum()
    torch_read = big.numel() * 4 / min(_timed(big.sum) for _ in range(5)) / 1e9
    ours = read_gbs(big)
    return {"bandwidth_gbs": round(max(torch_read, ours or 0.0), 1),
            "torch_sum_gbs": round(torch_read, 1)}


def tokenmill_matmul_gflops(x, w) -> float | None:
    """x @ w.T through the kernel tokenmill's loader gives an fp32 layer (None if that is plain
    torch): it beats torch's matmul here (~215 vs ~180 GFLOP/s on a Zen 4)."""
    from tokenmill.layers.kernel_choice import choose_linear_kernels
    from tokenmill.layers.linear import DenseKernel, Linear

    layer = Linear(w.shape[1], w.shape[0])
    layer.weight.data.copy_(w)
    choose_linear_kernels(layer)
    if isinstance(layer.kernel, DenseKernel):
        return None
    seconds = min(_timed(lambda: layer(x)) for _ in range(5))
    return 2 * x.shape[0] * x.shape[1] * w.shape[0] / seconds / 1e9


@functools.lru_cache(maxsize=1)
def peaks_library() -> ctypes.CDLL | None:
    """`peaks.c` built now with the system C compiler (None without one)."""
    import torch  # noqa: F401 - first: the library's libgomp resolves to torch's (one pool)

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "peaks.so")
        try:
            subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                            os.path.join(os.path.dirname(__file__), "peaks.c"), "-o", path],
                           check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        lib = ctypes.CDLL(path)  # mapped: the file may go
    lib.tm_fma_flops.restype = ctypes.c_double
    lib.tm_fma_flops.argtypes = [ctypes.c_int64, ctypes.c_void_p]
    lib.tm_read_sum.restype = ctypes.c_float
    lib.tm_read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    return lib


def read_gbs(x) -> float | None:
    """GB/s of `peaks.c` summing the float32 tensor x (best of 5)."""
    lib = peaks_library()
    if lib is None:
        return None
    n = x.numel() // 128 * 128
    seconds = min(_timed(lambda: lib.tm_read_sum(x.data_ptr(), n)) for _ in range(5))
    return n * 4 / seconds / 1e9


def fma_peak_gflops() -> float | None:
    """fp32 FMAs on registers on every core: no kernel does more arithmetic than this."""
    import torch

    lib = peaks_library()
    if lib is None:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    sink = ctypes.c_float()
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        flops = lib.tm_fma_flops(10_000_000, ctypes.byref(sink))
        best = max(best, flops / (time.perf_counter() - start))
    return best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _tensor_sizes(hf_dir: str) -> dict[str, int]:
    from safetensors import safe_open

    sizes = {}
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, name), "pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    sizes[key] = math.prod(f.get_slice(key).get_shape())
    return sizes


def count_params(hf_dir: str) -> int:
    return sum(_tensor_sizes(hf_dir).values())


def _config(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        return json.load(f)


def _active_sizes(sizes: dict[str, int], share: float) -> dict[str, int]:
    """Parameters a token reads: a mixture of experts' routed experts count `share` (top-k /
    experts) of their size (each token runs k of them); everything else whole."""
    return {key: round(n * share) if ".experts." in key else n for key, n in sizes.items()}


def _expert_share(cfg: dict) -> float:
    """top-k / routed experts (1 for a dense model)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get(
        "n_routed_experts")
    return cfg["num_experts_per_tok"] / experts if experts else 1.0


def active_params(hf_dir: str) -> int:
    """`count_params` of what one token reads (all of a dense model)."""
    return sum(_active_sizes(_tensor_sizes(hf_dir), _expert_share(_config(hf_dir))).values())


@dataclass(frozen=True)
class Shape:
    """What a token costs in a decoder-only model."""

    layer_params: int  # the decoder layers' weights: 2 FLOPs each per token
    head_params: int  # the LM head (the embedding when tied): 2 FLOPs each per sampled row
    layers: int
    q_width: int  # heads x head_dim: each (query, key) pair costs 4 x q_width FLOPs a layer
    kv_width: int  # kv heads x head_dim: the K and V values a token keeps per layer
    # a mixture of experts: every routed expert's weights (all layers), and top-k / experts,
    # the share of them a token runs (its FLOPs: layer_params counts that share)
    routed_params: int = 0
    routed_share: float = 1.0

    def pass_params(self, tokens: int) -> float:
        """Weights a pass over `tokens` tokens reads: all of a dense model; of the routed
        experts, those any token picks, 1 - (1 - k/E)^tokens of them when tokens pick
        independently and evenly (a batch-32 decode step of 8 of 32 experts reads all but
        1e-4 of them, where counting each token's k read 8)."""
        dense = self.layer_params - self.routed_params * self.routed_share
        touched = 1.0 - (1.0 - self.routed_share) ** tokens
        return dense + self.routed_params * touched + self.head_params


def model_shape(hf_dir: str) -> Shape:
    cfg = _config(hf_dir)
    sizes, share = _tensor_sizes(hf_dir), _expert_share(cfg)
    routed = sum(n for key, n in sizes.items() if ".experts." in key)
    active = _active_sizes(sizes, share)  # (a token's FLOPs: its active experts only)
    layer_params = sum(n for key, n in active.items() if ".layers." in key)
    head = sizes.get("lm_head.weight") or sizes["model.embed_tokens.weight"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return Shape(layer_params, head, cfg["num_hidden_layers"],
                 cfg["num_attention_heads"] * head_dim, kv_heads * head_dim,
                 routed_params=routed, routed_share=share if routed else 1.0)


class Passes:
    """FLOPs and bytes of forward passes, and their time at the measured rates."""

    def __init__(self, shape: Shape, gflops: float, bandwidth_gbs: float) -> None:
        self.shape, self.rate, self.bandwidth = shape, gflops * 1e9, bandwidth_gbs * 1e9
        self.kv_token_bytes = 2 * shape.kv_width * shape.layers * FP32
        self.flops = 0.0  # totals over every pass costed so far
        self.kv_bytes = 0.0

    def weight_bytes(self, tokens: int) -> float:
        return self.shape.pass_params(tokens) * FP32

    def _take(self, flops: float, kv_bytes: float, tokens: int) -> float:
        self.flops += flops
        self.kv_bytes += kv_bytes
        return max(flops / self.rate, (self.weight_bytes(tokens) + kv_bytes) / self.bandwidth)

    def prefill(self, prompts: int, length: int) -> float:
        """Seconds for one pass over `prompts` fresh prompts of `length` tokens, each sampling
        its last row."""
        s = self.shape
        pairs = length * (length + 1) // 2  # causal (query, key) pairs per prompt
        flops = prompts * (length * 2 * s.layer_params + 2 * s.head_params
                           + pairs * 4 * s.q_width * s.layers)
        return self._take(flops, prompts * length * self.kv_token_bytes,  # K/V written
                          prompts * length)

    def decode(self, rows: int, context: int) -> float:
        """Seconds for one decode pass of `rows` sequences, each attending over `context`
        tokens (its new one included)."""
        s = self.shape
        flops = rows * (2 * (s.layer_params + s.head_params) + context * 4 * s.q_width * s.layers)
        return self._take(flops, rows * context * self.kv_token_bytes, rows)

    def request_batch(self, rows: int, input_len: int, output_len: int) -> float:
        """`rows` equal requests that start together: one prompt pass, then output_len - 1
        decode passes."""
        return self.prefill(rows, input_len) + sum(self.decode(rows, input_len + i)
                                                   for i in range(1, output_len))


def ceilings(shape: Shape, gflops: float, bandwidth_gbs: float, *, num_prompts: int,
             input_len: int, output_len: int, w2_output_len: int, w3_requests: int,
             w3_concurrency: int) -> dict:
    """The compare workloads at the measured rates (fp32 weights and K/V cache).

    W1: all prompts in one pass, then the decode passes of the whole batch. W2: one request.
    W3: `w3_concurrency` closed-loop clients with equal requests arrive and finish together,
    so an engine that starts prompts as they come runs the requests in waves (`out_tps`).
    `any_schedule_out_tps` bounds every schedule: the run's FLOPs at the matmul rate, or the
    weights read once per pass at the bandwidth, with at least requests x output_len /
    concurrency passes (each request needs output_len passes one after another, and at most
    `concurrency` are in flight)."""
    w1 = Passes(shape, gflops, bandwidth_gbs)
    w1_s = w1.request_batch(num_prompts, input_len, output_len)
    w2 = Passes(shape, gflops, bandwidth_gbs)
    ttft = w2.prefill(1, input_len)
    w2_decode_s = sum(w2.decode(1, input_len + i) for i in range(1, w2_output_len))
    w3 = Passes(shape, gflops, bandwidth_gbs)
    w3_s = sum(w3.request_batch(min(w3_concurrency, w3_requests - start), input_len, output_len)
               for start in range(0, w3_requests, w3_concurrency))
    passes = math.ceil(w3_requests * output_len / w3_concurrency)
    # (a mixture of experts: each pass as a decode step of `w3_concurrency` rows)
    any_s = max(w3.flops / w3.rate,
                (passes * w3.weight_bytes(w3_concurrency) + w3.kv_bytes) / w3.bandwidth)
    tokens = w3_requests * output_len
    return {"w1": {"out_tps": round(num_prompts * output_len / w1_s, 1)},
            "w2": {"decode_tps": round((w2_output_len - 1) / w2_decode_s, 1),
                   "ttft_s": round(ttft, 4)},
            "w3": {"out_tps": round(tokens / w3_s, 1),
                   "any_schedule_out_tps": round(tokens / any_s, 1),
                   "tflop": round(w3.flops / 1e12, 2)}}

