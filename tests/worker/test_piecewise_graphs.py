"""Piecewise CUDA graphs (worker/piecewise_graphs.py): the steps the decode buckets do not take
(prompt chunks, prompts beside decodes) in buckets of token rows, the forward in pieces
between attention calls. Without a GPU the buckets, padding and attention calls run eagerly
(the Triton kernels in the interpreter), and the capture's order is checked with stand-in
graphs."""

import pytest
import torch
from helpers import hf_greedy

from tokenmill import LLM, SamplingParams
from tokenmill.config.kernels import GpuKernelSettings
from tokenmill.worker.piecewise_graphs import (
    SIZES,
    AttentionCall,
    PiecewiseGraphs,
    alias,
    piece_sizes,
)

# a long prompt (chunked at the 24-token budget, its chunks beside the others' decodes),
# short ones
PROMPTS = [list(range(10, 70)), [5, 17, 99, 200, 3, 45, 67], [7, 8], list(range(300, 320))]


def test_piece_sizes():
    assert piece_sizes(2048) == list(SIZES)
    assert piece_sizes(100) == [8, 16, 24, 32, 48, 64, 96, 100]
    assert piece_sizes(8) == [8] and piece_sizes(5) == [5]
    assert piece_sizes(8192)[-1] == 2048  # (larger steps run eagerly)


def uses(x: torch.Tensor) -> int:
    """How many tensors hold x's memory."""
    return torch._C._storage_Use_Count(x.untyped_storage()._cdata)


def test_an_alias_shares_memory_without_holding_it():
    x = torch.arange(24.0).view(4, 6)[1:, 2:5]
    held = uses(x)
    y = alias(x)
    assert (y.shape, y.stride(), y.data_ptr()) == (x.shape, x.stride(), x.data_ptr())
    x.add_(100)
    assert torch.equal(y, x)
    y.mul_(-1)
    assert torch.equal(y, x)
    assert uses(x) == held  # (a view, x[1:], would count one more)


def engine(path, monkeypatch, **kw) -> LLM:
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    return LLM(path, kv_cache_memory_gib=0.02, attention_backend="triton", max_num_seqs=4,
               max_num_batched_tokens=24, **kw)


def record_runs(monkeypatch, pieces: PiecewiseGraphs, runs: list) -> None:
    """Log (rows, bucket, decodes, attention calls) of every step the pieces run (eagerly
    here; replayed on a GPU)."""
    run, calls = pieces.run, []
    call_run = AttentionCall.run
    monkeypatch.setattr(AttentionCall, "run", lambda self, meta, t: calls.append(t) or
                        call_run(self, meta, t))

    def logged(ids, positions, meta):
        calls.clear()
        hidden = run(ids, positions, meta)
        assert set(calls) == {len(ids)}  # (each call over the step's rows, not the bucket's)
        runs.append((len(ids), pieces.bucket(len(ids)), meta.num_decodes, len(calls)))
        return hidden

    monkeypatch.setattr(pieces, "run", logged)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "deepseek_v3"])
def test_prompt_and_mixed_steps_in_pieces_match_transformers(tiny_models, monkeypatch, arch):
    # qwen3: q/k norms; gemma2: soft-capping and an 8-token window; deepseek: latent attention
    # and experts, fused as on a GPU (the CPU's per-expert loop waits on the host)
    if arch == "deepseek_v3":
        from tokenmill.layers.linear import CpuPackedKernel
        from tokenmill.layers.moe import SparseMoE

        fuse = SparseMoE.fuse_experts
        monkeypatch.setattr(SparseMoE, "fuse_experts", lambda self: fuse(self, force=True))
        monkeypatch.setattr(CpuPackedKernel, "supports", staticmethod(lambda layer: False))
    path, hf = tiny_models(arch)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 4, 5)]
    with engine(path, monkeypatch) as llm:
        runner = llm.engine.core.runner
        pieces = runner.pieces
        assert pieces is not None and pieces.sizes == [8, 16, 24]
        runs = []
        record_runs(monkeypatch, pieces, runs)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf, p, n) for p, n in zip(PROMPTS, (6, 9, 4, 5))]
    layers = hf.config.num_hidden_layers
    assert all(calls == layers for *_, calls in runs)  # one piece boundary per layer
    assert any(t < size for t, size, *_ in runs)  # padded
    assert any(0 < decodes < t for t, _, decodes, _ in runs)  # prompt rows beside decodes
    assert (24, 24, 0, layers) in runs  # a full budget of prompt rows


