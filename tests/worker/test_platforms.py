"""platforms/: which platform a device gets, an out-of-tree one registered, the GPU's KV
budget arithmetic (with torch.cuda's memory readings faked), the profiling step that
budget measures, the CUDA graphs' memory measured beside it, and a float8 K/V cache refused
by name where Triton has no float8."""

import logging

import pytest
import torch
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.platforms import _PLATFORMS, Platform, get_platform, register_platform
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.platforms.cuda import CudaPlatform


def test_cpu_platform_and_an_unknown_device():
    platform = get_platform(torch.device("cpu"))
    assert isinstance(platform, CpuPlatform)
    assert platform.default_dtype(None) == torch.float32
    assert isinstance(platform.attention_backend("auto"), TorchSDPABackend)
    assert platform.kv_budget_bytes(0.5, 0.9) == 2**29
    assert platform.reserved_bytes() == 0
    with pytest.raises(ValueError, match="No tokenmill platform for device type 'meta'"):
        get_platform(torch.device("meta"))


def test_the_cpu_kv_budget_is_the_machines_split_across_its_ranks(monkeypatch):
    """An asked-for budget is the machine's, shared by the ranks on it; the default is what
    the batch can fill, within 4 GiB and a quarter of the free memory; a budget larger than
    the free memory is refused before any rank allocates."""
    from tokenmill.platforms import cpu

    platform = CpuPlatform(torch.device("cpu"))
    assert cpu.available_memory() > 0  # (this machine's)
    monkeypatch.setattr(cpu, "available_memory", lambda: 64 * 2**30)
    assert platform.kv_budget_bytes(3.0, 0.9, ranks_here=3) == 2**30
    assert platform.kv_budget_bytes(None, 0.9) == 4 * 2**30  # 4 GiB < 64 / 4
    assert platform.kv_budget_bytes(None, 0.9, ranks_here=2) == 2 * 2**30
    assert platform.kv_budget_bytes(None, 0.9, wanted=2**20) == 2**20  # the batch fills 1 MiB
    monkeypatch.setattr(cpu, "available_memory", lambda: 8 * 2**30)
    assert platform.kv_budget_bytes(None, 0.9, ranks_here=2) == 2**30  # 8 / 4, over 2 ranks
    platform.check_kv_budget(7.5)
    with pytest.raises(ValueError, match=r"^--kv-cache-memory 9 GiB does not fit: this machine "
                                         r"has 8.0 GiB free"):
        platform.check_kv_budget(9)


def test_an_out_of_tree_platform_plugs_in(monkeypatch):
    monkeypatch.setitem(_PLATFORMS, "meta", None)  # restored afterwards

    @register_platform
    class MetaPlatform(Platform):
        device_type = "meta"

        def default_dtype(self, hf_config):
            return torch.float16

        def attention_backend(self, choice):
            return TorchSDPABackend()

        def kv_budget_bytes(self, gib, utilization, profile=None, **_):
            return 2**20

    platform = get_platform(torch.device("meta"))
    assert isinstance(platform, MetaPlatform) and platform.default_dtype(None) == torch.float16


def test_gpu_budget_leaves_the_largest_steps_activations(monkeypatch):
    gib = 2**30
    state = {"allocated": 3 * gib, "peak": 3 * gib}

    def profile():  # the largest step: 1.5 GiB above the weights at its peak
        state["peak"] = state["allocated"] + int(1.5 * gib)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (76 * gib, 80 * gib))
    cuda = CudaPlatform(torch.device("cuda", 0))
    # 0.9 x 80 GiB, less 4 GiB in use, less the step's 1.5 GiB
    assert cuda.kv_budget_bytes(None, 0.9, profile) == int(72 * gib) - 4 * gib - int(1.5 * gib)
    assert cuda.kv_budget_bytes(None, 0.9) == int(72 * gib) - 4 * gib
    assert cuda.kv_budget_bytes(2.0, 0.9, profile) == 2 * gib  # an explicit size wins


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "qwen2_moe"])
def test_profiling_step_runs_and_leaves_the_cache_alone(tiny_models, arch):
    path, hf = tiny_models(arch)
    llm = LLM(path, kv_cache_memory_gib=0.01, max_num_batched_tokens=96)
    runner = llm.engine.core.runner
    caches = [layer.k_cache for layer in runner._layers]
    runner.profile_step(llm.engine.core.max_model_len)
    assert all(layer.k_cache is k for layer, k in zip(runner._layers, caches))
    prompt = list(range(10, 70))
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)


def test_graph_memory_is_measured_around_the_captures(tiny_models, monkeypatch, caplog):
    """What the captures keep (measured as the platform's reserved memory before and after
    them) is reported: it comes on top of the KV budget."""
    from tokenmill.worker import graph_capture

    held = {"bytes": 5 * 2**30}
    build = graph_capture.build

    def capture(runner, max_model_len):
        held["bytes"] += 3 * 2**29  # what a capture on a GPU would keep in its pool
        return build(runner, max_model_len)

    monkeypatch.setattr(graph_capture, "build", capture)
    monkeypatch.setattr(CpuPlatform, "reserved_bytes", lambda self: held["bytes"])
    path, _ = tiny_models("llama")
    with caplog.at_level(logging.INFO), LLM(path, kv_cache_memory_gib=0.01) as llm:
        assert llm.engine.core.runner.graph_bytes == 3 * 2**29
    assert "CUDA graphs hold 1.50 GiB beside the KV cache" in caplog.text


@pytest.mark.parametrize("capability,dtype,backend,refused", [
    ((8, 0), torch.float8_e4m3fn, "triton", True),  # A100: no float8 in Triton
    ((8, 9), torch.float8_e4m3fn, "triton", False),
    ((9, 0), torch.float8_e4m3fn, "triton", False),
    ((8, 0), torch.float8_e4m3fn, "torch", False),  # torch's casts convert anywhere
    ((8, 0), torch.bfloat16, "triton", False),
    ((8, 0), torch.int8, "triton", False)])
def test_float8_cache_on_cards_without_float8_in_triton_is_refused_by_name(
        monkeypatch, capability, dtype, backend, refused):
    pytest.importorskip("triton")
    from tokenmill.attention.triton.backend import TritonBackend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    platform = CudaPlatform(torch.device("cuda"))
    chosen = TritonBackend() if backend == "triton" else TorchSDPABackend()
    if not refused:
        platform.check_kv_cache(dtype, chosen)
        return
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 needs float8 .* this GPU is "
                                         r"8\.0\. .*--attention-backend torch"):
        platform.check_kv_cache(dtype, chosen)
