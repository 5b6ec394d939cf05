"""CUDA graphs under tensor parallel, checked on the CPU: every rank runs the graphs' buckets
(TOKENMILL_CPU_GRAPH_BUCKETS=1: eagerly, no capture; the Triton kernels in the interpreter),
so decode steps run padded to their bucket and other steps in the pieces' buckets with the
attention calls between them, the ranks' all-reduces over the bucket's rows. Rank 0 and the
worker rank must take the same path every step, or their collectives would not pair up;
the tokens equal transformers' greedy ones, also with asynchronous scheduling (rank 0 fills
the tokens still on its device into the graphs' input ids and the other rank takes them
from there) and beside a draft head. The ranks agree before each capture and after it."""

import pytest
from helpers import hf_greedy

from tests.distributed.checks import worker_ranks
from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]
LENGTHS = (10, 6, 8)  # (requests finishing at different steps: buckets of 4, 2 and 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_two_ranks_in_graph_buckets_match_transformers(tiny_models, monkeypatch,
                                                       async_scheduling):
    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")  # (the worker rank reads it too)
    path, hf = tiny_models("qwen2")
    with LLM(path, kv_cache_memory_gib=0.02, attention_backend="triton", max_num_seqs=4,
             max_num_batched_tokens=24, tensor_parallel_size=2,
             async_scheduling=async_scheduling) as llm:
        runner = llm.engine.core.runner
        assert runner.graphs is not None and runner.pieces is not None
        assert runner.heads is None
        ran = []
        for name in ("graphs", "pieces"):
            part = getattr(runner, name)
            monkeypatch.setattr(part, "run", lambda *a, run=part.run, name=name, **k: (
                ran.append(name), run(*a, **k))[1])
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                             for n in LENGTHS], use_tqdm=False)
    # the 60-token prompt in chunks through the pieces, beside decodes; then decode buckets
    assert ran.count("pieces") >= 3 and ran.count("graphs") >= 6
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert not worker_ranks()


def test_two_ranks_with_a_draft_head_in_graph_buckets(tiny_models, monkeypatch, tmp_path):
    """An EAGLE head under tensor parallel: every rank's target steps in the buckets, those
    whose sequences carry their 2 drafts each in their own (3 rows a sequence), the head's
    passes eagerly (the worker rank follows rank 0's passes message by message); greedy
    outputs equal transformers'."""
    from tests.spec_decode.test_spec_decode_eagle import make_eagle

    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    path, hf = tiny_models("llama")
    eagle = str(tmp_path / "eagle")
    make_eagle(path, eagle)
    spec = {"method": "eagle", "model": eagle, "num_speculative_tokens": 2,
            "disable_by_batch_size": 2}
    prompts, lengths = [*PROMPTS, [11, 12, 13, 14]], (12, 9, 4, 3)
    with LLM(path, kv_cache_memory_gib=0.02, attention_backend="triton", max_num_seqs=4,
             speculative_config=spec, tensor_parallel_size=2) as llm:
        runner = llm.engine.core.runner
        assert runner.graphs.widths == {1: [1, 2, 4], 3: [1, 2]} and runner.heads.graphs is None
        runs = []
        monkeypatch.setattr(runner.graphs, "run", lambda inputs, fill=None, run=runner.graphs.run:
                            runs.append((len(inputs.starts), inputs.uniform_rows))
                            or run(inputs, fill))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                             for n in lengths], use_tqdm=False)
    assert (2, 3) in runs and (4, 1) in runs  # drafted and plain decode buckets
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]


class OtherRank:
    """Rank 0's tensor-parallel group beside another rank that votes `theirs`, in order: the
    MIN all-reduce of each flag `build` asks about (rank 0's votes are logged)."""

    rank, size = 0, 2

    def __init__(self, theirs: list[int]) -> None:
        self.theirs, self.votes = iter(theirs), []

    def all_reduce_min(self, value: int) -> int:
        self.votes.append(value)
        return min(value, next(self.theirs))


@pytest.mark.parametrize("theirs,kept", [
    ([0], (False, False)),  # the other rank cannot capture (say, its model waits on the host)
    ([1, 0], (False, False)),  # its decode-graph capture failed
    ([1, 1, 0], (True, False)),  # its environment turns the pieces off
    ([1, 1, 1, 0], (True, False)),  # its pieces' capture failed
    ([1, 1, 1, 1], (True, True))])
def test_the_ranks_capture_and_keep_graphs_only_all_together(tiny_models, monkeypatch,
                                                             theirs, kept):
    """Each rank asks the others before it captures (so that every rank captures, its
    collectives pairing with the others', or none does) and after (every rank keeps what
    it captured, or none does)."""
    from tokenmill.worker import cuda_graphs, graph_capture, piecewise_graphs

    monkeypatch.setenv("TOKENMILL_CPU_GRAPH_BUCKETS", "1")
    path, _ = tiny_models("qwen2")
    with LLM(path, kv_cache_memory_gib=0.02, attention_backend="triton", max_num_seqs=4,
             max_num_batched_tokens=24) as llm:
        runner = llm.engine.core.runner
        built = []
        for cls in (cuda_graphs.DecodeGraphs, piecewise_graphs.PiecewiseGraphs):
            monkeypatch.setattr(cls, "__init__", lambda self, *a, init=cls.__init__, **k: (
                built.append(type(self).__name__), init(self, *a, **k))[1])
        monkeypatch.setattr(runner, "tp", OtherRank(theirs))
        graphs, pieces = graph_capture.build(runner, llm.engine.core.max_model_len)
    assert (graphs is not None, pieces is not None) == kept
    assert runner.tp.votes == [1] * len(theirs)  # (rank 0 could, and did, capture each)
    # a capture only where every rank would make it
    assert built == ["DecodeGraphs", "PiecewiseGraphs"][:len(theirs) // 2]
