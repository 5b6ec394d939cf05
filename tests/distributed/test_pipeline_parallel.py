"""Pipeline parallel on the CPU (stages as processes; each hands its hidden states and residual
to the next, the last stage's logits come back to rank 0): the tokens of one rank and of
transformers, logprobs within 1e-4, alone and times tensor parallel."""

import os
import sys

import pytest
import torch
from helpers import hf_greedy, make_model

from tests.distributed.test_tensor_parallel import (
    MAX_TOKENS,
    PROMPTS,
    chosen_logprobs,
    generate,
    prompt_logprobs,
    worker_pids,
)
from tokenmill import LLM, SamplingParams
from tokenmill.config.server import build_server_config
from tokenmill.distributed.parallel_state import as_rank
from tokenmill.loading.checkpoint import load_hf_config, load_model


@pytest.mark.parametrize("arch,tp", [("llama", 1), ("llama3", 1), ("llama_linear", 1),
                                     ("mistral", 1), ("qwen2", 1), ("qwen3", 1), ("llama", 2),
                                     ("qwen3", 2)])
def test_stages_match_one_rank_and_transformers(tiny_models, arch, tp):
    path, hf = tiny_models(arch)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=2, prompt_logprobs=1)
    one = generate(path, PROMPTS, params)
    staged = generate(path, PROMPTS, params, tensor_parallel_size=tp, pipeline_parallel_size=2)
    for prompt, a, b in zip(PROMPTS, one, staged):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
        assert max(abs(x - y) for x, y in zip(chosen_logprobs(a), chosen_logprobs(b))) < 1e-4
        assert max(abs(x - y) for x, y in zip(prompt_logprobs(a), prompt_logprobs(b))) < 1e-4
    assert not worker_pids()


def test_stages_hold_their_layers_only_and_match_under_preemption(tiny_models):
    path, _ = tiny_models("llama")
    shared = list(range(20, 84))
    prompts = [shared + [i, i + 1, i + 2] for i in range(100, 112)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = {"max_num_batched_tokens": 16, "num_kv_blocks": 16}
    one = generate(path, prompts, params, **engine)
    with LLM(path, pipeline_parallel_size=2, **engine) as llm:
        core = llm.engine.core
        model = core.runner.model
        assert len(model.attention_layers()) == 1  # of the tiny model's 2 layers
        assert {n.split(".")[2] for n, _ in model.named_parameters()
                if n.startswith("model.layers.")} == {"0"}
        in_flight, victims_in_flight = watch_micro_batches(core)
        staged = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False)
        stats = core.stats()
        assert not core.runner.in_step and not core.batch_queue
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    # two micro-batches were in flight, and requests were preempted while theirs was
    assert max(in_flight) == 2 and victims_in_flight
    assert [o.outputs[0].token_ids for o in staged] == [o.outputs[0].token_ids for o in one]


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_on_the_first_stage_lm_head_on_the_last(tmp_path, tied):
    """Each stage holds the vocabulary tables it uses: the embedding on the first, the LM
    head on the last (a tied table on both ends, as one tensor there), none in between;
    with draft heads the first stage holds the LM head too."""
    path = str(tmp_path / "llama4")
    hf = make_model(path, "llama", num_hidden_layers=4, tie_word_embeddings=tied)
    config = load_hf_config(path)

    def tables(rank, pp, **options):
        with as_rank(rank, 1, pp):
            model = load_model(path, config, torch.float32, torch.device("cpu"), 64,
                               float_weights=True, **options)  # (float weights: countable)
        held = {name for name, part in (("embed", model.model.embed_tokens),
                                        ("head", model.lm_head)) if part is not None}
        weights = sum(p.numel() for p in model.parameters())  # (a shared tensor counted once)
        vocab = hf.config.vocab_size * hf.config.hidden_size
        layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
        copies = min(len(held), 1) if tied else len(held)
        assert weights - layers == vocab * copies + hf.config.hidden_size  # (+ final norm)
        return held

    embed, head = {"embed"}, {"head"}
    assert tables(0, 3) == (embed | head if tied else embed)
    assert tables(1, 3) == set()
    assert tables(2, 3) == (embed | head if tied else head)
    assert tables(0, 2, head_on_first_stage=True) == embed | head
    assert tables(0, 1) == embed | head  # (one stage: both)


def test_stage_memory_bench_counts_the_whole_model_once():
    """bench/stage_memory.py's stages (meta tensors) add up to the model's parameters: every
    layer on one stage, each vocabulary table once (Llama-3-70B: 70.55 B)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import stage_memory

    shape = stage_memory.SHAPES["llama3-70b"]
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], 80
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter + 2 * hidden
    whole = layers * per_layer + 2 * shape["vocab_size"] * hidden + hidden
    for pp in (1, 4):
        stages = stage_memory.stage_params("llama3-70b", pp)
        assert sum(s["layers"] for s in stages) == layers
        assert abs(sum(s["params_b"] for s in stages) - whole / 1e9) < 0.002 * pp


def watch_micro_batches(core):
    """Record the micro-batches in flight after each launch, and the preempted requests
    whose micro-batch was still in flight (nothing left to compute until it lands)."""
    in_flight, victims = [0], []
    launch, preempt = core.runner.launch, core.scheduler._preempt

    def launched(step):
        result = launch(step)
        in_flight.append(core.runner.in_flight)
        return result

    def preempted(request):
        if request.num_computed_tokens == request.num_tokens:
            victims.append(request.request_id)
        preempt(request)
    core.runner.launch, core.scheduler._preempt = launched, preempted
    return in_flight, victims


def test_micro_batches_keep_seeded_sampling_stops_and_aborts(tiny_models):
    """Per-request seeds, n > 1, stop tokens and a request aborted while its micro-batch is
    in flight: the same results as one rank."""
    path, _ = tiny_models("qwen3")
    prompts = [[5, 17, 99, 200, 3, 45, 67 + i] for i in range(6)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12, n=2,
                             stop_token_ids=[7]) for i in range(6)]
    one = generate(path, prompts, params)
    with LLM(path, kv_cache_memory_gib=0.01, pipeline_parallel_size=2) as llm:
        engine = llm.engine
        doomed = engine.add_request(None, {"prompt_token_ids": list(range(40, 80))},
                                    SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()  # launched: in flight
        assert engine.core.runner.in_flight == 1
        engine.abort_request([doomed])
        staged = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False)
        assert not engine.has_unfinished_requests() and not engine.core.runner.in_step
    got = [[c.token_ids for c in o.outputs] for o in staged]
    assert got == [[c.token_ids for c in o.outputs] for o in one]


def test_more_stages_than_layers_is_named(tiny_models):
    path, _ = tiny_models("llama")  # 2 layers
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 exceeds the model's 2 "
                                         "layers"):
        LLM(path, kv_cache_memory_gib=0.01, pipeline_parallel_size=3)
    assert not worker_pids()


def test_mp_num_counts_every_rank():
    engine = build_server_config(["--pipeline-parallel-size", "2"], {"MP_NUM": "4"}).engine
    assert (engine.tensor_parallel_size, engine.pipeline_parallel_size) == (2, 2)
