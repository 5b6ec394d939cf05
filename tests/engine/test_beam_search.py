"""Beam search token-identical to transformers' `generate(num_beams=...)` on tiny random
models: beams that run to max_tokens, beams that end on EOS (an EOS id the random model
actually likes, so the finished-set and stopping rules are exercised), length penalties and
each early_stopping mode; scores and cumulative logprobs equal transformers' too."""

import pytest
import torch

from tokenmill import LLM, BeamSearchParams
from tokenmill.beam_search import BeamSearch
from tokenmill.sampling_params import InvalidParameter

PROMPTS = [[5, 9, 17, 33, 2], [40, 41, 7], [100, 3, 250, 251, 12, 13, 14, 15, 16, 17, 18, 19,
                                            20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def model(tiny_models):
    path, hf = tiny_models("llama")
    with LLM(path, kv_cache_memory_gib=0.05) as llm:
        yield llm, hf.eval()


def _hf(hf, prompt, width, max_tokens, eos, **kw):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                        dtype=torch.long),
                      num_beams=width, num_return_sequences=width, do_sample=False,
                      max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=eos,
                      return_dict_in_generate=True, output_scores=True, **kw)
    return out.sequences.tolist(), out.sequences_scores.tolist()


def _liked_token(llm, prompt) -> int:
    """A token the random model picks often after `prompt` (as EOS, beams end on it)."""
    from tokenmill import SamplingParams

    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24),
                       use_tqdm=False)[0].outputs[0].token_ids
    return max(set(out[2:]), key=out[2:].count)


@pytest.mark.parametrize("width, max_tokens, kw, with_eos", [
    (2, 6, {}, False), (4, 10, {}, True), (3, 8, {"length_penalty": 0.0}, True),
    (3, 8, {"length_penalty": 2.0, "early_stopping": "never"}, True),
    (4, 12, {"early_stopping": True}, True), (4, 9, {"length_penalty": -0.5}, True)])
def test_equals_transformers(model, width, max_tokens, kw, with_eos):
    llm, hf = model
    stops = 0
    for prompt in PROMPTS:
        eos = _liked_token(llm, prompt) if with_eos else 1
        saved = llm.engine.eos_token_ids
        llm.engine.eos_token_ids = [eos]
        try:
            [out] = llm.beam_search({"prompt_token_ids": prompt},
                                    BeamSearchParams(width, max_tokens, **kw))
        finally:
            llm.engine.eos_token_ids = saved
        want, want_scores = _hf(hf, prompt, width, max_tokens, eos, **kw)
        assert len(out.sequences) == width
        for seq, row, score in zip(out.sequences, want, want_scores):
            assert seq.tokens == row[:len(seq.tokens)], (prompt, kw)
            assert all(t == eos for t in row[len(seq.tokens):])  # (transformers' padding)
            assert seq.score == pytest.approx(score, abs=1e-4)
            generated = len(seq.tokens) - len(prompt)
            assert seq.cum_logprob == pytest.approx(
                score * generated ** kw.get("length_penalty", 1.0), abs=1e-3)
            assert seq.finish_reason == ("stop" if seq.tokens[-1] == eos and with_eos
                                         else "length")
        stops += sum(s.finish_reason == "stop" for s in out.sequences)
    if kw.get("length_penalty", 1.0) <= 1.0:  # (EOS endings were exercised)
        assert stops > 0 if with_eos else stops == 0


def test_several_prompts_in_one_call_and_text(model):
    llm, _ = model
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    together = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    alone = [llm.beam_search({"prompt_token_ids": p}, params)[0] for p in PROMPTS]
    assert [[s.tokens for s in o.sequences] for o in together] == \
        [[s.tokens for s in o.sequences] for o in alone]
    seq = together[0].sequences[0]
    assert seq.text == llm.get_tokenizer().decode(seq.tokens[len(PROMPTS[0]):])
    assert llm.beam_search("The quick brown", params)[0].sequences[0].tokens[:3] == \
        llm.get_tokenizer().encode("The quick brown")[:3]


def test_num_return_sequences_and_bad_params():
    search = BeamSearch([1, 2], BeamSearchParams(4, 3, num_return_sequences=2), [0])
    assert search.k == 8 and search.pending() == [[1, 2]]
    for bad in (dict(beam_width=0, max_tokens=3), dict(beam_width=2, max_tokens=0),
                dict(beam_width=2, max_tokens=3, num_return_sequences=3),
                dict(beam_width=2, max_tokens=3, early_stopping="sometimes")):
        with pytest.raises(InvalidParameter):
            BeamSearchParams(**bad)


def test_n_completions_and_beams_share_the_prompt_blocks(tiny_models):
    """n samples of one prompt compute its full blocks once (the others hit them in the same
    step) and sample exactly what each would alone; beam steps reuse the prompt's and the
    beams' earlier blocks."""
    from tokenmill import SamplingParams

    prompt = {"prompt_token_ids": [(i * 37) % 500 + 2 for i in range(100)]}  # 6 full blocks
    with LLM(tiny_models("llama")[0], kv_cache_memory_gib=0.02) as llm:
        kv = llm.engine.core.scheduler.kv_cache
        out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8),
                           use_tqdm=False)[0]
        full = 99 // kv.block_size * kv.block_size
        assert (kv.num_queried_tokens, kv.num_hit_tokens) == (400, 3 * full)
        for i, c in enumerate(out.outputs):
            kv.reset_prefix_cache()
            alone = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3 + i,
                                                        max_tokens=8), use_tqdm=False)[0]
            assert alone.outputs[0].token_ids == c.token_ids
        kv.reset_prefix_cache()
        queried, hit = kv.num_queried_tokens, kv.num_hit_tokens
        llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=20))
        steps_queried = kv.num_queried_tokens - queried
        assert kv.num_hit_tokens - hit >= 0.8 * steps_queried  # (all but the last blocks)


@pytest.mark.parametrize("penalty", [1000.0, -1000.0, 300.0, -300.0])
def test_extreme_length_penalties_rank_instead_of_overflowing(model, penalty):
    """length ** penalty leaves the float range at |penalty| in the hundreds (OverflowError,
    ZeroDivisionError: a 500 on every route): beams are still ranked and returned."""
    llm, _ = model
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=penalty)
    out = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)[0]
    assert len(out.sequences) == 3
    assert all(len(s.tokens) > len(PROMPTS[0]) for s in out.sequences)


def test_the_penalized_score_is_transformers_within_the_float_range():
    from tokenmill.beam_search import _penalized

    assert _penalized(-3.0, 4, 2.0) == -3.0 / 4 ** 2.0
    assert _penalized(-3.0, 4, -0.5) == -3.0 / 4 ** -0.5
    assert _penalized(-3.0, 1000, 1000.0) == 0.0  # (10^3000: past the float range)
    assert _penalized(-3.0, 1000, -1000.0) == float("-inf")
    assert _penalized(0.0, 1000, -1000.0) == 0.0
