"""Models with state layers (Mamba-2, Qwen3-Next) beyond test_models.py's shared checks
(greedy, logprobs, chunked prefill and preemption, two ranks): seeded sampling the same
alone and batched (no state leaks between slots), refusals that name what is not built."""

import pytest
from helpers import STATE, hf_greedy, make_model

from tokenmill import LLM, SamplingParams

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


@pytest.mark.parametrize("engine,named", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                             "prompt_lookup_max": 3}}, "--speculative-config"),
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
