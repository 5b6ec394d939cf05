"""Tensor parallel on the CPU (gloo, ranks as processes on loopback): two ranks give the
tokens one rank and transformers give, logprobs within 1e-4, for every architecture and
through chunked prefill, prefix hits, preemption and quantization; failures are named."""

import os
import signal

import psutil
import pytest
import torch
from helpers import BIASED, hf_greedy, make_model, write_calibration

from tests.distributed.checks import worker_ranks
from tests.serving import alive, wait_until
from tests.worker.test_async_scheduling import overlapped, record_steps
from tokenmill import LLM, SamplingParams, csrc
from tokenmill.distributed.parallel_state import get_world, init_parallel
from tokenmill.entrypoints.cli import main as cli

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8], list(range(300, 333))]
MAX_TOKENS = 10


def generate(path, prompts, params, **engine):
    with LLM(path, kv_cache_memory_gib=0.01, **engine) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def worker_pids() -> list[int]:
    return [p.pid for p in worker_ranks()]


def chosen_logprobs(out) -> list[float]:
    c = out.outputs[0]
    return [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


def prompt_logprobs(out) -> list[float]:
    return [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:],
                                                out.prompt_token_ids[1:])]


@pytest.mark.parametrize("arch", ["llama", "llama3", "llama_linear", "mistral", "qwen2", "qwen3",
                                  "phi3", "mixtral", *BIASED])
def test_two_ranks_match_one_rank_and_transformers(tiny_models, arch):
    path, hf = tiny_models(arch)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=2, prompt_logprobs=1)
    one = generate(path, PROMPTS, params)
    two = generate(path, PROMPTS, params, tensor_parallel_size=2)
    for prompt, a, b in zip(PROMPTS, one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
        assert max(abs(x - y) for x, y in zip(chosen_logprobs(a), chosen_logprobs(b))) < 1e-4
        assert max(abs(x - y) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))) < 1e-4
    assert not worker_pids()  # the `with` block stopped them


@pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")
@pytest.mark.parametrize("compiled_step", [True, False])
@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_decode_steps_compiled_or_layer_by_layer_match_one_rank(tiny_models, monkeypatch,
                                                                compiled_step, layout):
    """Decode steps of two ranks run the compiled step (its all-reduces in C; a pipeline
    stage's from and to the hidden states and residual it hands on) or the Python layers;
    both give one rank's tokens."""
    if not compiled_step:
        monkeypatch.setenv("TOKENMILL_CPU_DECODE_STEP", "0")  # read by the workers' config too
    path, hf = tiny_models("qwen3")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01) as one:
        one_rank_blocks = one.engine.core.runner.num_blocks
    with LLM(path, kv_cache_memory_gib=0.01, **{layout: 2}) as llm:
        assert (llm.engine.core.runner.decode_step is not None) == compiled_step
        # The budget is the machine's: two ranks, each holding half of every block, share it
        # and hold as many blocks as one rank did (not twice the memory).
        assert llm.engine.core.runner.num_blocks == one_rank_blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                            use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)


def test_fewer_kv_heads_than_ranks_replicates_them(tmp_path):
    path = str(tmp_path / "mqa")
    hf = make_model(path, "llama", num_key_value_heads=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = generate(path, PROMPTS[:2], params, tensor_parallel_size=2)
    for prompt, out in zip(PROMPTS[:2], outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)


def test_chunked_prefill_prefix_hits_and_preemption_match_one_rank(tiny_models):
    path, _ = tiny_models("llama")
    shared = list(range(20, 84))  # four full blocks every prompt shares
    prompts = [shared + [i, i + 1, i + 2] for i in range(100, 112)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # 16-token chunks; 16 blocks cannot hold 12 sequences of 3 blocks of their own each
    # beside the 4 they share: preemption.
    engine = {"max_num_batched_tokens": 16, "num_kv_blocks": 16}
    one = generate(path, prompts, params, **engine)
    with LLM(path, tensor_parallel_size=2, **engine) as llm:
        two = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_asynchronous_scheduling_on_two_ranks_matches_one_rank(tiny_models, monkeypatch):
    # the next step launched before the last one's tokens reach the host: rank 0 fills them
    # in on the device and every rank takes its input ids from there. Greedy and seeded
    # sampling, different lengths (requests finishing while others run ahead), a stop
    # string (a request that needs its text on the host runs one step at a time), and
    # chunked prefill with preemption
    path, _ = tiny_models("qwen2")
    prompts = [[5, 17, 99, 200, 3], list(range(10, 70)), [7, 8], list(range(300, 333))]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=7,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["zz"]),
              SamplingParams(temperature=0.7, seed=5, max_tokens=15, ignore_eos=True)]
    engine = {"max_num_batched_tokens": 32, "num_kv_blocks": 8}  # 8 blocks: a preemption

    def run(**more):
        with LLM(path, **engine, **more) as llm:
            log = record_steps(monkeypatch, llm.engine.core.runner)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            stats = llm.engine.core.stats()
            return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs], log, stats

    one, log, _ = run()
    assert overlapped(log) == 0
    two, log, stats = run(tensor_parallel_size=2, async_scheduling=True)
    assert overlapped(log) > 0  # steps launched before the last one's tokens were read
    assert stats.num_preemptions > 0
    assert two == one
    assert not worker_pids()