def test_prefix_hits_preemption_and_prompt_logprobs_in_pieces(tiny_models, monkeypatch):
    path, hf = tiny_models("llama")
    shared = list(range(100, 124))  # three blocks
    with_prefix = [shared + PROMPTS[1], shared + PROMPTS[2]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with engine(path, monkeypatch, block_size=8, num_kv_blocks=12) as llm:
        runs = []
        record_runs(monkeypatch, llm.engine.core.runner.pieces, runs)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0 and runs
        first = llm.generate([{"prompt_token_ids": with_prefix[0]}], greedy, use_tqdm=False)
        both = llm.generate([{"prompt_token_ids": p} for p in with_prefix], greedy,
                            use_tqdm=False)
        assert core.kv_cache.num_hit_tokens >= 24
        core.kv_cache.pool.check_integrity()
        scored = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(
            temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in both] == [first[0].outputs[0].token_ids,
                                                       hf_greedy(hf, with_prefix[1], 8)]
    with torch.no_grad():  # every prompt row's state read: transformers' log-softmax
        logits = hf(torch.tensor([PROMPTS[1]])).logits[0].float().log_softmax(-1)
    got = [next(iter(entry.values())).logprob for entry in scored.prompt_logprobs[1:]]
    want = [logits[i, tok].item() for i, tok in enumerate(PROMPTS[1][1:])]
    assert got == pytest.approx(want, abs=1e-4)


class StandIn:
    """A graph that logs its capture and replays (its capture does not stop the ops)."""

    def __init__(self, log: list) -> None:
        self.log, self.index = log, sum(e[0] == "begin" for e in log)

    def capture_begin(self, pool=None):
        self.log.append(("begin", self.index, pool))

    def capture_end(self):
        self.log.append(("end", self.index))

    def replay(self):
        self.log.append(("replay", self.index))


def test_capture_cuts_a_piece_at_every_attention_call_and_replays_them_in_turn(
        tiny_models, monkeypatch):
    path, _ = tiny_models("llama")
    with engine(path, monkeypatch) as llm:
        pieces = llm.engine.core.runner.pieces
        layers = len(llm.engine.core.runner.model.attention_layers())
        log = []
        with torch.inference_mode():
            pieces.capture(16, pieces.padding_meta(16), "pool", lambda: StandIn(log))
        assert log == [e for i in range(layers + 1)
                       for e in (("begin", i, "pool"), ("end", i))]
        calls = pieces.captured[16].calls
        assert len(calls) == layers and len(pieces.captured[16].pieces) == layers + 1
        # (the calls' tensors are aliases now, their memory freed: on a GPU the pool's for
        # the next capture; here nothing reads them, the calls' runs stand in below)
        ran = []
        for i, call in enumerate(calls):
            monkeypatch.setattr(call, "run", lambda meta, t, i=i: ran.append(t) or log.append(
                ("attention", i)))
        log.clear()
        with torch.inference_mode():
            pieces.slot_mapping.fill_(5)
            ids = torch.arange(11)
            meta = pieces.padding_meta(11)
            meta.slot_mapping = ids + 40
            pieces.run(ids, ids, meta)
    assert log == [e for i in range(layers) for e in (("replay", i), ("attention", i))] + [
        ("replay", layers)]
    assert ran == [11] * layers
    # the step's slots, then padding rows written nowhere; the rows after the bucket untouched
    assert pieces.slot_mapping.tolist() == list(range(40, 51)) + [-1] * 5 + [5] * 8


def test_pieces_switched_off_by_their_variable(tiny_models, monkeypatch):
    path, _ = tiny_models("llama")
    monkeypatch.setenv("TOKENMILL_GPU_PIECEWISE_GRAPHS", "0")
    assert not GpuKernelSettings.from_env().piecewise_graphs
    with engine(path, monkeypatch) as llm:
        runner = llm.engine.core.runner
        assert runner.graphs is not None and runner.pieces is None
    monkeypatch.setenv("TOKENMILL_GPU_PIECEWISE_GRAPHS", "2")
    with pytest.raises(ValueError, match="TOKENMILL_GPU_PIECEWISE_GRAPHS must be 0 or 1"):
        GpuKernelSettings.from_env()
    monkeypatch.delenv("TOKENMILL_GPU_PIECEWISE_GRAPHS")
    with LLM(path, kv_cache_memory_gib=0.02, attention_backend="triton",
             enforce_eager=True) as eager:
        assert eager.engine.core.runner.pieces is None


def test_a_failed_capture_leaves_those_steps_eager(tiny_models, monkeypatch, caplog):
    from tokenmill.worker import piecewise_graphs

    def fail(*args, **kwargs):
        raise AttributeError("no such private torch function")

    monkeypatch.setattr(piecewise_graphs.PiecewiseGraphs, "__init__", fail)
    path, hf = tiny_models("llama")
    with engine(path, monkeypatch) as llm:
        runner = llm.engine.core.runner
        assert runner.graphs is not None and runner.pieces is None  # (decode graphs kept)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in PROMPTS[:2]]
    assert "Piecewise CUDA graph capture failed (AttributeError" in caplog.text
