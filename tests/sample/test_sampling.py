"""Sampling parameters: validation, reproducible seeds, filters against slow references, stops."""

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.sample.sampler import SamplingBatch, apply_top_k_top_p_min_p, sample

PROMPT = {"prompt_token_ids": [5, 17, 99, 200, 3, 45, 67]}


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama")[0], kv_cache_memory_gib=0.02)


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"stop": [""]}, "stop"),
    ({"logprobs": -1}, "logprobs"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_same_seed_same_output_in_any_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": [9, 9, 9]}, PROMPT, PROMPT],
                         [other, seeded, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different = llm.generate(PROMPT, seeded.clone(seed=99), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    top1 = llm.generate(PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=10,
                                               ignore_eos=True), use_tqdm=False)
    assert top1[0].outputs[0].token_ids == greedy


def test_n_completions_differ_and_reproduce(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) > 1
    (again,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [tuple(c.token_ids) for c in again.outputs] == seqs


def test_stop_strings_tokens_min_max(llm):
    tok = llm.get_tokenizer()
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert base.text == tok.decode(base.token_ids, skip_special_tokens=True)
    # Stop string taken from the middle of the greedy text: output ends right before it.
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 3]
    cut = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[:base.text.index(stop)]
    # Stop token id: generation ends on it, its text is not in the output.
    target = base.token_ids[5]
    first = base.token_ids.index(target)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[target]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == base.token_ids[:first + 1] and c.stop_reason == target
    assert c.text == tok.decode(base.token_ids[:first])
    # min_tokens bans the stop token until reached.
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[target], min_tokens=first + 2),
                       use_tqdm=False)
    assert target not in out[0].outputs[0].token_ids[:first + 2]
    assert len(out[0].outputs[0].token_ids) >= first + 2


def test_eos_stops_unless_ignored(tiny_models):
    llm = LLM(tiny_models("llama")[0], kv_cache_memory_gib=0.02)
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    # Make the 3rd greedy token the EOS id by declaring it so in the engine.
    llm.engine.eos_token_ids = [base[2]]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == base[:3] and c.finish_reason == "stop" and c.stop_reason is None
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == base