def test_step_bytes_travel_over_the_host_group_where_there_is_one():
    # on GPUs the step's inputs go over a gloo group of the host (no device sync); tensors
    # of the step (input ids) over the device's group
    from tokenmill.distributed.parallel_state import TensorParallelGroup

    class Done:
        def wait(self):
            return True

    class Group:  # a stand-in for rank 0's peer: what it would send is rank 0's data
        def __init__(self, name, log, sent=None):
            self.name, self.log, self.sent = name, log, sent

        def broadcast(self, x, root):
            self.log.append((self.name, x.device.type, tuple(x.shape)))
            if self.sent is None:  # (on rank 0, the root: its own tensors stay)
                pass
            elif x.numel() == 1 and x.dtype == torch.int64:
                x.fill_(len(self.sent))
            elif x.dtype == torch.uint8:
                x.copy_(torch.frombuffer(bytearray(self.sent), dtype=torch.uint8))
            return Done()

    log = []
    receiver = TensorParallelGroup(1, 2, Group("device", log), torch.device("cpu"),
                                   host=Group("host", log, b"step"))
    assert receiver.broadcast_bytes(None) == b"step"
    assert log == [("host", "cpu", (1,)), ("host", "cpu", (4,))]
    log.clear()
    receiver.broadcast(torch.zeros(3, dtype=torch.int64))
    assert log == [("device", "cpu", (3,))]
    log.clear()
    plain = TensorParallelGroup(0, 2, Group("device", log), torch.device("cpu"))
    assert plain.broadcast_bytes(b"xy") == b"xy"
    assert [name for name, *_ in log] == ["device", "device"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_two_ranks_match_quantized_one_rank(tiny_models, method):
    path, _ = tiny_models("llama")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    one = generate(path, PROMPTS, params, quantization=method)
    two = generate(path, PROMPTS, params, quantization=method, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


@pytest.mark.parametrize("method,extra", [
    ("int8", []), ("int8", ["--group-size", "32"]), ("int4", []),
    ("int4", ["--group-size", "64"]),  # o_proj: each rank's 32 inputs inside one group
    ("a8w8", ["--activation", "static", "--calib-data", "CALIB"]),
    ("fp8", ["--per-tensor", "--activation", "static", "--calib-data", "CALIB"])])
def test_a_stored_quantized_checkpoint_splits_across_ranks(tiny_models, tmp_path, method,
                                                           extra):
    """A `tokenmill quantize` checkpoint: each rank cuts its rows, columns and whole groups
    from the stored tensors (merged q|k|v and gate|up per projection): one rank's tokens.
    (Activations quantized per call see a rank's inputs only, so a8w8 / fp8 are compared
    with calibrated scales, which every rank shares.)"""
    path, _ = tiny_models("qwen2")  # q|k|v biases
    out = str(tmp_path / method)
    extra = [write_calibration(tmp_path) if a == "CALIB" else a for a in extra]
    assert cli(["quantize", "--model", path, "--out", out, "--method", method, *extra]) == 0
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    one = generate(out, PROMPTS, params)
    two = generate(out, PROMPTS, params, tensor_parallel_size=2)
    for a, b in zip(one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        # (the int8 kernels that quantize activations do it over a rank's inputs)
        assert max(abs(x - y) for x, y in zip(chosen_logprobs(a), chosen_logprobs(b))) < 1e-3


def test_rank_part_cuts_whole_groups_and_names_a_split_one():
    """Stored int4 tensors of a row-parallel layer (K = 192, groups of 32 or 96) cut for
    rank 1 of 2 equal dequantizing the whole weight and cutting that; groups of 64 would
    split at input 96: named."""
    from tokenmill.quantization.linear_kernels import Int4Kernel
    from tokenmill.quantization.model import rank_part

    class Rank1:  # a row-parallel layer's view of the checkpoint: inputs [96, 192)
        in_features, tp = 96, type("TP", (), {"size": 2})()

        def checkpoint_slice(self, shard=None):
            return (1, 96, 96)

    weight = torch.randn(8, 192, generator=torch.Generator().manual_seed(0))
    for group in (32, 96):
        whole = Int4Kernel.from_weight(weight, group)
        part = rank_part(Rank1(), dict(whole.tensors))
        assert torch.equal(Int4Kernel(part).dequantize(), whole.dequantize()[:, 96:])
    with pytest.raises(ValueError, match="groups of 64 inputs do not split into 2 parts of 96"):
        rank_part(Rank1(), dict(Int4Kernel.from_weight(weight, 64).tensors))


def test_a_size_that_does_not_divide_the_heads_is_named(tiny_models):
    path, _ = tiny_models("llama")  # 4 attention heads
    with pytest.raises(ValueError, match=r"tensor parallel size 3 \(--tensor-parallel-size / "
                                         r"MP_NUM\) must divide the model's attention heads"):
        LLM(path, kv_cache_memory_gib=0.01, tensor_parallel_size=3)
    assert not worker_pids()


def test_ranks_listen_on_loopback_only(tiny_models):
    path, _ = tiny_models("llama")
    with LLM(path, kv_cache_memory_gib=0.01, tensor_parallel_size=2):
        pids = [os.getpid(), *worker_pids()]
        assert len(pids) == 2
        listening = [c.laddr.ip for pid in pids
                     for c in psutil.Process(pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
    assert listening and all(ip == "127.0.0.1" for ip in listening), listening


def test_a_dead_worker_fails_the_next_step_instead_of_hanging(tiny_models):
    path, _ = tiny_models("llama")
    llm = LLM(path, kv_cache_memory_gib=0.01, tensor_parallel_size=2)
    try:
        (pid,) = worker_pids()
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not alive(pid), 30)  # (not reaped: rank 0 reads its code)
        with pytest.raises(RuntimeError, match=r"worker died: rank 1 exited with code -9"):
            llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not worker_pids()


def test_a_rank_that_never_joins_is_named_after_the_timeout(tmp_path):
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not join within 0.5 s"):
        init_parallel(0, 2, f"file://{tmp_path}/rendezvous", 0.5)
    assert get_world().size == 1 and not torch.distributed.is_initialized()


@pytest.mark.skipif(not csrc.available(), reason="no compiled CPU kernels")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_gguf_blocks_split_across_ranks_as_they_are(tiny_models, tmp_path, qtype):
    """Each rank keeps its rows or whole blocks of the GGUF weights (no float copy): the
    same tokens as one rank, half the weight bytes per rank."""
    from gguf import GGMLQuantizationType

    from tokenmill.convert.gguf_writer import write_gguf
    from tokenmill.loading import gguf as gguf_loader
    from tokenmill.quantization.model import weight_bytes

    hf_path, hf = tiny_models("llama")
    path = str(tmp_path / f"{qtype}.gguf")
    write_gguf(path, "llama", hf.state_dict(), hf.config, GGMLQuantizationType[qtype])
    gguf_loader._reader.cache_clear()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results, sizes = {}, {}
    for tp in (1, 2):
        with LLM(path, tokenizer=hf_path, kv_cache_memory_gib=0.01,
                 tensor_parallel_size=tp) as llm:
            model = llm.engine.core.runner.model
            kernels = {m.kernel.name.split("-")[0] for m in model.modules()
                       if hasattr(m, "kernel") and m is not model.lm_head}
            assert kernels == {"int8" if qtype == "Q8_0" else "int4"}
            layer = model.model.layers[0]
            sizes[tp] = sum(weight_bytes(m) for m in (layer.self_attn, layer.mlp))
            results[tp] = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert results[2] == results[1]
    assert sizes[2] * 2 == sizes[1]


def test_each_rank_of_a_node_gets_its_own_gpu(monkeypatch):
    """No GPU needed: the device each rank would take, and the error when a node has too few."""
    import torch

    from tokenmill.platforms import resolve_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [resolve_device("cuda", r, 4) for r in range(8)] == [
        torch.device("cuda", i % 4) for i in range(8)]  # two nodes of four ranks
    assert resolve_device("cuda:2", 1, 2) == torch.device("cuda", 2)  # pinned by the user
    assert resolve_device("cpu", 3, 4) == torch.device("cpu")
    with pytest.raises(ValueError, match="8 parallel ranks per node need as many GPUs; 4 visible"):
        resolve_device("cuda", 0, 8)
