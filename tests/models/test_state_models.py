"""Models with state layers (Mamba-2, Qwen3-Next) beyond test_models.py's shared checks
(greedy, logprobs, chunked prefill and preemption, two ranks): seeded sampling the same
alone and batched (no state leaks between slots), n-gram speculation equal to decoding
without it, refusals that name what is not built."""

import itertools

import pytest
from helpers import STATE, hf_greedy, make_model

from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.proposer import Proposer

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8], list(range(300, 333))]


@pytest.mark.parametrize("arch", STATE)
def test_seeded_sampling_is_the_same_alone_batched_and_in_chunks(tiny_models, arch):
    path, _ = tiny_models(arch)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=10,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        alone = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
                 .outputs[0].token_ids for p, sp in zip(PROMPTS, params)]
        batched = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    with LLM(path, kv_cache_memory_gib=0.01, max_num_batched_tokens=8, max_num_seqs=2) as llm:
        chunked = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert batched == alone and chunked == alone
    assert len({tuple(t) for t in alone}) == len(PROMPTS)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


class OracleProposer(Proposer):
    """Drafts from the known greedy outputs, one of each request's k + 1 turns wrong at the
    draft its turn names (k: none), so that verifications accept every count 0..k and the
    next step reads every row of a slot. (Random tiny state models repeat nothing n-gram
    lookup would find.)"""

    def __init__(self, proposer: Proposer, expected: dict[tuple, list[int]]) -> None:
        super().__init__(proposer.config, proposer.max_model_len)
        self.expected, self.turns, self.accepts = expected, itertools.count(), set()

    def draft(self, chosen) -> None:
        for request, k in chosen:
            done = len(request.output_token_ids)
            drafts = self.expected[tuple(request.prompt_token_ids)][done:done + k]
            wrong = next(self.turns) % (k + 1)
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % 500
            self.accepts.add(min(wrong, len(drafts)))
            request.spec_token_ids = drafts


@pytest.mark.parametrize("arch", STATE)
def test_speculation_equals_greedy_with_chunks_and_preemption(tiny_models, arch):
    """A verified sequence keeps its state after each draft row and the next step reads the
    one after the last accepted draft: outputs equal decoding without speculation, whether
    drafts are looked up (n-gram: all rejected here) or given right up to a chosen draft;
    the same in 5-token steps and in a cache that preempts."""
    path, _ = tiny_models(arch)
    prompts = [[11, 250, 37, 400, 90, 5] * 4, list(range(30, 60)) * 2, [3, 4],
               list(range(300, 333))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(oracle=None, **engine):
        with LLM(path, **engine) as llm:
            core = llm.engine.core
            if oracle is not None:
                core.proposer = OracleProposer(core.proposer, oracle)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            run.counts = (core.scheduler.num_draft_tokens, core.scheduler.num_accepted_tokens,
                          core.scheduler.num_preemptions)
            assert core.kv_cache.states.num_free == core.kv_cache.states.num_slots
            if oracle is not None:  # (every count of accepted drafts, none to all)
                assert core.proposer.accepts == set(range(NGRAM["num_speculative_tokens"] + 1))
        return [list(o.outputs[0].token_ids) for o in outs]

    base = run(kv_cache_memory_gib=0.01)
    assert run(kv_cache_memory_gib=0.01, speculative_config=NGRAM) == base
    assert run.counts[0] > 0
    oracle = {tuple(p): out for p, out in zip(prompts, base)}
    assert run(oracle, kv_cache_memory_gib=0.01, speculative_config=NGRAM) == base
    drafts, accepted, _ = run.counts
    assert drafts > accepted > 0
    assert run(oracle, kv_cache_memory_gib=0.01, speculative_config=NGRAM,
               max_num_batched_tokens=5) == base
    assert run(oracle, num_kv_blocks=12, block_size=8, speculative_config=NGRAM) == base
    assert run.counts[2] > 0  # (preempted: recomputed from zeros in a slot)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}])
def test_speculation_under_tensor_and_pipeline_parallel(tiny_models, layout):
    """Each rank reads the rows the step names (StepInputs.state_rows travel with it)."""
    path, _ = tiny_models("qwen3_next")
    prompts = [[11, 250, 37, 400, 90, 5] * 2, [3, 4]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        base = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    with LLM(path, kv_cache_memory_gib=0.01, speculative_config=NGRAM, **layout) as llm:
        core = llm.engine.core
        core.proposer = OracleProposer(core.proposer, dict(zip(map(tuple, prompts), base)))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        assert core.proposer.accepts == {0, 1, 2, 3}
    assert [list(o.outputs[0].token_ids) for o in outs] == base


def test_seeded_sampling_with_drafts_reproduces_on_a_state_model(tiny_models):
    """Drafts from the greedy outputs, sampled at a low temperature (most accepted, not
    all): two runs draw the same tokens."""
    path, _ = tiny_models("qwen3_next")
    prompts = [[5, 6, 7] * 5, list(range(40, 52))]
    runs = []
    for spec, temperature in ((None, 0), (NGRAM, 0.1), (NGRAM, 0.1)):
        with LLM(path, kv_cache_memory_gib=0.01, speculative_config=spec) as llm:
            if spec:
                llm.engine.core.proposer = OracleProposer(llm.engine.core.proposer, dict(
                    zip(map(tuple, prompts), runs[0])))
            runs.append([list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], SamplingParams(
                    temperature=temperature, max_tokens=16, seed=7, ignore_eos=True),
                use_tqdm=False)])
            sched = llm.engine.core.scheduler
            assert not spec or sched.num_draft_tokens > sched.num_accepted_tokens > 0
    assert runs[1] == runs[2]


@pytest.mark.parametrize("engine,named", [
    ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2,
                             "quantization": "int8"}}, "A draft model with state layers"),
    ({"enable_lora": True}, "--enable-lora"),
    ({"tensor_parallel_size": 4}, "state layers: num_heads 8, n_groups 2"),
])
def test_what_state_layers_do_not_take_is_refused_by_name(tiny_models, engine, named):
    path, _ = tiny_models("mamba2")
    with pytest.raises(ValueError, match=named):
        LLM(path, kv_cache_memory_gib=0.01, **engine)


def test_mamba2_serves_past_the_default_context(tiny_models):
    """No positions: a --max-model-len past 2048 is taken (a Llama's is refused past its
    max_position_embeddings), and a prompt longer than 2048 runs in chunks."""
    path, hf = tiny_models("mamba2")
    prompt = [5 + i % 400 for i in range(2100)]
    with LLM(path, kv_cache_memory_gib=0.01, max_model_len=4096,
             max_num_batched_tokens=1024) as llm:
        (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 3)


def test_a_pipeline_stage_without_state_layers_agrees_on_the_slots(tmp_path):
    """Qwen3-Next's layers as DeltaNet, DeltaNet, attention, attention over two stages: the
    second holds no state layer, and the first's slots are still handed out."""
    path = str(tmp_path / "m")
    hf = make_model(path, "qwen3_next", layer_types=["linear_attention"] * 2
                    + ["full_attention"] * 2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01, pipeline_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert llm.engine.core.kv_cache.states is not None
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in PROMPTS]