def reference_filter(logits, top_k, top_p, min_p):
    """Row by row with Python sorting: the obviously-right version."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        row = logits[r]
        order = sorted(range(len(row)), key=lambda i: -row[i].item())
        keep = set(order[:top_k[r]] if top_k[r] > 0 else order)
        probs = torch.softmax(row, 0)
        if min_p[r] > 0:
            keep &= {i for i in range(len(row)) if probs[i] >= probs.max() * min_p[r]}
        masked = torch.full_like(row, float("-inf"))
        idx = [i for i in order if i in keep]
        masked[idx] = row[idx]
        p = torch.softmax(masked, 0)
        total, nucleus = 0.0, []
        for i in idx:
            if total >= top_p[r]:
                break
            nucleus.append(i)
            total += p[i].item()
        out[r] = float("-inf")
        out[r, nucleus] = row[nucleus]
    return out


def test_filters_match_reference():
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    top_k, top_p, min_p = [0, 5, 1, 0, 10, 3], [1.0, 0.9, 0.5, 0.3, 0.8, 1.0], \
        [0.0, 0.0, 0.0, 0.1, 0.05, 0.0]
    batch = SamplingBatch(temperature=torch.ones(6), top_k=torch.tensor(top_k),
                          top_p=torch.tensor(top_p), min_p=torch.tensor(min_p))
    got = apply_top_k_top_p_min_p(logits, batch)
    assert torch.equal(torch.isinf(got), torch.isinf(reference_filter(logits, top_k, top_p,
                                                                      min_p)))


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    batch = SamplingBatch(temperature=torch.ones(4000))
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample(logits, batch, gen).token_ids, minlength=4).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


def test_penalties_match_transformers_processors():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(1, 30)
    seen = [3, 7, 7, 12]
    batch = SamplingBatch(temperature=torch.zeros(1), repetition_penalty=torch.tensor([1.3]),
                          seen_mask=torch.zeros(1, 30, dtype=torch.bool))
    batch.seen_mask[0, seen] = True
    from tokenmill.sample.sampler import apply_penalties
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), logits.clone())
    torch.testing.assert_close(apply_penalties(logits, batch), ref)
    counts = torch.zeros(1, 30)
    counts[0, 7] = 2
    counts[0, 3] = 1
    batch = SamplingBatch(temperature=torch.zeros(1), frequency_penalty=torch.tensor([0.5]),
                          presence_penalty=torch.tensor([0.25]), output_counts=counts)
    expected = logits.clone()
    expected[0, 7] -= 0.5 * 2 + 0.25
    expected[0, 3] -= 0.5 + 0.25
    torch.testing.assert_close(apply_penalties(logits, batch), expected)


def test_penalties_end_to_end_change_output(llm):
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = llm.generate(PROMPT, plain, use_tqdm=False)[0].outputs[0].token_ids
    pen = llm.generate(PROMPT, plain.clone(repetition_penalty=5.0, presence_penalty=2.0),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(pen)) >= len(set(base))


def test_skip_special_tokens(llm):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            skip_special_tokens=False, stop_token_ids=[])
    out = llm.generate({"prompt_token_ids": [0, 5, 6]}, params, use_tqdm=False)[0].outputs[0]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=False)


def test_banned_by_bad_words_matches_suffixes():
    from tokenmill.sample.sampler import banned_by_bad_words

    words = [[5], [7, 8], [1, 2, 3]]
    assert banned_by_bad_words([], words) == [5]
    assert banned_by_bad_words([9, 7], words) == [5, 8]
    assert banned_by_bad_words([1, 2], words) == [5, 3]
    assert banned_by_bad_words([2, 1], words) == [5]


def test_bad_words_are_never_generated(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 99, 200]}
    base = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    # Ban the first real word the model says.
    words = [tokenizer.decode([t]).strip() for t in base.token_ids]
    word = next(w for w in words if w.isalpha())
    banned = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word])
    out = llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0]
    forbidden = [tokenizer.encode(f, add_special_tokens=False) for f in (word, " " + word)]
    for seq in forbidden:
        n = len(seq)
        assert all(out.token_ids[i:i + n] != seq for i in range(len(out.token_ids)))
    assert out.token_ids != base.token_ids
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])


def test_greedy_argmax_kernel_matches_torch():
    """The compiled greedy argmax gives torch.argmax's answer: the first of tied maxima, the
    first NaN when a row has one, rows of -inf / +inf, lengths around the 8-lane blocks, rows
    of a wider matrix (a strided view)."""
    from tokenmill import csrc

    if not csrc.available():
        pytest.skip("no compiled CPU kernels")
    torch.manual_seed(3)
    for rows, vocab in [(1, 1), (3, 7), (4, 8), (5, 9), (16, 1000), (2, 49152)]:
        x = torch.randn(rows, vocab)
        assert torch.equal(csrc.argmax_rows(x), x.argmax(dim=-1)), (rows, vocab)
    x = torch.randn(8, 203)
    x[0] = 1.5  # all tied: the first
    x[1, [17, 130, 131]] = 9.0  # tied maxima in different 8-lane blocks
    x[2, [4, 120]] = float("nan")  # NaN wins, the first one
    x[3, 202] = float("nan")  # in the tail past the last full block
    x[4] = float("-inf")
    x[5, [50, 60]] = float("inf")
    x[6, 201] = 99.0  # maximum in the tail
    x[7, 0] = 99.0
    assert torch.equal(csrc.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(6, 300)
    view = wide[:, 40:240]
    assert torch.equal(csrc.argmax_rows(view), view.argmax(dim=-1))
    # the sampler's greedy rows take it
    batch = SamplingBatch(temperature=torch.zeros(8))
    assert torch.equal(sample(x, batch).token_ids, x.argmax(dim=-1))


def test_logit_bias_forces_and_bans_tokens(llm):
    """+100 on a token makes greedy decoding pick it every time; -100 on the tokens greedy
    picked bans them; seeded sampling with a bias reproduces."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate(PROMPT, greedy.clone(logit_bias={7: 100.0}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [7] * 8
    banned = llm.generate(PROMPT, greedy.clone(logit_bias={t: -100 for t in set(base)}),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert not set(banned) & set(base)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=8, logit_bias={3: 5.0})
    runs = [llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_stop_strings_wait_for_min_tokens(llm):
    """min_tokens holds back stop strings as it holds back stop tokens (vLLM checks stop
    strings only once the output has more than min_tokens tokens): a stop string in the
    first min_tokens tokens' text does not end the output."""
    tok = llm.get_tokenizer()
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = tok.decode(base.token_ids[1:2])  # the text of the second token
    assert stop and stop in base.text
    early = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    held = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                               stop=[stop], min_tokens=10),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 10
    assert held.token_ids == base.token_ids[:len(held.token_ids)]
    later = base.text.find(stop, len(tok.decode(base.token_ids[:10])) - len(stop) + 1)
    if later < 0:
        assert held.finish_reason == "length" and held.text == base.text
    else:
        assert held.finish_reason == "stop" and held.text == base.text[:later]

